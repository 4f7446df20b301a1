"""Prompt datasets: synthetic tasks generated locally and JSONL/Parquet files, plus the sampler."""
