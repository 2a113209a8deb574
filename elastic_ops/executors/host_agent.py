"""The chunk trains on this host's agent (``ELASTIC_OPS_AGENT_SOCKET``): the task process never
imports torch; when no agent answers there, it trains in the task process instead."""

from __future__ import annotations

import logging
from typing import Any

from elastic_ops.agent.client import AgentClient
from elastic_ops.errors import AgentUnavailableError
from elastic_ops.executors.api import ChunkExecutor, ChunkRequest, LatestCheckpoint, Lease, Stores
from elastic_ops.executors.in_process import InProcessExecutor
from elastic_ops.runtime.outcome import ChunkResult
from elastic_ops.spec import JobSpec


class HostAgentExecutor(ChunkExecutor):
    """Sends the chunk to the agent at ``path`` and forwards the lease's target to it; the agent's
    error comes back as the same ``elastic_ops.errors`` class, so retry classification is
    unchanged."""

    def __init__(self, path: str, stores: Stores, log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        super().__init__(stores, log)
        self.client = AgentClient(path)
        self.fallback = InProcessExecutor(stores, log)

    def latest(self, spec: JobSpec) -> LatestCheckpoint | None:
        try:  # ask the agent: opening a store here would import torch
            return LatestCheckpoint.of(self.client.latest(self._store_config(spec), spec.spec_hash()))
        except AgentUnavailableError as exc:
            self.log.warning("%s; reading the checkpoint store in this task process", exc)
        return self.fallback.latest(spec)

    def run(self, request: ChunkRequest, lease: Lease) -> ChunkResult:
        self.log.info("sending the chunk to the elastic-ops agent at %s", self.client.path)
        warm = request.warm_start
        try:
            return self.client.run_chunk(
                request.spec.to_dict(), request.start, request.end, epoch=request.epoch, host=request.host,
                store=self._store_config(request.spec),
                warm_start=self.stores.store_config(warm) if warm else None,
                target=lease.current, on_applied=lease.applied,
                on_progress=self._progress(request, lease),
            )
        except AgentUnavailableError as exc:  # nothing ran there
            self.log.warning("%s; training in this task process instead", exc)
        return self.fallback.run(request, lease)

    def abort(self) -> None:
        self.client.abort()  # the agent sees the connection close and kills the workers at once
