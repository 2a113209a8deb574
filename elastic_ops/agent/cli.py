"""``elastic-ops agent --socket PATH`` (the per-host chunk agent) and ``elastic-ops node --host
NAME`` (a cluster's node agent), each in the foreground."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Callable

from elastic_ops.agent.cluster import NAMESPACE_ENV, URL_ENV
from elastic_ops.agent.protocol import AGENT_SOCKET_ENV
from elastic_ops.agent.redis_channel import SECRET_ENV
from elastic_ops.metrics import NO_METRICS, Metrics


def add_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    metrics: Callable[[], Metrics] = lambda: NO_METRICS,
) -> None:
    """The agents' commands; ``metrics()``: where a node agent sends its metrics (the top-level
    CLI wires in Airflow's Stats, so this package never imports Airflow)."""
    p = subparsers.add_parser(
        "agent",
        help="serve chunk requests from the Airflow tasks on this host (keeps torch and workers warm)",
        description="Run the per-host elastic-ops agent: it imports torch once, keeps the workers' fork "
        "server warm, and runs the chunks that tasks send it over a Unix socket (mode 0600). Point the "
        f"tasks at it with {AGENT_SOCKET_ENV}=PATH. SIGTERM drains it (running chunks commit at their "
        "next iteration boundary and end as preempted, within --grace; what is left is killed), SIGINT "
        "stops it at once, killing the workers of running chunks.",
    )
    p.add_argument("--socket", required=True, help="Unix socket path to listen on (absolute)")
    _drain_arguments(p, "the agent serving --socket")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=cmd_agent)
    n = subparsers.add_parser(
        "node",
        help="run the chunks the pool grants on this host, for tasks anywhere in the cluster",
        description="Run a cluster's node agent for one host: it keeps torch and the workers' fork server "
        "warm, announces the host in Redis and runs the chunks that Airflow tasks on any machine send for "
        f"it. Settings come from the environment, never the command line: {URL_ENV} (the cluster's Redis, "
        f"e.g. redis://:password@redis-host:6379/0), {SECRET_ENV} (the secret the tasks share, at least 16 "
        f"characters) and optionally {NAMESPACE_ENV}. SIGTERM (a termination notice) drains it: no new "
        "chunks, the host drained in the pool (with --pool-url or $ELASTIC_OPS_POOL_URL), running chunks "
        "commit at their next iteration boundary and end as preempted (their tasks resume on another host), "
        "within --grace; what is left is killed. SIGINT stops it at once, killing the workers of running "
        "chunks.",
    )
    n.add_argument(
        "--host",
        default=socket.gethostname(),
        help="this host's name in the pool (default: the hostname, %(default)s)",
    )
    n.add_argument(
        "--register-slots",
        default=None,
        metavar="N|gpus",
        help="if the pool has no host of this name yet, add it with N slots, or with one slot per GPU "
        "CUDA sees here ('gpus': slot i is the host's i-th GPU) (the ledger from --pool-url or "
        "$ELASTIC_OPS_POOL_URL); a known host's slots and state are left as they are",
    )
    n.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE",
        help="with --register-slots: a label of the new host (e.g. gpu=h100), for jobs' host selectors",
    )
    n.add_argument(
        "--advertise-addr", default=None, metavar="IP",
        help="this host's IP address on the network the hosts' workers share: with it, this node leads "
        "chunks whose grant spans hosts (one process group; the rendezvous store listens on it); without "
        "it, a chunk trains with this host's slots only",
    )
    n.add_argument("--pool-url", default=None,
                   help="SQLAlchemy URL of the pool ledger (default $ELASTIC_OPS_POOL_URL), for "
                   "--register-slots and for draining the host in the pool on a drain")
    _drain_arguments(n, "the node agent running for --host")
    n.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    n.set_defaults(func=cmd_node, flag_aliases={"labels": "--label"}, metrics=metrics)
    ls = subparsers.add_parser(
        "nodes",
        help="list the node agents announced in the cluster's Redis",
        description=f"List the node agents announced in the cluster's Redis ({URL_ENV}, {SECRET_ENV} and "
        f"optionally {NAMESPACE_ENV} from the environment): host, pid, protocol version, chunks running, "
        "address (set: it leads chunks spanning hosts). With --api-url (or $ELASTIC_OPS_API_URL when "
        f"{URL_ENV} is unset), ask Airflow's api-server instead, with an Airflow login.",
    )
    ls.add_argument("--json", action="store_true", help="one JSON object")
    ls.add_argument("--api-url", default=None,
                    help="Airflow's api-server (its /elastic-ops/nodes route); token from "
                    "$ELASTIC_OPS_API_TOKEN, or $ELASTIC_OPS_API_USER and $ELASTIC_OPS_API_PASSWORD")
    ls.set_defaults(func=cmd_nodes)


