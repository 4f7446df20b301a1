"""The README's headline table is what the committed result files say (benchmarks/readme_table.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_generated_from_the_result_files() -> None:
    table = _module()
    readme = (ROOT / "README.md").read_text()
    assert table.START in readme and table.END in readme, "the README lost its generated-table markers"
    assert table.rewrite(readme) == readme, "README's table differs from benchmarks/results/: run `make bench-table`"


def test_a_number_in_a_result_file_reaches_the_table(tmp_path, monkeypatch) -> None:
    table = _module()
    (tmp_path / "memory.json").write_text(json.dumps({
        "model_params": 398e6, "batch": 1, "seq_len": 256, "orbit_peak_bytes": 3 * 2**30, "full_ft_peak_bytes": 9 * 2**30,
        "ratio": 3.0, "environment": {"cpu": "Test CPU", "cpu_flags": ["avx512f"], "cpu_cores": 2},
    }))  # fmt: skip
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    generated = table.table()
    assert "| 3.00 GiB | 9.00 GiB (full-parameter bf16 FT) | **3.0×** |" in generated
    assert "(Test CPU, AVX-512, 2 cores)" in generated
    assert "mismatch" not in generated, "no mismatch.json: no mismatch row, never a filled-in one"
