"""The per-host agent: one long-lived process that runs chunks for the tasks on its host.

A chunk task that runs ``run_chunk`` itself pays, on every chunk, for importing torch in the
task process and for starting a fresh fork server that preloads torch for the workers (seconds
of CPU each). The agent (``elastic-ops agent --socket PATH``) pays for both once and keeps the
fork server warm; chunk tasks send it their chunk over a Unix socket (newline-delimited JSON,
never pickle) and receive progress, the result, or a typed error. See docs/runtime.md "Agent".

In a cluster, a node agent per host (``elastic-ops node --host NAME``,
:mod:`elastic_ops.agent.node`) runs the chunks the pool grants on that host for tasks on any
machine; tasks reach it through the cluster's Redis (:mod:`elastic_ops.agent.node_client`,
sealed envelopes: :mod:`elastic_ops.agent.redis_channel`). See docs/runtime.md "Node agents".

This package never imports Airflow; :mod:`elastic_ops.agent.client` and
:mod:`elastic_ops.agent.protocol` never import torch either, so a task process that talks to the
agent stays light. The server (:mod:`elastic_ops.agent.server`) imports the runtime.
"""

from __future__ import annotations

from elastic_ops.agent.protocol import AGENT_SOCKET_ENV, S3Config, StoreConfig, agent_socket_from_env

__all__ = ["AGENT_SOCKET_ENV", "S3Config", "StoreConfig", "agent_socket_from_env"]
