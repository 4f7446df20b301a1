"""`orbit plan`, `orbit validate`'s fit check and `orbit prepare-base --plan`, as a user runs them."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from orbit_operator.fit import plan_request
from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.settings import OperatorSettings
from orbit_runtime.cli import app
from orbit_runtime.plan_command import DOES_NOT_FIT_EXIT


def orbit(*args: str):
    return CliRunner().invoke(app, list(args))


def manifest(**spec) -> dict:
    base = {"uri": "s3://models/x", "architecture": "deepseek-v3"}
    return {"apiVersion": "orbit.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "big"},
            "spec": {"base": base, "checkpoint": {"uri": "s3://ckpt/big"}, **spec}}  # fmt: skip


def gpu_job(product: str, rollout: int = 4, learner: int = 4, memory: str = "1500Gi", **spec) -> dict:
    return manifest(nodeSelector={"nvidia.com/gpu.product": product},
                    resources={"rollout": {"gpus": rollout, "memory": memory}, "learner": {"gpus": learner, "memory": memory}},
                    rollout={"tensor_parallel_size": rollout, "max_tokens": 1024, "max_model_len": 2048}, **spec)  # fmt: skip


def test_plan_json_of_a_catalog_model(tmp_path):
    result = orbit("plan", "deepseek-v3", "--json", "--gpu", "H200", "--gpus", "8", "--prompt-tokens", "1024",
                   "--completion-tokens", "1024")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["total_params"] == 671_026_419_200 and doc["mtp_params"] > 0
    assert {k: doc[k]["fits"] for k in ("separate", "shared", "full_finetune")} == {"separate": False, "shared": True, "full_finetune": False}
    assert doc["separate"]["binding"] == "base_int4" and doc["full_finetune"]["nodes"] == 10
    table = orbit("plan", "deepseek-v3", "--gpu", "H100")
    assert table.exit_code == 0 and "GiB per GPU" in table.output and "recommended:" in table.output, table.output


def test_plan_reads_a_config_json_a_model_directory_and_an_orbit_train_config(tmp_path, int4_dir):
    by_file = json.loads(orbit("plan", str(int4_dir / "config.json"), "--json").output)
    by_dir = json.loads(orbit("plan", str(int4_dir), "--json").output)
    assert by_file["total_params"] == by_dir["total_params"] > 0
    assert by_file["quantization"]["source"] == "the checkpoint's quantization_config"  # the INT4 base's own config
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(int4_dir)}, "rollout": {"prompts_per_step": 3, "group_size": 5,
                                                                                     "max_tokens": 20, "max_model_len": 100}}))
    doc = json.loads(orbit("plan", str(config), "--json", "--gpu", "cpu", "--host-memory-gib", "24").output)
    assert doc["job"]["prompts"] == 3 and doc["job"]["group"] == 5 and doc["job"]["prompt_tokens"] == 80
    assert doc["node"]["name"] == "cpu" and doc["separate"]["fits"] and doc["shared"]["fits"]  # placement colocated is built for CPU


def test_plan_of_an_rljob_plans_its_own_pod(tmp_path):
    path = tmp_path / "rljob.yaml"
    path.write_text(yaml.safe_dump(gpu_job("NVIDIA-H200")))
    doc = json.loads(orbit("plan", str(path), "--json").output)
    assert doc["node"]["name"] == "8 x H200"  # from the job's nodeSelector
    # its pod: rollout on 4 GPUs, the learner on one of its 4 (today's learner): the whole base on one H200
    assert doc["job_fit"]["fits"] is False and "learner on 1 x H200 needs" in doc["job_fit"]["message"]
    assert "one shared copy (placement: colocated) would fit" in doc["job_fit"]["message"]  # what would
    human = orbit("plan", str(path))
    assert "this job's pod" in human.output and "does not fit" in human.output, human.output


def test_plan_errors_are_one_line(tmp_path):
    unknown = orbit("plan", "no-such-model")
    assert unknown.exit_code == 2 and "no-such-model" in unknown.output and "Traceback" not in unknown.output
    nameless = tmp_path / "rljob.yaml"
    job = manifest()
    del job["spec"]["base"]["architecture"]
    nameless.write_text(yaml.safe_dump(job))
    result = orbit("plan", str(nameless))
    assert result.exit_code == 2 and "--model-config" in result.output, result.output
    assert orbit("plan", "deepseek-v3", "--gpu", "A100").exit_code == 2
    assert orbit("plan", "--list").output.split() == sorted(orbit("plan", "--list").output.split())


def test_validate_refuses_a_job_that_cannot_fit_naming_what_binds(tmp_path):
    path = tmp_path / "rljob.yaml"
    path.write_text(yaml.safe_dump_all([gpu_job("NVIDIA-H200"), {**gpu_job("NVIDIA-H200", rollout=1, learner=1, memory="64Gi"),
                                                                 "metadata": {"name": "small"}}]))  # fmt: skip
    result = orbit("validate", str(path))
    assert result.exit_code == 1
    assert "DoesNotFit: learner on 1 x H200 needs" in result.output and "base_int4" in result.output, result.output
    # the same job with a model that fits: valid, with the plan's summary
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(gpu_job("NVIDIA-H200", rollout=1, learner=1, memory="64Gi",
                                            base={"uri": "s3://m/x", "architecture": "qwen3-8b"})))  # fmt: skip
    ok = orbit("validate", str(small))
    assert ok.exit_code == 0 and "valid; fits: rollout 1xH200" in ok.output, ok.output
    # a job that names no model is checked when --model-config names it
    plain = tmp_path / "plain.yaml"
    job = gpu_job("NVIDIA-H200")
    del job["spec"]["base"]["architecture"]
    plain.write_text(yaml.safe_dump(job))
    assert orbit("validate", str(plain)).exit_code == 0
    assert orbit("validate", str(plain), "--model-config", "deepseek-v3").exit_code == 1
    # with no GPU named anywhere, GPU memory is unknown: only host memory is checked (and said)
    unnamed = tmp_path / "unnamed.yaml"
    job = gpu_job("NVIDIA-H200", rollout=1, learner=1, base={"uri": "s3://m/x", "architecture": "qwen3-8b"})
    del job["spec"]["nodeSelector"]
    unnamed.write_text(yaml.safe_dump(job))
    result = orbit("validate", str(unnamed))
    assert result.exit_code == 0 and "GPU memory unknown" in result.output, result.output
    assert "rollout 1xH100" in orbit("validate", str(unnamed), "--gpu", "H100").output


def cpu_plan(tmp_path, memory: str) -> str:
    """The plan.json the operator writes for a CPU job of the demo model with this learner memory limit."""
    spec = RLTrainingJobSpec.model_validate({"base": {"uri": "s3://b/demo"},
                                             "resources": {"rollout": {"gpus": 0, "memory": "4Gi"}, "learner": {"gpus": 0, "memory": memory}}})  # fmt: skip
    path = tmp_path / f"plan-{memory}.json"
    path.write_text(plan_request(spec, OperatorSettings()).model_dump_json())
    return str(path)


def test_prepare_base_refuses_a_pod_that_cannot_fit_before_preparing_anything(tmp_path, demo_dir):
    cache, message = tmp_path / "cache", tmp_path / "termination-log"
    cache.mkdir()
    args = ["prepare-base", "--cache", str(cache), "--source", str(demo_dir), "--termination-log", str(message)]
    refused = orbit(*args, "--plan", cpu_plan(tmp_path, "100Mi"), "--enforce-fit")
    assert refused.exit_code == DOES_NOT_FIT_EXIT, refused.output
    report = json.loads(message.read_text())
    assert report["reason"] == "DoesNotFit" and "learner container needs" in report["message"] and "of 0.1 GiB" in report["message"]
    assert not (cache / "model").exists()  # nothing was quantized
    # not enforced (a later pod of a job that already ran): it warns and prepares
    allowed = orbit(*args, "--plan", cpu_plan(tmp_path, "100Mi"))
    assert allowed.exit_code == 0 and (cache / "model" / "config.json").is_file(), allowed.output
    assert json.loads(message.read_text())["plan"].startswith("does not fit")
    fits = orbit(*args, "--plan", cpu_plan(tmp_path, "4Gi"), "--enforce-fit")
    assert fits.exit_code == 0 and set(json.loads(message.read_text())) == {"plan", "base"}  # no reason: it fits
    assert json.loads(message.read_text())["base"].startswith("verified (source unchanged): sha256:")
    assert json.loads(message.read_text())["plan"].startswith("fits: rollout ")


def test_prepare_base_without_a_readable_plan_never_stops_the_job(tmp_path, demo_dir):
    cache = tmp_path / "cache"
    cache.mkdir()
    result = orbit("prepare-base", "--cache", str(cache), "--source", str(demo_dir), "--plan", str(tmp_path / "missing.json"),
                   "--enforce-fit")  # fmt: skip
    assert result.exit_code == 0 and "the job was not planned" in result.output, result.output


def test_compare_sets_each_measured_step_against_the_plan(tmp_path, int4_dir):
    """A run directory as the trainer writes it (job.json, step rows with their start and peak memory):
    a fresh run's step 1 is compared with the first-step plan (AdamW's moments allocated), the others
    with the later-step plan; a run without step-start memory is refused naming the file."""
    from orbit_runtime.config import parse_job_spec
    from orbit_runtime.plan.architecture import read_architecture
    from orbit_runtime.plan.planner import learner_step
    from orbit_runtime.plan.request import from_job_spec

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    spec = parse_job_spec({"model": {"path": str(int4_dir)}, "adapter": {"rank": 8}})
    (run / "job.json").write_text(spec.model_dump_json())
    mib = 2**20
    rows = [{"kind": "step", "step": s, "rss_at_step_start_bytes": 1000 * mib, "peak_rss_bytes": (1000 + extra) * mib}
            for s, extra in ((1, 60), (2, 20), (3, 30))]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"kind": "eval", "step": 0}, *rows]) + '{"torn')
    result = orbit("plan", "--compare", str(run), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    arch, request = read_architecture(int4_dir), from_job_spec(spec)
    first, later = learner_step(arch, request, first=True).peak, learner_step(arch, request, first=False).peak
    assert doc["device"] == "cpu" and doc["steps"] == 3
    assert doc["planned"]["first_step_bytes"] == first and doc["planned"]["later_step_bytes"] == later
    assert doc["measured"]["first_step_peak_above_start_bytes"] == 60 * mib and doc["ratio_first_step"] == round(60 * mib / first, 3)
    assert doc["measured"]["later_step_peak_above_start_bytes"] == 30 * mib and doc["ratio_later_steps"] == round(30 * mib / later, 3)
    assert "first step:" in orbit("plan", "--compare", str(run)).output
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 1, "peak_rss_bytes": 1}) + "\n")
    old = orbit("plan", "--compare", str(run))
    assert old.exit_code == 2 and "metrics.jsonl: no step rows with step-start memory" in old.output, old.output
