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


def record(name: str, argv: list[str] | None, **fields: Any) -> dict[str, Any]:
    """A result: which benchmark, the command that ran it, ``fields``, and where and under what
    load it ran (the host's name, its load average at the end)."""
    import os
    import platform
    import sys

    args = argv if argv is not None else sys.argv[1:]
    return {
        "benchmark": name,
        "command": " ".join(["python -m", f"benchmarks.{name}", *args]),
        **fields,
        "host": platform.node(),
        "load_average_at_end": os.getloadavg()[0],
    }
