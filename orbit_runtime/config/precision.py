"""Precision names: the spec's short names and what vLLM and torch call them (one table)."""

from __future__ import annotations

from typing import Literal

DtypeName = Literal["bf16", "fp16", "fp32"]
# spec name -> vLLM's --dtype value
VLLM_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# accepted spellings -> spec name
ALIASES: dict[str, str] = {**{k: k for k in VLLM_DTYPES}, **{v: k for k, v in VLLM_DTYPES.items()}}


def canonical_dtype(name: str) -> str:
    """'bf16' | 'bfloat16' | 'fp16' | 'float16' | 'fp32' | 'float32' -> 'bf16' | 'fp16' | 'fp32'; ValueError otherwise."""
    if name not in ALIASES:
        raise ValueError(f"dtype {name!r} is not supported; choose bf16, fp16 or fp32")
    return ALIASES[name]


def vllm_dtype(name: str) -> str:
    """The --dtype value vLLM expects for spec dtype NAME."""
    return VLLM_DTYPES[canonical_dtype(name)]
