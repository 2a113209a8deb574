"""The ``elastic-ops`` command line. Each layer contributes its own subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from elastic_ops.errors import ElasticOpsError


def build_parser() -> argparse.ArgumentParser:
    from elastic_ops.agent import cli as agent_cli
    from elastic_ops.pool import cli as pool_cli
    from elastic_ops.runtime import cli as runtime_cli

    parser = argparse.ArgumentParser(prog="elastic-ops", description="Elastic deep-learning training.")
    sub = parser.add_subparsers(dest="command", required=True)
    runtime_cli.add_commands(sub)
    pool_cli.add_commands(sub)
    agent_cli.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ElasticOpsError as exc:
        print(f"elastic-ops: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
