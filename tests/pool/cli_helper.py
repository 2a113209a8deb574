"""Run the pool's CLI commands without importing the other layers' (heavier) commands."""

from __future__ import annotations

import argparse

from elastic_ops.errors import ElasticOpsError
from elastic_ops.pool import cli


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic-ops")
    cli.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ElasticOpsError as exc:
        print(f"elastic-ops: error: {exc}")
        return 2
