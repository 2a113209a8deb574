"""``elastic-ops agent --socket PATH``: run the per-host chunk agent in the foreground."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from elastic_ops.agent.protocol import AGENT_SOCKET_ENV


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "agent",
        help="serve chunk requests from the Airflow tasks on this host (keeps torch and workers warm)",
        description="Run the per-host elastic-ops agent: it imports torch once, keeps the workers' fork "
        "server warm, and runs the chunks that tasks send it over a Unix socket (mode 0600). Point the "
        f"tasks at it with {AGENT_SOCKET_ENV}=PATH. Stops on SIGTERM/SIGINT, killing the workers of "
        "running chunks.",
    )
    p.add_argument("--socket", required=True, help="Unix socket path to listen on (absolute)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=cmd_agent)


def cmd_agent(args: argparse.Namespace) -> int:
    from elastic_ops.agent.server import main

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s: %(message)s"))
    logger = logging.getLogger("elastic_ops")
    logger.addHandler(handler)
    logger.setLevel(args.log_level)
    return main(args.socket)
