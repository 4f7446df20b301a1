"""Adapter sync latency: in memory (placement colocated) vs through files (separate).

One colocated-mode vLLM server (it accepts both kinds of load) on the 398M-parameter model of
benchmarks/memory.py, a learner on its shared base with a LoRA adapter on every linear
(rank 16, random lora_B), and REPEATS syncs of each kind, alternating:
  files   what separate runs do each step: `publish_adapter` (PEFT save_pretrained into a
          staging directory, renamed into place) + vLLM's /v1/load_lora_adapter from that path
  memory  what colocated runs do: `Policy.adapter_export` + staging the tensors in vLLM's
          worker through a sealed memfd + /v1/load_lora_adapter from /orbit-memory/<name>
Each sync is timed until vLLM has loaded the version, then once more until a first request
under the new name has been scored (vLLM moves an adapter into its LoRA slots on first use).
The canary verification, the same for both, is not included.

    python benchmarks/colocated_sync.py --json benchmarks/results/colocated_sync.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json
from colocated_memory import build_base
from memory import add_shape_arguments


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    add_shape_arguments(parser)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)

    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_colocated_policy
    from orbit_runtime.rollout.client import RolloutClient
    from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig
    from orbit_runtime.shared_base.attach import attach_shared_base
    from orbit_runtime.sync.adapter_sync import publish_adapter
    from orbit_runtime.sync.memory_adapter import InMemoryAdapter

    times: dict[str, dict[str, list[float]]] = {m: {"load_s": [], "first_request_s": []} for m in ("files", "memory")}
    with tempfile.TemporaryDirectory(prefix="orbit-colocated-sync-") as tmp:
        model, params = build_base(Path(tmp), args)
        config = VLLMServerConfig(model, dtype="bfloat16", max_lora_rank=args.rank, log_path=Path(tmp) / "vllm.log",
                                  max_model_len=256, colocated=True)  # fmt: skip
        with VLLMServer(config) as server:
            client = RolloutClient(server.base_url)
            attached = attach_shared_base(client)
            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            policy = load_colocated_policy(model, AdapterSpec(rank=args.rank, alpha=2 * args.rank, target_modules=targets),
                                           attached.tensors, attached.meta["isa_hint"], dtype="bf16")  # fmt: skip
            policy.init_adapter_randomly(std=0.02, seed=0)
            adapter_bytes = sum(t.nbytes for t in policy.adapter_export()[0].values())
            for repeat in range(args.repeats):
                for mode in ("files", "memory") if repeat % 2 == 0 else ("memory", "files"):
                    name = f"bench-{mode}-{repeat}"
                    started = time.perf_counter()
                    if mode == "files":
                        path, _ = publish_adapter(policy, Path(tmp) / "adapters", repeat)
                        client.load_adapter(name, path)
                    else:
                        InMemoryAdapter(*policy.adapter_export()).load(client, name)
                    loaded = time.perf_counter()
                    client.score([1, 2, 3, 4], model=name)
                    times[mode]["load_s"].append(loaded - started)
                    times[mode]["first_request_s"].append(time.perf_counter() - started)
                    client.unload_adapter(name)
            client.close()
            attached.close()
    result = {
        "model_params": params,
        "lora_rank": args.rank,
        "adapter_bytes": adapter_bytes,
        "repeats": args.repeats,
        "files": {k: spread(v) for k, v in times["files"].items()},
        "memory": {k: spread(v) for k, v in times["memory"].items()},
        "ratio_files_over_memory_load": round(statistics.median(times["files"]["load_s"]) / statistics.median(times["memory"]["load_s"]), 2),
        "raw_seconds": times,
        "note": "files: the page cache is warm and the disk local; a network volume for the adapters would be slower",
    }
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
