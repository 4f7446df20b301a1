"""What one batched HTTP request would save over Orbit's one request per prompt (vs_trl's `tiny`).

Orbit seeds every prompt of a rollout on its own (`RolloutClient.generate` with a seed per
prompt), and vLLM applies a request's seed to every prompt in it, so each prompt is its own
request (sent concurrently; vLLM batches them). One request with one seed would cost less
HTTP and scheduling, but every prompt in it would then draw the same noise stream (the
samples of different prompts become correlated, and equal prompts get equal samples). This
measures what that would buy, on vs_trl's `tiny` workload (the demo model in INT4, a LoRA
adapter served, 16 prompts x 8 samples x 8 tokens), and the same for the decode canary (2
prompts, 1 sample each), against one vLLM server:
  per_prompt   Orbit's rollout request pattern (16 requests)
  batched      one request, one seed
  canary_per   the decode canary as Orbit sends it (a seed per prompt: 2 requests)
  canary_one   the canary in one request
Each pattern: 2 rounds x (1 warm-up + 5 timed calls), interleaved, median and spread.

    python benchmarks/rollout_requests.py --json benchmarks/results/rollout_requests.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json
from vs_trl import ALPHA, RANK, TARGETS, build_models

PROMPTS, GROUP, TOKENS, ROUNDS, CALLS = 16, 8, 8, 2, 5


def measure(reserved_cpus: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orbit_runtime.rollout.client import RolloutClient
    from orbit_runtime.rollout.server import RESERVED_CPUS_ENV, VLLMServer, VLLMServerConfig
    from orbit_runtime.rollout.vllm_cpu_lora import FAST_PATH_ENV

    os.environ[FAST_PATH_ENV] = "1"
    os.environ[RESERVED_CPUS_ENV] = str(reserved_cpus)
    root = Path(tempfile.mkdtemp(prefix="orbit-rollout-requests-"))
    dense, int4, _ = build_models("tiny", root)
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(dense),
                             LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False))  # fmt: skip
    adapter.save_pretrained(root / "adapter")
    tokenizer = AutoTokenizer.from_pretrained(dense)
    prompts = [tokenizer(f"What is {i} + {2 * i + 3}? Answer:")["input_ids"] for i in range(PROMPTS)]
    with VLLMServer(VLLMServerConfig(model_dir=int4, dtype="bfloat16", log_path=root / "vllm.log")) as server:
        client = RolloutClient(server.base_url)
        client.load_adapter("adapter", root / "adapter")
        patterns = {
            "per_prompt": lambda: client.generate(prompts, model="adapter", n=GROUP, max_tokens=TOKENS,
                                                  seed=[100 + i for i in range(PROMPTS)]),
            "batched": lambda: client.generate(prompts, model="adapter", n=GROUP, max_tokens=TOKENS, seed=100),
            "canary_per": lambda: client.generate(prompts[:2], model="adapter", n=1, max_tokens=TOKENS, seed=[5, 6],
                                                  ignore_eos=True),
            "canary_one": lambda: client.generate(prompts[:2], model="adapter", n=1, max_tokens=TOKENS, seed=5,
                                                  ignore_eos=True),
        }  # fmt: skip
        seconds: dict[str, list[float]] = {name: [] for name in patterns}
        for _ in range(ROUNDS):
            for name, call in patterns.items():
                call()  # warm-up
                for _ in range(CALLS):
                    t = time.perf_counter()
                    call()
                    seconds[name].append(time.perf_counter() - t)
        # a prompt's samples in a batched request equal its samples alone with that seed: only the seed is shared
        together = client.generate(prompts[:3], model="adapter", n=GROUP, max_tokens=TOKENS, seed=7)
        alone = [client.generate([p], model="adapter", n=GROUP, max_tokens=TOKENS, seed=7)[0] for p in prompts[:3]]
        same = all([c.token_ids for c in a] == [c.token_ids for c in b] for a, b in zip(together, alone, strict=True))
    spread = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "stdev": statistics.stdev(v)}
              for name, v in seconds.items()}  # fmt: skip
    return {
        "workload": {"prompts": PROMPTS, "group_size": GROUP, "max_tokens": TOKENS, "vllm_reserved_cpus": reserved_cpus},
        "seconds": spread,
        "batched_over_per_prompt": round(spread["batched"]["median"] / spread["per_prompt"]["median"], 3),
        "canary_one_over_per": round(spread["canary_one"]["median"] / spread["canary_per"]["median"], 3),
        "batched_prompt_equals_alone": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reserved-cpus", type=int, default=0, help="VLLM_CPU_NUM_OF_RESERVED_CPU (vs_trl's best: 0)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    emit_json(measure(args.reserved_cpus), args.json)


if __name__ == "__main__":
    main()
