"""HTTP client for the rollout engine (vLLM's OpenAI-compatible server).

Generation sends token ids and returns token ids with per-token log-probs (the server runs
with `--logprobs-mode processed_logprobs`: log-probs of the distribution actually sampled,
after temperature, which is what the learner computes). Adapter versions
are loaded under a NEW name every time: vLLM caches adapters by name, so reusing a name
would keep serving the old weights. The client refuses to reuse a name.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from orbit_runtime.api_key import auth_headers


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its prompt, the generated ids and their rollout log-probs, and (MoE
    engines returning them) the experts chosen at each forwarded position: [prompt + completion - 1,
    layers, k]. A multi-turn episode is one Completion too: TOKEN_MASK is True at the model's
    tokens and False at the environment's (whose log-probs are placeholders)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    token_mask: list[bool] | None = field(default=None, compare=False)


def decode_routed_experts(encoded: str | None) -> np.ndarray | None:
    """vLLM's `routed_experts` field (base64 of an .npy array) -> the array; None stays None."""
    if encoded is None:
        return None
    try:
        return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ValueError, OSError):  # a corrupt field: the sample counts as missing routing, the run goes on
        return None


def _token_id(token: str) -> int:
    # With return_tokens_as_token_ids, vLLM writes each token as "token_id:<id>".
    prefix, _, value = token.partition(":")
    if prefix != "token_id":
        raise ValueError(f"expected a 'token_id:<n>' token from vLLM, got {token!r}")
    return int(value)


def adapter_name(version: int) -> str:
    """The served name of adapter version N (unique per version)."""
    return f"orbit-adapter-v{version}"


class RolloutClient:
    """Talks to one vLLM server: generate, score, load and unload adapters."""

    def __init__(self, base_url: str, *, base_model: str = "base", timeout_s: float = 300.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.base_model = base_model
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=auth_headers(api_key))
        self._ever_loaded: set[str] = set()
        self.loaded: list[str] = []

    def close(self) -> None:
        self._http.close()

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _post(self, path: str, payload: dict) -> httpx.Response:
        response = self._http.post(path, json=payload)
        if response.status_code >= 400:
            raise RuntimeError(f"rollout {path} returned {response.status_code}: {response.text[:500]}")
        return response

    def collective_rpc(self, method: str, *args: str, timeout_s: float | None = None) -> list:
        """Call METHOD of Orbit's worker extension in every vLLM worker (string ARGS): one result per
        worker. Needs a server started for colocated placement (VLLM_SERVER_DEV_MODE=1)."""
        response = self._http.post("/collective_rpc", json={"method": method, "args": list(args)},
                                   timeout=timeout_s or self._http.timeout)  # fmt: skip
        if response.status_code == 404:
            raise RuntimeError("the rollout engine has no /collective_rpc: it was not started for placement: colocated")
        if response.status_code >= 400:
            raise RuntimeError(f"rollout /collective_rpc {method} returned {response.status_code}: {response.text[:500]}")
        return response.json()["results"]

    def release_kv_cache(self) -> None:
        """Free the engine's KV cache (vLLM sleep mode, GPU; the weights stay where they are)."""
        self._post("/release_kv_cache_memory", {})

    def wake_kv_cache(self) -> None:
        """Allocate the KV cache again after release_kv_cache."""
        response = self._http.post("/wake_up", params={"tags": "kv_cache"})
        if response.status_code >= 400:
            raise RuntimeError(f"rollout /wake_up returned {response.status_code}: {response.text[:500]}")

    def generate(
        self,
        prompts: list[list[int]],
        *,
        model: str | None = None,
        n: int = 1,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | list[int] | None = None,
        ignore_eos: bool = False,
    ) -> list[list[Completion]]:
        """Sample N completions per prompt; result[i][j] is completion j of prompt i.

        SEED: one seed for the request, or one per prompt. vLLM applies a request's seed to
        every prompt in it, so two equal prompts in one request would get the same samples;
        with a seed per prompt, each prompt is its own request (sent concurrently: vLLM
        batches them on its side).
        """
        payload = {
            "model": model or self.base_model,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "ignore_eos": ignore_eos,
            "skip_special_tokens": False,
        }
        if isinstance(seed, list):
            if len(seed) != len(prompts):
                raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts")
            pool = ThreadPoolExecutor(max_workers=min(len(prompts), 64))
            try:
                requests = [pool.submit(self._complete, [p], n, {**payload, "seed": s}) for p, s in zip(prompts, seed, strict=True)]
                return [r.result()[0] for r in requests]
            finally:  # on Ctrl-C, do not wait for the other requests (the engine is stopped next)
                pool.shutdown(wait=False, cancel_futures=True)
        if seed is not None:
            payload["seed"] = seed
        return self._complete(prompts, n, payload)

    def _complete(self, prompts: list[list[int]], n: int, payload: dict) -> list[list[Completion]]:
        choices = self._post("/v1/completions", {**payload, "prompt": prompts}).json()["choices"]
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for choice in sorted(choices, key=lambda c: c["index"]):
            prompt_index = choice["index"] // n
            lp = choice["logprobs"]
            grouped[prompt_index].append(
                Completion(
                    prompt_ids=list(prompts[prompt_index]),
                    token_ids=[_token_id(t) for t in lp["tokens"]],
                    logprobs=[float(x) for x in lp["token_logprobs"]],
                    finish_reason=choice.get("finish_reason"),
                    routed_experts=decode_routed_experts(choice.get("routed_experts")),
                )
            )
        return grouped

    def score(self, sequence: list[int], *, model: str | None = None) -> list[float]:
        """log p(token t | tokens < t) for t = 1..len-1 under MODEL (vLLM prompt_logprobs)."""
        return self.score_many([sequence], model=model)[0]

    def score_many(self, sequences: list[list[int]], *, model: str | None = None) -> list[list[float]]:
        """`score` of every sequence in SEQUENCES, in one request (vLLM batches them in one forward)."""
        payload = {
            "model": model or self.base_model,
            "prompt": sequences,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        choices = sorted(self._post("/v1/completions", payload).json()["choices"], key=lambda c: c["index"])
        if len(choices) != len(sequences):
            raise RuntimeError(f"rollout scored {len(choices)} of {len(sequences)} sequences")
        scores = []
        for sequence, choice in zip(sequences, choices, strict=True):
            entries = choice["prompt_logprobs"][1:]
            scores.append([float(entry[str(token)]["logprob"]) for token, entry in zip(sequence[1:], entries, strict=True)])
        return scores

    def load_adapter(self, name: str, path: Path) -> None:
        """Load the PEFT adapter at PATH under a name never used before on this server."""
        if name in self._ever_loaded:
            raise ValueError(f"adapter name {name!r} was used before; vLLM would serve the cached old weights")
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        self._ever_loaded.add(name)
        self.loaded.append(name)

    def fresh_name(self, base: str) -> str:
        """BASE, or BASE-retry<k> with the smallest k neither loaded by this client nor served now
        (an external server outlives a restarted learner and still holds its names)."""
        taken = self._ever_loaded | set(self.served_models())
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}-retry{k}"
        return name

    def unload_adapter(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})
        self.loaded.remove(name)

    def served_models(self) -> list[str]:
        return [m["id"] for m in self._http.get("/v1/models").json()["data"]]
