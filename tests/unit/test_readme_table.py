"""The README's headline table is what the committed result files say (benchmarks/readme_table.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmark_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return load_benchmark("readme_table")


def test_the_readme_table_is_generated_from_the_result_files() -> None:
    table = _module()
    readme = (ROOT / "README.md").read_text()
    assert table.START in readme and table.END in readme, "the README lost its generated-table markers"
    assert table.rewrite(readme) == readme, "README's table differs from benchmarks/results/: run `make bench-table`"


def test_a_number_in_a_result_file_reaches_the_table(tmp_path, monkeypatch) -> None:
    table = _module()
    peaks = {"orbit": 3 * 2**30, "lora_bf16": 6 * 2**30, "full_ft": 9 * 2**30}
    (tmp_path / "memory.json").write_text(json.dumps({
        "model_params": 398e6, "prompts": 8, "group": 8, "seq_len": 1024, "micro_batch_tokens": 16384, "peak_bytes": peaks,
        "ratio_lora_bf16_over_orbit": 2.0, "ratio_full_ft_over_orbit": 3.0, "measured_micro_batches": None,
        "orbit_glibc_dynamic_threshold": {"peak_bytes": 6 * 2**30, "peak_ratio_dynamic_over_pinned": 2.0,
                                          "seconds_ratio_pinned_over_dynamic": 1.05},
        "environment": {"cpu": "Test CPU", "cpu_flags": ["avx512f"], "cpu_cores": 2},
    }))  # fmt: skip
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    generated = table.table()
    assert "| 3.00 GiB (INT4 base + LoRA) | 6.00 GiB (bf16 base + the same LoRA) | **2.0×** |" in generated
    assert "| 3.00 GiB | 9.00 GiB | **3.0×** | same file |" in generated
    assert "| 6.00 GiB | 3.00 GiB (pinned) | 2.0× (pinned takes 1.05× the time) |" in generated
    assert "(Test CPU, AVX-512, 2 cores)" in generated
    assert "mismatch" not in generated, "no mismatch.json: no mismatch row, never a filled-in one"
