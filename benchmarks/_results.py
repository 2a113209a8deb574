"""Writing a benchmark's JSON result (every benchmark writes one under benchmarks/results/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: Any) -> Path:
    """Write ``result`` as indented JSON to ``path``, creating its folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out
