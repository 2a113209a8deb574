"""The ``elastic-ops`` command line. Each layer contributes its own subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from elastic_ops.errors import ElasticOpsError, SpecError


def build_parser() -> argparse.ArgumentParser:
    from elastic_ops.agent import cli as agent_cli
    from elastic_ops.pool import cli as pool_cli
    from elastic_ops.runtime import cli as runtime_cli

    parser = argparse.ArgumentParser(prog="elastic-ops", description="Elastic deep-learning training.")
    sub = parser.add_subparsers(dest="command", required=True)
    runtime_cli.add_commands(sub)
    pool_cli.add_commands(sub)
    agent_cli.add_commands(sub, metrics=_airflow_metrics)
    _name_options(parser, {})
    return parser


def _airflow_metrics():
    """A node agent's metrics: Airflow's Stats, as this host's ``[metrics]`` configuration says."""
    from elastic_ops.hooks.metrics import metrics_from_airflow_config

    return metrics_from_airflow_config()


def _name_options(parser: argparse.ArgumentParser, inherited: dict[str, str]) -> None:
    """Give every command's parser ``flags``: ``{parameter: option}`` of its options and its
    parents' (``lease_ttl_s``: ``--lease-ttl-s``), plus its ``flag_aliases``, so that a
    :class:`SpecError` about a value names the option the user typed, not the parameter it
    became. A command whose values also come from elsewhere (``run``: the spec file, whose fields
    share names with its options) sets ``flags`` itself."""
    names = dict(inherited)
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest != "help":
            names[action.dest] = longs[0]
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in commands:
        for child in action.choices.values():
            _name_options(child, names)
    if not commands and parser.get_default("flags") is None:
        parser.set_defaults(flags={**names, **(parser.get_default("flag_aliases") or {})})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecError as exc:
        flag = getattr(args, "flags", {}).get(exc.field)  # the option the value came from
        shown = exc.naming(flag) if flag else exc
        print(f"elastic-ops: error: {shown}", file=sys.stderr)
        return 2
    except ElasticOpsError as exc:
        print(f"elastic-ops: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `elastic-ops pool status | head`: the reader left; not an error to show
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        return 141  # as a shell reports SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