def _drain_arguments(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument(
        "--grace", default=None, metavar="SECONDS",
        help="how long a drain (SIGTERM, --drain) waits for running chunks to commit at their next iteration "
        "boundary before it kills them (0..3600; default 30; 0: kill at once)",
    )
    p.add_argument(
        "--drain", action="store_true",
        help=f"drain {whose} instead of serving: it takes no new chunks, its running chunks commit and end "
        "as preempted within --grace (default: its own), then it exits; returns once it has taken the drain",
    )


def _grace(args: argparse.Namespace) -> float | None:
    from elastic_ops.agent.server import check_grace

    return None if args.grace is None else check_grace("--grace", args.grace)


def _cluster_config():
    from elastic_ops.agent.cluster import node_config_from_env
    from elastic_ops.errors import UNSET, SpecError

    config = node_config_from_env()
    if config is None:
        raise SpecError(URL_ENV, UNSET, "the URL of the cluster's Redis, e.g. redis://redis-host:6379/0")
    return config


def _announced(api_url: str | None) -> dict:
    """The announced node agents, from the cluster's Redis or through the api-server."""
    import os

    from elastic_ops.pool.api_client import ENV_API_URL

    api_url = api_url or (None if os.environ.get(URL_ENV) else os.environ.get(ENV_API_URL))
    if not api_url:
        from elastic_ops.agent.node_client import NodeClient

        return NodeClient(_cluster_config()).announced()
    from elastic_ops.errors import SpecError
    from elastic_ops.pool.api_client import ApiPoolClient

    view = ApiPoolClient(api_url).nodes()
    if not view.get("cluster"):
        raise SpecError(URL_ENV, "unset on the api-server", "the cluster's settings in the api-server's "
                        "environment, as the workers have them", hint="or run this where they are set")
    return view["nodes"]


def cmd_nodes(args: argparse.Namespace) -> int:
    import json

    nodes = _announced(args.api_url)
    if args.json:
        print(json.dumps(nodes, sort_keys=True))
        return 0
    from elastic_ops.pool import report

    print(report.text_table(report.node_rows(nodes), report.NODE_COLUMNS))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from elastic_ops.agent.node import main
    from elastic_ops.errors import SpecError
    from elastic_ops.spec import check_host_name

    check_host_name("--host", args.host)
    grace = _grace(args)
    if args.drain:
        return drain_node(args, grace)
    if args.label and args.register_slots is None:
        raise SpecError(
            "--label", args.label, "only with --register-slots (labels of a host the node adds to the pool)",
            hint="`elastic-ops pool add-host HOST SLOTS --label …` relabels a known host",
        )
    if args.advertise_addr is not None:
        from elastic_ops.agent.span import check_advertise_addr

        check_advertise_addr(args.advertise_addr)  # before anything is registered
    if args.register_slots is not None:  # the options first: a typo is named before the settings
        from elastic_ops.pool.cli import parse_labels

        labels = parse_labels(args.label)
        slots = slots_to_register(args.register_slots)
    config = _cluster_config()
    _log_to_stderr(args.log_level)
    if args.register_slots is not None:
        from elastic_ops.agent.node import reachable_redis, register_host

        reachable_redis(config)  # a node that cannot serve must not leave its host in the pool
        register_host(args.host, slots, args.pool_url, labels)
    import os

    from elastic_ops.agent.server import DRAIN_GRACE_S
    from elastic_ops.pool.client import ENV_URL

    return main(args.host, config, advertise_addr=args.advertise_addr, metrics=args.metrics(),
                grace_s=DRAIN_GRACE_S if grace is None else grace,
                pool_url=args.pool_url or os.environ.get(ENV_URL) or None)


def drain_node(args: argparse.Namespace, grace: float | None) -> int:
    """``elastic-ops node --host H --drain``: a sealed drain request to H's running node agent."""
    from elastic_ops.agent.node_client import NodeClient
    from elastic_ops.errors import SpecError

    for flag, given in (("--register-slots", args.register_slots), ("--label", args.label),
                        ("--advertise-addr", args.advertise_addr)):
        if given:
            raise SpecError(flag, given, "not with --drain (it sends a drain to the running node agent)")
    info = NodeClient(_cluster_config()).drain(args.host, grace)
    print(f"node agent of host {args.host} (pid {info.get('pid')}) is draining: its {info.get('chunks', 0)} "
          "running chunk(s) commit at their next iteration boundary and end as preempted, then it exits")
    return 0


def slots_to_register(value: str) -> int:
    """``--register-slots``: a whole number of slots, or ``gpus``, the GPUs CUDA sees on this host
    (slot i is the i-th of them, docs/runtime.md "GPUs"). A number above that count, on a host
    with GPUs, is logged as a warning: a CUDA job granted a slot past the last GPU fails there
    (a retryable ``WorkerLostError`` held against the host)."""
    from elastic_ops.errors import SpecError
    from elastic_ops.pool.checks import MAX_HOST_SLOTS
    from elastic_ops.runtime.launcher import visible_gpus

    allowed = (f"a whole number of slots from 1 to {MAX_HOST_SLOTS}, or 'gpus' (one slot per GPU CUDA sees "
               "on this host)")
    text = str(value).strip()
    # the length first: int() raises ValueError past 4,300 digits
    if text.lower() != "gpus" and not (text.isascii() and text.isdigit() and len(text) <= 7
                                       and 1 <= int(text) <= MAX_HOST_SLOTS):
        raise SpecError("--register-slots", value, allowed)
    gpus = visible_gpus()
    if text.lower() == "gpus":
        if not gpus:
            raise SpecError(
                "--register-slots", value, allowed,
                hint="CUDA sees no GPU here (torch.cuda.device_count() is 0: no GPU or driver, a CPU build "
                "of torch, or CUDA_VISIBLE_DEVICES hides them): give the number of CPU worker slots",
            )
        return len(gpus)
    slots = int(text)
    if 0 < len(gpus) < slots:
        logging.getLogger("elastic_ops.node").warning(
            "registering %d slots on a host where CUDA sees %d GPUs %s: a CUDA job granted slot %d or "
            "above fails here (--register-slots gpus registers one slot per GPU)", slots, len(gpus), gpus,
            len(gpus),
        )
    return slots


def _log_to_stderr(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s: %(message)s"))
    logger = logging.getLogger("elastic_ops")
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # importing Airflow (its metrics settings) gives the root logger a handler too


def cmd_agent(args: argparse.Namespace) -> int:
    from elastic_ops.agent.server import DRAIN_GRACE_S, main

    grace = _grace(args)
    if args.drain:
        from elastic_ops.agent.client import AgentClient

        reply = AgentClient(args.socket).drain(grace)
        print(f"agent at {args.socket} (pid {reply.get('pid')}) is draining: its {reply.get('chunks', 0)} "
              f"running chunk(s) commit at their next iteration boundary and end as preempted (grace "
              f"{reply.get('grace_s'):g} s), then it exits")
        return 0
    _log_to_stderr(args.log_level)
    return main(args.socket, DRAIN_GRACE_S if grace is None else grace)
