"""How every benchmark reports: JSON on stdout and, with --json PATH, the same JSON in a file."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(result: dict, path: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
