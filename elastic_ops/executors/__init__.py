"""Where a granted chunk trains: one :class:`ChunkExecutor`, chosen once from the environment.

- ``ELASTIC_OPS_NODE_REDIS_URL`` set (a cluster): on the node agent of the granted host
  (:class:`NodeExecutor`), whichever machine runs the task.
- Else ``ELASTIC_OPS_AGENT_SOCKET`` set: on this host's agent (:class:`HostAgentExecutor`); the
  task process never imports torch, and trains itself when no agent answers there.
- Else in the task process (:class:`InProcessExecutor`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from elastic_ops.executors.api import (
    ChunkExecutor,
    ChunkRequest,
    LatestCheckpoint,
    Lease,
    PoolHosts,
    Stores,
)

__all__ = ["ChunkExecutor", "ChunkRequest", "LatestCheckpoint", "Lease", "executor_from_env"]


def executor_from_env(
    stores: Stores,
    pool: Callable[[], PoolHosts],
    log: logging.Logger | logging.LoggerAdapter[Any],
    environ: Mapping[str, str] | None = None,
) -> ChunkExecutor:
    """The executor the environment configures (see the module doc); ``pool`` is called only for
    the node agents' executor (it asks which hosts have one)."""
    from elastic_ops.agent.cluster import node_config_from_env
    from elastic_ops.agent.protocol import AGENT_SOCKET_ENV, agent_socket_from_env

    nodes = node_config_from_env(environ)
    if nodes is not None:
        from elastic_ops.executors.node import NodeExecutor

        return NodeExecutor(nodes, pool(), stores, log)
    path = agent_socket_from_env(environ)
    if path is not None:
        from elastic_ops.executors.host_agent import HostAgentExecutor

        return HostAgentExecutor(path, stores, log)
    from elastic_ops.executors.in_process import InProcessExecutor

    log.info("%s is not set: training in this task process", AGENT_SOCKET_ENV)
    return InProcessExecutor(stores, log)
