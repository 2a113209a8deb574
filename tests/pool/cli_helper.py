"""Run ``elastic-ops`` commands in-process: the real entry point, errors on stderr and exit 2."""

from __future__ import annotations

from elastic_ops.cli import main


def run(argv: list[str]) -> int:
    return main(argv)
