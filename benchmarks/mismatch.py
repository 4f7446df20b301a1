"""Train-rollout log-prob mismatch: Orbit's shared INT4 base vs the traditional 16-bit learner.

Every scheme scores the SAME tokens, sampled once per seed by a real vLLM server running the
INT4 base plus a LoRA adapter:
  orbit_vllm_rounding    learner = the same INT4 base + the same adapter, its LoRA forward
                         rounded where vLLM's LoRA kernels round (learner.lora_rounding: vllm,
                         the default)
  orbit_fp32_lora        the same, with PEFT's forward (one fp32 adapter delta: what Orbit
                         did before, learner.lora_rounding: fp32)
  traditional            learner = the original 16-bit weights + the same adapter (what a
                         learner that trains on the 16-bit checkpoint while vLLM serves an
                         INT4 copy sees), with PEFT's forward
and, on a second vLLM server started for `placement: colocated` (vLLM's W4A16 CPU kernel,
which colocated engines run; on AMX CPUs vLLM's default for bf16 is a W4A8 kernel):
  colocated              learner = vLLM's own weight pages and INT4 kernel + the same adapter
                         (vLLM's LoRA rounding): placement colocated
  separate_same_kernel   learner = orbit_vllm_rounding's (the checkpoint dequantized by Orbit)
                         scoring the colocated server's tokens: separate placement against an
                         engine with the same kernel, so kernel choice and sharing show apart
Run for bf16 and fp16 (vLLM and learner in the same dtype), for each --seeds (a seed draws
the adapter and the prompts), on the random-init demo model and on the warmed-up one that
`make demo` trains (--models). Per run: mean, p99 and max |dlogp| over the sampled tokens,
k3 KL, and the per-sequence importance ratio exp(sum learner - sum rollout) (its min, max
and the std of its log), plus the kernels each side ran (vLLM's INT4 linear kernel from its
log; the oneDNN matmul torch's bf16 and fp16 linears dispatch to on this CPU). Summaries give the median and spread over
seeds and the traditional / Orbit ratio per seed.

    python benchmarks/mismatch.py --json benchmarks/results/mismatch.json
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
SCHEMES = ("orbit_vllm_rounding", "orbit_fp32_lora", "traditional", "colocated", "separate_same_kernel")


def sample_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def token_stats(learner, rollout) -> dict:
    """Mean / p99 / max |dlogp|, k3 KL, and the spread of the per-sequence importance ratio."""
    import torch

    from orbit_runtime.algorithms.mismatch import measure_mismatch

    base = measure_mismatch([t.float() for t in learner], rollout).as_dict()
    delta = torch.cat([(a.double() - b.double()).abs() for a, b in zip(learner, rollout, strict=True)])
    log_ratio = torch.tensor([float(a.double().sum() - b.double().sum()) for a, b in zip(learner, rollout, strict=True)])
    return {
        **base,
        "p99_abs_dlogp": float(delta.quantile(0.99)),
        "sequence_ratio_min": float(log_ratio.exp().min()),
        "sequence_ratio_max": float(log_ratio.exp().max()),
        "sequence_log_ratio_std": float(log_ratio.std()),
    }


ONEDNN_PROBE = """
import torch
for dtype in (torch.bfloat16, torch.float16):
    torch.nn.functional.linear(torch.randn(64, 256).to(dtype), torch.randn(128, 256).to(dtype))
