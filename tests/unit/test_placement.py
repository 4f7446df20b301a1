"""placement: colocated in the spec, the rollout server's command and the pod."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orbit_operator.pod import SHARE_DIR_ENV, build_pod
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import validate_job
from orbit_runtime.config import parse_job_spec
from orbit_runtime.errors import OrbitError
from orbit_runtime.rollout.server import WORKER_EXTENSION, VLLMServerConfig
from orbit_runtime.shared_base import transport

ROOT = Path(__file__).resolve().parents[2]


def _job(**overrides) -> dict:
    return {"model": {"path": "/m", "dtype": "fp16"}, "placement": "colocated", **overrides}


def test_separate_is_the_default_and_colocated_is_accepted():
    assert parse_job_spec({"model": {"path": "/m"}}).placement == "separate"
    assert parse_job_spec(_job()).placement == "colocated"


@pytest.mark.parametrize(("overrides", "field"), [
    ({"reference": {"mode": "server"}}, "reference.mode must be shared"),
    ({"model": {"path": "/m", "dtype": "fp16", "learner_dtype": "fp32"}}, "model.learner_dtype must be unset or fp16"),
    ({"learner": {"device": "cuda"}}, "learner.device cannot be cuda"),
    ({"rollout": {"tensor_parallel_size": 2}}, "rollout.tensor_parallel_size must be 1"),
])  # fmt: skip
def test_colocated_refuses_what_it_cannot_do_naming_the_field(overrides, field):
    with pytest.raises(OrbitError, match="placement colocated") as error:
        parse_job_spec(_job(**overrides))
    assert field in str(error.value)


def test_a_matching_learner_dtype_is_fine():
    assert parse_job_spec(_job(model={"path": "/m", "dtype": "bf16", "learner_dtype": "bf16"})).placement == "colocated"


def test_only_a_colocated_engine_opens_vllms_dev_routes_and_loads_orbits_extension(tmp_path):
    separate = VLLMServerConfig(tmp_path)
    colocated = VLLMServerConfig(tmp_path, colocated=True)
    assert "--worker-extension-cls" not in separate.command(8000)
    assert "VLLM_SERVER_DEV_MODE" not in separate.environment() or separate.environment()["VLLM_SERVER_DEV_MODE"] != "1"
    command = colocated.command(8000)
    assert command[command.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    env = colocated.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_INT4_W4A8"] == "0"
    assert "--middleware" in command  # the dev routes (/collective_rpc, /sleep) need the run's key like any other


def test_the_cpu_workers_core_reservation_is_vllms_unless_told_otherwise(tmp_path, monkeypatch):
    """Orbit leaves VLLM_CPU_NUM_OF_RESERVED_CPU to vLLM (its worker computes on a core fewer, with
    log-probs that repeat from run to run); a value the user set reaches the engine."""
    from orbit_runtime.rollout.server import RESERVED_CPUS_ENV

    monkeypatch.delenv(RESERVED_CPUS_ENV, raising=False)
    assert RESERVED_CPUS_ENV not in VLLMServerConfig(tmp_path).environment()
    monkeypatch.setenv(RESERVED_CPUS_ENV, "0")
    assert VLLMServerConfig(tmp_path).environment()[RESERVED_CPUS_ENV] == "0"


def _cpu_job(**spec_overrides) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "rljob-cpu.yaml").read_text())
    job["spec"]["model"] = {"dtype": "fp16"}
    job["spec"].update({"placement": "colocated", **spec_overrides})
    return job


def test_the_colocated_pod_tells_the_learner_where_the_rollout_finds_its_socket():
    spec = validate_job(_cpu_job()).spec
    pod = build_pod("c", "ml", spec, OperatorSettings(cache_root="/mnt/orbit-cache"))
    (learner,) = pod["spec"]["containers"]
    rollout = next(c for c in pod["spec"]["initContainers"] if c["name"] == "rollout")
    env = {e["name"]: e.get("value") for e in learner["env"]}
    assert SHARE_DIR_ENV == transport.SHARE_DIR_ENV and env[SHARE_DIR_ENV] == "/dev/shm"
    shm = {"name": "dshm", "mountPath": "/dev/shm"}
    assert shm in learner["volumeMounts"] and shm in rollout["volumeMounts"]  # one volume, one path, both containers
    separate = build_pod("s", "ml", validate_job(_cpu_job(placement="separate")).spec, OperatorSettings(cache_root="/c"))
    assert SHARE_DIR_ENV not in {e["name"] for e in separate["spec"]["containers"][0]["env"]}


def test_colocated_on_gpus_is_refused_naming_the_resources():
    job = _cpu_job()
    job["spec"]["resources"]["rollout"]["gpus"] = 1
    check = validate_job(job)
    assert check.spec is None and any("resources.rollout.gpus and resources.learner.gpus must be 0" in e for e in check.errors), check.errors


def test_a_colocated_learner_container_is_not_asked_to_hold_a_copy_of_the_base():
    from orbit_operator.fit import plan_request
    from orbit_runtime.plan.catalog import catalog_architecture
    from orbit_runtime.plan.job_fit import fit_job

    arch = catalog_architecture("qwen2.5-7b")
    fits = {}
    for placement in ("separate", "colocated"):
        spec = validate_job(_cpu_job(placement=placement)).spec
        fit = fit_job(arch, plan_request(spec, OperatorSettings(cache_root="/c")))
        (learner,) = [g for g in fit.groups if g.roles == ("learner",)]
        fits[placement] = learner.rows
    assert fits["separate"]["base_int4"] > 3 * 2**30  # ~7B in INT4
    assert fits["colocated"]["base_int4"] == fits["colocated"]["base_16bit"] == 0
    assert fits["colocated"]["activations"] == fits["separate"]["activations"]


def test_on_a_cpu_node_between_one_and_two_copies_orbit_plan_recommends_colocated():
    from orbit_runtime.plan.catalog import catalog_architecture
    from orbit_runtime.plan.planner import make_plan
    from orbit_runtime.plan.request import NodeSpec, from_job_spec

    arch = catalog_architecture("qwen2.5-7b")
    spec = parse_job_spec({"model": {"path": "/m", "dtype": "bf16"}})
    roomy = make_plan(arch, from_job_spec(spec, node=NodeSpec(gpus=0, host_memory_bytes=2**40)))
    separate, shared = (roomy.layouts[n].tightest.total for n in ("separate", "shared"))
    one_copy = roomy.base.on_gpu(1, "bf16")
    assert separate - shared == sum(one_copy)  # exactly the learner's copy
    between = separate - sum(one_copy) // 2
    tight = make_plan(arch, from_job_spec(spec, node=NodeSpec(gpus=0, host_memory_bytes=between)))
    assert not tight.layouts["separate"].fits and tight.layouts["shared"].fits and tight.recommended == "shared"
