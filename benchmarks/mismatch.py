"""Train-rollout log-prob mismatch: Orbit's shared INT4 base vs the traditional 16-bit learner.

Both schemes score the SAME tokens, sampled once by a real vLLM server running the INT4 base
plus a LoRA adapter:
  scheme_a (Orbit)       learner = the same INT4 base + the same adapter
  scheme_b (traditional) learner = the original 16-bit weights + the same adapter
Run for bf16 and fp16 (vLLM and learner in the same dtype). Prints and writes JSON:
  {"bf16": {"scheme_a": {...}, "scheme_b": {...}}, "fp16": {...}, "ratio_bf16": B/A, ...}

    python benchmarks/mismatch.py --json bench-out/mismatch.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def sample_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def run_dtype(dtype: str, src: Path, int4: Path, args: argparse.Namespace, workdir: Path) -> dict:
    import torch

    from orbit_runtime.algorithms.mismatch import measure_mismatch
    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_dense_policy, load_policy
    from orbit_runtime.rollout.client import RolloutClient, adapter_name
    from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig

    adapter = AdapterSpec(rank=args.rank, alpha=2 * args.rank)
    orbit = load_policy(int4, adapter, dtype=dtype)
    orbit.init_adapter_randomly(std=args.adapter_std, seed=args.seed)
    adapter_dir = orbit.save_adapter(workdir / f"adapter-{dtype}")
    traditional = load_dense_policy(src, adapter, dtype=dtype)
    traditional.load_adapter_state(orbit.adapter_state())

    config = VLLMServerConfig(int4, dtype=DTYPES[dtype], max_lora_rank=args.rank, log_path=workdir / f"vllm-{dtype}.log")
    with VLLMServer(config) as server:
        client = RolloutClient(server.base_url)
        name = adapter_name(1)
        client.load_adapter(name, adapter_dir)
        started = time.monotonic()
        groups = client.generate(
            sample_prompts(args.prompts, args.prompt_vocab, args.seed),
            model=name,
            n=args.samples_per_prompt,
            max_tokens=args.max_tokens,
            temperature=1.0,  # vLLM's logprobs are of the unmodified distribution at T=1
            seed=args.seed,
            ignore_eos=True,
        )
        generate_s = time.monotonic() - started
        client.close()
    completions = [c for group in groups for c in group]
    pairs = [(c.prompt_ids, c.token_ids) for c in completions]
    rollout = [torch.tensor(c.logprobs) for c in completions]
    with torch.no_grad():
        scheme_a = measure_mismatch(orbit.completion_logprobs(pairs), rollout)
        scheme_b = measure_mismatch(traditional.completion_logprobs(pairs), rollout)
    return {"scheme_a": scheme_a.as_dict(), "scheme_b": scheme_b.as_dict(), "generate_seconds": round(generate_s, 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the result here as well as to stdout")
    parser.add_argument("--model-dir", type=Path, help="16-bit HF checkpoint (default: a fresh demo model)")
    parser.add_argument("--int4-dir", type=Path, help="its INT4 copy from `orbit quantize` (default: quantize now)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-vocab", type=int, default=96, help="prompt token ids are drawn from [0, N)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapter-std", type=float, default=0.02, help="std of lora_B (PEFT's zero init is a no-op)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    args = parser.parse_args(argv)

    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    with tempfile.TemporaryDirectory(prefix="orbit-mismatch-") as tmp:
        workdir = Path(tmp)
        src = args.model_dir or write_demo_model(workdir / "demo", seed=args.seed)
        int4 = args.int4_dir
        if int4 is None:
            int4 = workdir / "int4"
            quantize_checkpoint(src, int4, W4A16Int(group_size=128))
        result: dict = {"model": str(args.model_dir or "orbit demo-model (random init)")}
        for dtype in args.dtypes:
            result[dtype] = run_dtype(dtype, src, int4, args, workdir)
    for dtype in args.dtypes:
        a, b = result[dtype]["scheme_a"], result[dtype]["scheme_b"]
        result[f"ratio_{dtype}"] = round(b["mean_abs_dlogp"] / a["mean_abs_dlogp"], 2)
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