"""


def kernels(log_path: Path) -> dict:
    """Which kernels ran. vLLM: what its log names at INFO (its INT4 linear kernel; its CPU build does not
    name its attention backend there).
    The learner: the oneDNN implementation torch's bf16 and fp16 linears dispatch to on this CPU
    (ONEDNN_VERBOSE on a probe in a subprocess), and torch's CPU capability."""
    import subprocess

    import torch

    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    vllm = sorted(set(re.findall(r"Using (\S+) (?:for|backend)", text)))
    probe = subprocess.run([sys.executable, "-c", ONEDNN_PROBE], capture_output=True, text=True,
                           env={**os.environ, "ONEDNN_VERBOSE": "1"})  # fmt: skip
    matmuls = [line.split(",") for line in probe.stdout.splitlines() if ",exec,cpu,matmul," in line]
    learner = {fields[8].split(":")[1].split("::")[0]: fields[6] for fields in matmuls if len(fields) > 8}
    return {"vllm": vllm, "learner_onednn_matmul": learner, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def sample(client, name: str, seed: int, args: argparse.Namespace) -> tuple[list, list]:
    """The seed's prompts sampled under adapter NAME: (prompt, completion) pairs and vLLM's log-probs."""
    import torch

    groups = client.generate(sample_prompts(args.prompts, args.prompt_vocab, seed), model=name, n=args.samples_per_prompt,
                             max_tokens=args.max_tokens, temperature=1.0, seed=seed, ignore_eos=True)  # fmt: skip
    completions = [c for group in groups for c in group]
    return [(c.prompt_ids, c.token_ids) for c in completions], [torch.tensor(c.logprobs) for c in completions]


def run_dtype(dtype: str, src: Path, int4: Path, args: argparse.Namespace, workdir: Path) -> dict:
    """One vLLM server in DTYPE; every seed's adapter is loaded into it under its own name."""
    import torch

    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_dense_policy, load_policy
    from orbit_runtime.rollout.client import RolloutClient, adapter_name
    from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig

    adapter = AdapterSpec(rank=args.rank, alpha=2 * args.rank)
    learners = {
        "orbit_vllm_rounding": load_policy(int4, adapter, dtype=dtype, lora_rounding="vllm"),
        "orbit_fp32_lora": load_policy(int4, adapter, dtype=dtype, lora_rounding="fp32"),
        "traditional": load_dense_policy(src, adapter, dtype=dtype),
    }
    log = workdir / f"vllm-{dtype}.log"
    config = VLLMServerConfig(int4, dtype=DTYPES[dtype], max_lora_rank=args.rank, log_path=log, max_loras=len(args.seeds) + 1)
    runs = []
    with VLLMServer(config) as server:
        client = RolloutClient(server.base_url)
        for index, seed in enumerate(args.seeds):
            reference = learners["orbit_fp32_lora"]
            reference.init_adapter_randomly(std=args.adapter_std, seed=seed)
            for learner in learners.values():
                learner.load_adapter_state(reference.adapter_state())
            name = adapter_name(index + 1)
            client.load_adapter(name, reference.save_adapter(workdir / f"adapter-{dtype}-{seed}"))
            started = time.monotonic()
            pairs, rollout = sample(client, name, seed, args)
            run: dict = {"seed": seed, "generate_seconds": round(time.monotonic() - started, 2)}
            with torch.no_grad():
                for scheme, learner in learners.items():
                    run[scheme] = token_stats(learner.completion_logprobs(pairs), rollout)
            run["ratio_traditional_over_orbit"] = round(
                run["traditional"]["mean_abs_dlogp"] / run["orbit_vllm_rounding"]["mean_abs_dlogp"], 2
            )
            run["ratio_fp32_lora_over_vllm_rounding"] = round(
                run["orbit_fp32_lora"]["mean_abs_dlogp"] / run["orbit_vllm_rounding"]["mean_abs_dlogp"], 3
            )
            runs.append(run)
        client.close()
    colocated_log = workdir / f"vllm-{dtype}-colocated.log"
    for run, (_name, stats) in zip(runs, colocated_runs(dtype, int4, args, workdir, learners, colocated_log), strict=True):
        run.update(stats)
        # the fair ratio: both learners against the same engine (the colocated one's W4A16 kernel)
        run["ratio_separate_over_colocated"] = round(run["separate_same_kernel"]["mean_abs_dlogp"] / run["colocated"]["mean_abs_dlogp"], 2)
        # and what a separate run sees against vLLM's default kernel (W4A8 for bf16 on AMX CPUs)
        run["ratio_default_engine_separate_over_colocated"] = round(
            run["orbit_vllm_rounding"]["mean_abs_dlogp"] / run["colocated"]["mean_abs_dlogp"], 2
        )
    return {"runs": runs, "summary": summarize(runs), "kernels": kernels(log), "colocated_kernels": kernels(colocated_log)}


def colocated_runs(dtype: str, int4: Path, args: argparse.Namespace, workdir: Path, learners: dict, log: Path):
    """Per seed: the colocated learner and the separate one on tokens a colocated-mode server sampled."""
    import torch

    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_colocated_policy
    from orbit_runtime.rollout.client import RolloutClient, adapter_name
    from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig
    from orbit_runtime.shared_base.attach import attach_shared_base

    config = VLLMServerConfig(int4, dtype=DTYPES[dtype], max_lora_rank=args.rank, log_path=log, max_loras=len(args.seeds) + 1,
                              colocated=True)  # fmt: skip
    out = []
    with VLLMServer(config) as server:
        client = RolloutClient(server.base_url)
        attached = attach_shared_base(client)
        colocated = load_colocated_policy(int4, AdapterSpec(rank=args.rank, alpha=2 * args.rank), attached.tensors,
                                          attached.meta["isa_hint"], dtype=dtype, lora_rounding="vllm")  # fmt: skip
        separate, reference = learners["orbit_vllm_rounding"], learners["orbit_fp32_lora"]
        for index, seed in enumerate(args.seeds):
            reference.init_adapter_randomly(std=args.adapter_std, seed=seed)
            for learner in (colocated, separate):
                learner.load_adapter_state(reference.adapter_state())
            name = adapter_name(index + 1)
            client.load_adapter(name, reference.save_adapter(workdir / f"adapter-{dtype}-{seed}-colocated"))
            pairs, rollout = sample(client, name, seed, args)
            with torch.no_grad():
                stats = {"colocated": token_stats(colocated.completion_logprobs(pairs), rollout),
                         "separate_same_kernel": token_stats(separate.completion_logprobs(pairs), rollout)}  # fmt: skip
            out.append((name, stats))
        client.close()
        attached.close()
    return out


def summarize(runs: list[dict]) -> dict:
    """Median, min and max over seeds of each scheme's figures and of the ratios."""

    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out: dict = {}
    for scheme in SCHEMES:
        out[scheme] = {key: spread([r[scheme][key] for r in runs]) for key in ("mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp",
                                                                              "sequence_log_ratio_std")}  # fmt: skip
    for ratio in ("ratio_traditional_over_orbit", "ratio_fp32_lora_over_vllm_rounding", "ratio_separate_over_colocated",
                  "ratio_default_engine_separate_over_colocated"):
        out[ratio] = spread([r[ratio] for r in runs])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the result here as well as to stdout")
    parser.add_argument("--models", nargs="+", default=["random", "warmed"], choices=["random", "warmed"],
                        help="the demo model at random init, and after `make demo`'s supervised warm-up")
    parser.add_argument("--warmup-steps", type=int, default=400, help="as `orbit demo-model --warmup-steps` (make demo)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-vocab", type=int, default=96, help="prompt token ids are drawn from [0, N)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapter-std", type=float, default=0.02, help="std of lora_B (PEFT's zero init is a no-op)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # vLLM says which attention backend it runs at INFO

    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.demo_warmup import warm_up
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    result: dict = {"seeds": args.seeds, "tokens_per_run": args.prompts * args.samples_per_prompt * args.max_tokens}
    with tempfile.TemporaryDirectory(prefix="orbit-mismatch-") as tmp:
        for model in args.models:
            workdir = Path(tmp) / model
            src = write_demo_model(workdir / "demo", seed=0)
            if model == "warmed":
                result[f"{model}_final_loss"] = warm_up(src, steps=args.warmup_steps, seed=0)
            int4 = workdir / "int4"
            quantize_checkpoint(src, int4, W4A16Int(group_size=128))
            result[model] = {dtype: run_dtype(dtype, src, int4, args, workdir) for dtype in args.dtypes}
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
