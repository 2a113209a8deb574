"""The chunk trains on the node agent of the granted host (``ELASTIC_OPS_NODE_REDIS_URL``),
whichever machine runs the task (:mod:`elastic_ops.agent.node`).

Hosts without a live node agent are avoided when the task asks; a granted host whose node does
not take the chunk is reported like a host whose workers died, so the retry's grant avoids it.
A grant across hosts trains one process group over them when the leading node advertises an
address (``elastic-ops node --advertise-addr``; :mod:`elastic_ops.agent.span`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from elastic_ops.agent.cluster import NodeConfig
from elastic_ops.agent.node_client import NodeClient
from elastic_ops.errors import AgentLostError, NodeUnavailableError
from elastic_ops.executors.api import ChunkExecutor, ChunkRequest, LatestCheckpoint, Lease, PoolHosts, Stores
from elastic_ops.executors.in_process import InProcessExecutor
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import ChunkResult
from elastic_ops.spec import JobSpec


def busiest_host(placements: Sequence[tuple[str, int]]) -> str:
    """The host holding most of ``placements`` (the first of those tied, in grant order)."""
    counts: dict[str, int] = {}
    for host, _ in placements:
        counts[host] = counts.get(host, 0) + 1
    return max(counts, key=counts.__getitem__)  # dicts keep insertion order: ties go to the first


def node_target(target: Allocation, host: str, min_workers: int, span: bool = False) -> Allocation:
    """The pool's target as a node agent can follow it. A node that leads segments spanning
    hosts (``span``: started with ``--advertise-addr``) follows all of it while it holds at least
    one slot of it on its own host (rank 0 runs there; the other hosts' nodes run the rest). A
    node that does not starts workers on its own host only: at most the job's slots there. Fewer
    there than ``min_workers``, or none (the pool moved the job off this host, e.g. a drain) → 0:
    the chunk commits at its next boundary, gives the lease back and asks again, and its new
    grant trains on the other host's node."""
    here = len(target.on(host))
    if target.workers <= here or (span and here >= 1):
        return target
    return target.with_workers(here if here >= min_workers else 0)


class NodeExecutor(ChunkExecutor):
    """It trains on (spanning hosts: is led by) the node of the host holding most of the grant."""

    def __init__(
        self, config: NodeConfig, pool: PoolHosts, stores: Stores,
        log: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        super().__init__(stores, log)
        self.config = config
        self.pool = pool
        self.client = NodeClient(config)
        self.fallback = InProcessExecutor(stores, log)

    def _hosts(self) -> list[str]:
        return [h["name"] for h in self.pool.status()["hosts"]]

    def avoid_hosts(self) -> list[str]:
        """The pool's hosts that no node agent of the cluster announces (not started, stopped, dead
        for 10 s, or of another protocol version): a grant there could not train."""
        names = self._hosts()
        live = self.client.live_hosts(names)
        return [n for n in names if n not in live]

    def host_of(self, placements: Sequence[tuple[str, int]]) -> str:
        return busiest_host(placements)

    def can_train_on(self, host: str) -> bool:
        return host in self.client.live_hosts([host])

    def trained_on(self, host: str, lease: Lease) -> set[str]:
        return {host} | lease.hosts_used

    def latest(self, spec: JobSpec) -> LatestCheckpoint | None:
        """As a live node agent reads the store (it is shared: every node sees the same
        checkpoints); the task reads it itself when no node can answer."""
        try:
            live = sorted(self.client.live_hosts(self._hosts()))
            if live:
                found = self.client.latest(live[0], self._store_config(spec), spec.spec_hash())
                return LatestCheckpoint.of(found)
            self.log.warning("no node agent is live; reading the checkpoint store in this task process")
        except (NodeUnavailableError, AgentLostError) as exc:
            self.log.warning("%s; reading the checkpoint store in this task process", exc)
        return self.fallback.latest(spec)

    def run(self, request: ChunkRequest, lease: Lease) -> ChunkResult:
        spec, host = request.spec, request.host
        self.log.info("sending the chunk to the node agent of host %s (%r)", host, self.config)
        store = self._store_config(spec)
        if store.s3 is not None and (store.s3.access_key_id or store.s3.session_token):
            self.log.info("the aws connection's keys are not sent to node agents: the node opens %s "
                          "with its own host's credentials (endpoint and region are sent)", store.uri)
        # a node with an address the others reach leads one process group across the grant's hosts
        span = bool((self.client.alive(host) or {}).get("addr"))
        if span:
            self.log.info("the node agent of host %s leads process groups that span hosts: the chunk "
                          "follows the pool's whole target", host)
        warm = request.warm_start
        return self.client.run_chunk(
            spec.to_dict(), request.start, request.end, epoch=request.epoch, host=host, store=store,
            warm_start=self.stores.store_config(warm) if warm else None,
            target=lambda: node_target(lease.current(), host, spec.min_workers, span), spans=span,
            on_applied=lease.applied,
            on_progress=self._progress(request, lease),
        )

    def abort(self) -> None:
        self.client.abort()  # each node sees the session close and kills its workers now
