"""Reference log-prob service: the INT4 base without adapter, over HTTP on loopback.

In the pod this is the reference container; locally `orbit train` starts it as a process
when `reference.mode: server`. POST /v1/logprobs {"sequences": [{"prompt_ids": [...],
"completion_ids": [...]}], "temperature": 1.0} -> {"logprobs": [[...], ...]} (one list per completion token).

    python -m orbit_runtime.reference.server --model-dir INT4_DIR --dtype bf16 --port 8001 \
        [--device auto|cpu|cuda] [--micro-batch-tokens 16384]

A request is scored in micro-batches of at most --micro-batch-tokens padded tokens (the
learner's learner.micro_batch_tokens), so a long batch does not need one huge forward.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from pydantic import BaseModel, Field


class Sequence(BaseModel):
    prompt_ids: list[int] = Field(min_length=1)
    completion_ids: list[int] = Field(min_length=1)


class LogprobsRequest(BaseModel):
    sequences: list[Sequence] = Field(min_length=1)
    temperature: float = Field(1.0, gt=0, description="Sampling temperature the log-probs are taken at (logits / T).")


def create_app(model_dir: Path, dtype: str, device: str = "auto", micro_batch_tokens: int | None = None):
    """FastAPI app serving the base model's completion log-probs (one request at a time)."""
    from fastapi import FastAPI, HTTPException, Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from orbit_runtime.api_key import ApiKeyMiddleware
    from orbit_runtime.learner.device import resolve_device
    from orbit_runtime.learner.int4_base import load_int4_base
    from orbit_runtime.learner.micro_batches import MicroBatchLimits, logprobs_in_micro_batches
    from orbit_runtime.learner.model import Policy, parse_dtype
    from orbit_runtime.observability import metrics

    torch_dtype = parse_dtype(dtype)
    limits = MicroBatchLimits(max_tokens=micro_batch_tokens)
    base, _ = load_int4_base(model_dir, torch_dtype)
    base.to(resolve_device(device))
    policy = Policy(base, torch_dtype, Path(model_dir))
    vocab = base.config.vocab_size
    lock = threading.Lock()  # one forward at a time; requests queue
    stats = {"requests": 0, "sequences": 0, "seconds": 0.0}
    app = FastAPI(title="orbit reference")
    app.add_middleware(ApiKeyMiddleware)  # /v1/logprobs needs the run's key; /healthz and /metrics stay open
    metrics.register_resources("reference")

    @app.get("/health")
    @app.get("/healthz")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.REFERENCE_REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    def get_stats() -> dict:
        return dict(stats)

    @app.post("/v1/logprobs")
    def logprobs(request: LogprobsRequest) -> dict:
        pairs = [(s.prompt_ids, s.completion_ids) for s in request.sequences]
        for i, (prompt, completion) in enumerate(pairs):
            bad = [t for t in prompt + completion if not 0 <= t < vocab]
            if bad:
                metrics.REFERENCE_REQUESTS.labels("invalid").inc()
                raise HTTPException(422, f"sequences[{i}]: token ids {bad[:3]} outside the vocabulary [0, {vocab})")
        started = time.monotonic()
        with metrics.REFERENCE_DURATION.time(), lock, policy.scoring():
            out = logprobs_in_micro_batches(policy, pairs, limits, request.temperature)
        metrics.REFERENCE_REQUESTS.labels("ok").inc()
        metrics.REFERENCE_SEQUENCES.inc(len(pairs))
        stats["requests"] += 1
        stats["sequences"] += len(pairs)
        stats["seconds"] += time.monotonic() - started
        return {"logprobs": [t.float().tolist() for t in out]}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Orbit reference log-prob server")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="padded tokens per forward (default: no limit)")
    args = parser.parse_args(argv)
    if args.micro_batch_tokens is not None and args.micro_batch_tokens < 1:
        parser.error("--micro-batch-tokens must be >= 1")
    import uvicorn

    app = create_app(args.model_dir, args.dtype, args.device, args.micro_batch_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
