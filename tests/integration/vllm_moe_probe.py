"""Run vLLM's CPU engine in this process on an MoE base + adapter; write what it did as JSON.

Used by test_moe_vllm_parity.py as a subprocess (vLLM's engine, its threads and its memory
stay out of the test process). In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so forward
hooks on the served model see its routing: for each sampled completion, the prompt plus
completion is prefilled once more and every MoE layer's chosen experts per token recorded; then
all completions are scored in one batch (prompt log-probs, as the trainer's canary asks).

    python vllm_moe_probe.py MODEL_DIR ADAPTER_DIR OUT_JSON RANK
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def record_routing(model, captured: list) -> int:
    """Through every Orbit CPU MoE block's capture hook (the one routing replay uses): append
    (layer, sorted expert ids per token) for each forward."""
    from orbit_runtime.rollout.vllm_cpu_moe import ExpertLinearsMoeBlock

    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertLinearsMoeBlock)]
    for name, block in blocks:
        block.capture_fn = lambda ids, name=name: captured.append((name, ids.sort(-1).values.tolist()))
    return len(blocks)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model_dir, adapter_dir, out_path, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    llm = LLM(model=model_dir, dtype="float16", enable_lora=True, max_lora_rank=rank, max_loras=1,
              enforce_eager=True, max_model_len=256, enable_prefix_caching=False, seed=0)  # fmt: skip
    captured: list = []
    hooked = llm.apply_model(lambda model: record_routing(model, captured))
    lora = LoRARequest("probe", 1, adapter_dir)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [97] + [rng.randrange(0, 96) for _ in range(rng.randrange(4, 12))]} for _ in range(6)]
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=24, logprobs=0, seed=7, ignore_eos=True)
    completions = []
    for result in llm.generate(prompts, sampling, lora_request=lora, use_tqdm=False):
        for output in result.outputs:
            completions.append({
                "prompt": list(result.prompt_token_ids),
                "tokens": list(output.token_ids),
                "logprobs": [step[token].logprob for step, token in zip(output.logprobs, output.token_ids, strict=True)],
            })  # fmt: skip
    for completion in completions:
        captured.clear()
        tokens = completion["prompt"] + completion["tokens"]
        llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1), lora_request=lora, use_tqdm=False)
        completion["routing"] = [ids for _, ids in captured]
    # every completion scored again, all in one request (as the trainer's canary scores): prompt
    # log-probs of many sequences in one batch, through the served head
    sequences = [{"prompt_token_ids": c["prompt"] + c["tokens"]} for c in completions]
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for completion, result in zip(completions, llm.generate(sequences, scoring, lora_request=lora, use_tqdm=False), strict=True):
        tokens, entries = result.prompt_token_ids, result.prompt_logprobs
        completion["scored"] = [entries[i][tokens[i]].logprob for i in range(len(completion["prompt"]), len(tokens))]
    with open(out_path, "w") as out:
        json.dump({"hooked_layers": hooked, "completions": completions}, out)


if __name__ == "__main__":
    main()
