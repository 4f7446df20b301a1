"""The learner's placement and memory settings: spec validation, device resolution, the
vLLM flags the rollout settings become, and per-step peak memory."""

import pytest
import torch

from orbit_runtime.config import parse_job_spec
from orbit_runtime.config.fingerprint import config_hash, training_fields
from orbit_runtime.errors import OrbitError
from orbit_runtime.learner.device import resolve_device
from orbit_runtime.trainer.roles import rollout_server_config

BASE = {"model": {"path": "/models/base"}}


def test_learner_defaults_and_bad_values_name_the_field():
    spec = parse_job_spec(BASE)
    assert (spec.learner.device, spec.learner.gradient_checkpointing, spec.learner.micro_batch_tokens) == ("auto", True, 16384)
    with pytest.raises(OrbitError, match=r"learner\.device"):
        parse_job_spec({**BASE, "learner": {"device": "tpu"}})
    with pytest.raises(OrbitError, match=r"learner\.micro_batch_tokens"):
        parse_job_spec({**BASE, "learner": {"micro_batch_tokens": 0}})
    with pytest.raises(OrbitError, match=r"algorithm\.minibatches \(9\) exceeds the samples per step"):
        parse_job_spec({**BASE, "rollout": {"prompts_per_step": 2, "group_size": 4}, "algorithm": {"minibatches": 9}})
    with pytest.raises(OrbitError, match=r"rollout\.gpu_memory_utilization"):
        parse_job_spec({**BASE, "rollout": {"gpu_memory_utilization": 1.5}})


def test_where_it_runs_does_not_change_the_fingerprint_but_minibatches_do():
    plain = config_hash(training_fields(parse_job_spec(BASE)))
    moved = parse_job_spec({**BASE, "learner": {"device": "cuda", "micro_batch_tokens": 4096, "gradient_checkpointing": False},
                            "rollout": {"gpu_memory_utilization": 0.5, "tensor_parallel_size": 2, "max_num_seqs": 64}})  # fmt: skip
    assert config_hash(training_fields(moved)) == plain
    assert config_hash(training_fields(parse_job_spec({**BASE, "algorithm": {"minibatches": 2}}))) != plain


def test_cuda_without_a_gpu_is_a_config_error_and_auto_falls_back_to_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU runner: no skip
    with pytest.raises(OrbitError, match=r"learner\.device is cuda, but torch .* sees no CUDA device"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_rollout_gpu_settings_become_vllm_flags(tmp_path):
    spec = parse_job_spec({**BASE, "rollout": {"gpu_memory_utilization": 0.6, "tensor_parallel_size": 2,
                                                "enable_prefix_caching": False, "max_num_seqs": 64, "max_model_len": 2048}})  # fmt: skip
    command = rollout_server_config(spec, tmp_path / "vllm.log").command(port=8000)
    flags = " ".join(command)
    for expected in ("--gpu-memory-utilization 0.6", "--tensor-parallel-size 2", "--no-enable-prefix-caching",
                     "--max-num-seqs 64", "--max-model-len 2048"):  # fmt: skip
        assert expected in flags
    # the learner on the same GPU: vLLM does not get its default 90%, unless the spec says so
    shared = rollout_server_config(parse_job_spec(BASE), tmp_path / "vllm.log", torch.device("cuda", 0)).command(port=8000)
    assert "--gpu-memory-utilization 0.5" in " ".join(shared)
    assert "--gpu-memory-utilization 0.6" in " ".join(rollout_server_config(spec, tmp_path / "v.log", torch.device("cuda", 0)).command(8000))
    defaults = " ".join(rollout_server_config(parse_job_spec(BASE), tmp_path / "vllm.log").command(port=8000))
    for unset in ("--gpu-memory-utilization", "--tensor-parallel-size", "prefix-caching", "--max-num-seqs"):
        assert unset not in defaults  # vLLM's own defaults apply


def test_enforce_eager_only_where_vllm_needs_it(tmp_path, monkeypatch):
    """--enforce-eager disables CUDA graphs: on the CPU build it is the only mode, on a GPU it
    slows decode several-fold (not measurable here), so it is the default only on CPU."""
    import orbit_runtime.rollout.server as server

    def flags(build_is_cpu: bool, **rollout) -> list[str]:
        monkeypatch.setattr(server, "is_cpu_build", lambda: build_is_cpu)
        return rollout_server_config(parse_job_spec({**BASE, "rollout": rollout}), tmp_path / "v.log").command(port=8000)

    assert "--enforce-eager" in flags(True)
    assert "--enforce-eager" not in flags(False)  # a GPU build keeps CUDA graphs
    assert "--enforce-eager" in flags(False, enforce_eager=True)  # or the spec asks for eager (debugging)
    assert "--enforce-eager" not in flags(True, enforce_eager=False)
    assert config_hash(training_fields(parse_job_spec({**BASE, "rollout": {"enforce_eager": True}}))) == config_hash(
        training_fields(parse_job_spec(BASE))
    )  # how vLLM executes is not what it computes: resumable either way


PEAK_PROBE = """
import json, torch
from orbit_runtime.observability.peak_memory import PeakMemory
tracker = PeakMemory(torch.device("cpu"))
tracker.reset()
big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
del big
step = tracker.read()
tracker.reset()
print(json.dumps({"step": step, "second": tracker.read()["peak_rss_bytes"], "per_step": tracker.rss_peak_is_per_step}))
"""


def test_peak_memory_is_per_step():
    """Linux resets VmHWM on a write to /proc/self/clear_refs; CI runs Linux, so no skip: a
    machine without it fails here rather than hiding the per-step peak. In a fresh process: in
    the test process, memory earlier tests freed but the allocator kept can serve the 64 MiB
    without the resident set growing (seen in CI: the step's peak equalled the next one's)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, check=True).stdout
    probe = json.loads(out.strip().splitlines()[-1])
    step, first = probe["step"], probe["step"]["peak_rss_bytes"]
    assert probe["per_step"]  # Linux: VmHWM is reset by clear_refs
    assert first - probe["second"] > 48 * 2**20  # the reset forgot the first step's peak
    assert 48 * 2**20 < first - step["rss_at_step_start_bytes"] < 96 * 2**20  # what the step added (orbit plan --compare)
