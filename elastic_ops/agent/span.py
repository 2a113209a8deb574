"""Segments spanning hosts on node agents (:mod:`elastic_ops.runtime.span` is the runtime side).

A chunk runs on the node agent of its *leader* host (the one holding most of its grant). When
the pool's target places ranks on other hosts too, the leader's launcher (:class:`NodeSpanLauncher`)
sends each of those hosts' node agents a sealed ``ranks`` request over Redis, the same way a task
sends a chunk::

    {"op": "ranks", "version": 2, "host": "h2", "segment": {"spec": {...}, "start": 10, "end": 40,
     "workers": 4, "segment": 1}, "master_addr": "10.0.0.1", "master_port": 41234,
     "rank_offset": 2, "count": 2, "group_rank": 1, "slots": [0, 1], "device": "cuda",
     "threads_per_worker": 1, "rendezvous": "<32 hex digits>"}

The follower starts its ranks (:func:`serve_ranks`), answers ``{"type": "started"}``, and once
they have all exited ``{"type": "exited", "killed": {rank: signal}, "failed": [rank],
"reports": [...]}`` (their ``error-<rank>`` files). If the leader closes the session (the segment
failed there, or the chunk was aborted) or goes silent, the follower kills its ranks at once or
after the peer timeout; if the follower goes silent, the leader counts its host as lost.

Only nodes started with ``--advertise-addr`` lead such segments: the rendezvous store and rank
0 listen on that address, which the other hosts must reach (see docs/runtime.md "Spanning hosts").
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import re
import secrets
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_ops.agent.protocol import (
    PROTOCOL_VERSION,
    require_int,
    require_slots,
    require_str,
)
from elastic_ops.errors import AgentProtocolError, SpecError
from elastic_ops.spec import MAX_WORKERS_LIMIT

if TYPE_CHECKING:
    from collections.abc import Callable

    from elastic_ops.agent.node_client import NodeClient
    from elastic_ops.agent.redis_channel import RedisChannel, Signer
    from elastic_ops.runtime.launcher import Launcher, LaunchRequest, RemotePart, Segment
    from elastic_ops.runtime.span import FollowerRanks

log = logging.getLogger("elastic_ops.node")

RANKS_KEYS = frozenset(
    "op version host segment master_addr master_port rank_offset count group_rank slots device "
    "threads_per_worker rendezvous".split()
)
SEGMENT_KEYS = frozenset("spec start end workers segment".split())
POLL_S = 0.05
RENDEZVOUS_PURPOSE = "rendezvous"  # Signer.derive's purpose for a segment's rendezvous key
_TOKEN = re.compile(r"[0-9a-f]{32}")


def rendezvous_key(signer: Signer, token: str) -> str:
    """The rendezvous key of the spanning segment that ``token`` names (runtime/rendezvous.py):
    derived from the cluster's secret, so the same on every host and unknown to whoever reads
    Redis without the secret."""
    return signer.derive(RENDEZVOUS_PURPOSE, token)


def check_advertise_addr(value: str, field: str = "--advertise-addr") -> str:
    """``value`` as an IP address of this host that can be listened on, or :class:`SpecError`."""
    allowed = "an IPv4 or IPv6 address of this host that the other hosts' node agents can reach"
    try:
        addr = str(ipaddress.ip_address(value))
    except (TypeError, ValueError):
        raise SpecError(field, value, allowed) from None
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError as exc:
            raise SpecError(field, value, allowed, hint=f"this host cannot listen there: {exc}") from None
    return addr


def ranks_request(
    req: LaunchRequest, part: RemotePart, group_rank: int, leader_cfg: dict[str, Any], token: str,
) -> dict[str, Any]:
    """The ``ranks`` message asking ``part.host`` for ``part`` of the leader's launch ``req``;
    ``token`` names the segment's rendezvous key (:func:`rendezvous_key`), not the key itself."""
    return {
        "op": "ranks",
        "version": PROTOCOL_VERSION,
        "host": part.host,
        "segment": {k: leader_cfg[k] for k in SEGMENT_KEYS},
        "master_addr": req.master_addr,
        "master_port": req.master_port,
        "rank_offset": part.rank_offset,
        "count": part.count,
        "group_rank": group_rank,
        "slots": list(part.slots),
        "device": req.device,
        "threads_per_worker": req.threads_per_worker,
        "rendezvous": token,
    }


def _validate(req: dict[str, Any]) -> dict[str, Any]:
    from elastic_ops.spec import JobSpec

    unknown = sorted(set(req) - RANKS_KEYS)
    if unknown:
        raise SpecError("request", unknown,
                        f"known keys of a ranks request are {', '.join(sorted(RANKS_KEYS))}")
    seg = req.get("segment")
    if not isinstance(seg, dict) or set(seg) != SEGMENT_KEYS or not isinstance(seg.get("spec"), dict):
        raise SpecError("segment", seg, f"an object with exactly {', '.join(sorted(SEGMENT_KEYS))}")
    spec = JobSpec.from_dict(seg["spec"])
    total = spec.total_iterations
    start = require_int(seg, "start", field="segment.start", maximum=total - 1)
    end = require_int(seg, "end", 1, field="segment.end", maximum=total)
    world = require_int(seg, "workers", 2, field="segment.workers")
    if world > MAX_WORKERS_LIMIT or not start < end:
        raise SpecError("segment", {"start": start, "end": end, "workers": world},
                        f"start < end and at most {MAX_WORKERS_LIMIT} workers")
    offset, count = require_int(req, "rank_offset", 1), require_int(req, "count", 1)
    if offset + count > world:
        raise SpecError("count", count, f"ranks {offset}.. within the segment's {world} workers")
    slots = require_slots(req)
    if slots is None or len(slots) != count:
        raise SpecError("slots", req.get("slots"), f"{count} distinct GPU slot indices, one per rank")
    addr = require_str(req, "master_addr")
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise SpecError("master_addr", addr, "the leader node's IP address") from None
    port = require_int(req, "master_port", 1)
    if port > 65535:
        raise SpecError("master_port", port, "a TCP port, 1..65535")
    device = req.get("device")
    if device not in ("cpu", "cuda"):
        raise SpecError("device", device, "'cpu' or 'cuda'")
    token = req.get("rendezvous")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise SpecError("rendezvous", token, "the segment's rendezvous token: 32 lowercase hex digits")
    return {
        "spec": spec, "segment": {**seg, "start": start, "end": end, "workers": world,
                                  "segment": require_int(seg, "segment", field="segment.segment",
                                                         maximum=total)},
        "master_addr": addr, "master_port": port, "rank_offset": offset, "count": count,
        "group_rank": require_int(req, "group_rank", 1, maximum=MAX_WORKERS_LIMIT), "slots": slots,
        "device": device, "threads_per_worker": require_int(req, "threads_per_worker", 1, maximum=256),
        "rendezvous": token,
    }


class RanksSession:
    """A follower's part of one spanning segment (one ``ranks`` request)."""

    def __init__(
        self, channel: RedisChannel, request: dict[str, Any], launcher: Launcher, host: str, signer: Signer,
    ) -> None:
        self.channel, self.host, self.signer = channel, host, signer
        self.request = _validate(request)
        self.launcher = launcher
        self._ranks: Any = None
        self._lock = threading.Lock()
        self._aborted = False

    def abort(self) -> None:
        """Kill the ranks now (the node is stopping)."""
        with self._lock:
            self._aborted, ranks = True, self._ranks
        if ranks is not None:
            ranks.close()

    def run(self, poll_s: float = POLL_S) -> None:
        from elastic_ops.runtime.chunk import _script
        from elastic_ops.runtime.launcher import LaunchRequest
        from elastic_ops.runtime.span import FollowerRanks

        r, spec = self.request, self.request["spec"]
        directory = Path(tempfile.mkdtemp(prefix="elastic-ops-ranks-"))
        try:
            launch = LaunchRequest(
                workers=r["count"], script=_script(spec), master_addr=r["master_addr"],
                master_port=r["master_port"], segment=r["segment"]["segment"], log_dir=directory / "logs",
                env={"ELASTIC_OPS_SEGMENT": str(directory / "segment.json")}, device=r["device"],
                threads_per_worker=r["threads_per_worker"], slots=r["slots"], rank_offset=r["rank_offset"],
                world_size=r["segment"]["workers"], group_rank=r["group_rank"],
                rendezvous_key=rendezvous_key(self.signer, r["rendezvous"]),
            )
            cfg = {**r["segment"], "spec": r["segment"]["spec"], "dir": str(directory)}
            ranks = FollowerRanks(self.launcher, launch, cfg, self.host)
            with self._lock:
                self._ranks, aborted = ranks, self._aborted
            try:
                if aborted:
                    return
                first, world = r["rank_offset"], r["segment"]["workers"]
                log.info("job %s: ranks %d..%d of %d (segment %d) started for the leader at %s",
                         spec.name, first, first + r["count"] - 1, world, r["segment"]["segment"],
                         r["master_addr"])
                self.channel.send({"type": "started", "pids": sorted(ranks.pids().values())})
                self._follow(ranks, poll_s)
            finally:
                ranks.close()
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _follow(self, ranks: FollowerRanks, poll_s: float) -> None:
        while True:
            ended = ranks.poll()
            if ended is not None:
                if self._aborted:  # this node is stopping: not the host failing
                    ended = dataclasses.replace(ended, stopping=True)
                self.channel.send({"type": "exited", **ended.to_wire()})
                return
            try:
                msg = self.channel.read(timeout=poll_s)
            except EOFError as exc:  # the leader ended the segment, or went silent
                log.info("job %s: the leader closed the segment (%s); stopping its ranks here",
                         self.request["spec"].name, exc)
                return
            if msg is not None:
                raise AgentProtocolError(f"no message may follow a ranks request, got {msg.get('op')!r}")


class RedisRanks:
    """The leader's view of another host's ranks, through that host's node agent."""

    def __init__(self, host: str, channel: RedisChannel, close: Callable[[RedisChannel], None]) -> None:
        self.host, self.channel, self._close = host, channel, close
        self.ended: Any = None

    def poll(self) -> Any:
        from elastic_ops.runtime.span import RemoteExit

        if self.ended is not None:
            return self.ended
        try:
            msg = self.channel.read(timeout=0)
        except (EOFError, AgentProtocolError) as exc:
            log.warning("the node agent of host %s went away mid-segment: %s", self.host, exc)
            msg = {"type": "lost"}
        if msg is None:
            return None
        kind = msg.get("type")
        if kind == "exited":
            try:
                self.ended = RemoteExit.from_wire(self.host, msg)
            except SpecError as exc:
                log.warning("malformed 'exited' from the node agent of host %s: %s", self.host, exc)
                self.ended = RemoteExit(host=self.host, lost=True)
        else:
            if kind == "error":
                log.warning("the node agent of host %s: %s", self.host, msg.get("message"))
            self.ended = RemoteExit(host=self.host, lost=True)
        self.close()
        return self.ended

    def close(self) -> None:
        self._close(self.channel)


class NodeSpanLauncher:
    """A node agent's launcher: a segment's ranks on this host, and (``LaunchRequest.remote``)
    the other hosts' parts through their node agents."""

    def __init__(self, base: Launcher, nodes: NodeClient, address: str | None) -> None:
        self.base, self.nodes, self.address = base, nodes, address

    def start(self, req: LaunchRequest) -> Segment:
        if not req.remote:
            return self.base.start(req)
        from elastic_ops.runtime.span import SpanningContext

        leader_cfg = json.loads(Path(req.env["ELASTIC_OPS_SEGMENT"]).read_text())
        # every host's ranks derive the key from the cluster's secret and this public token: the
        # runner's own key would have to cross Redis, which anyone with access there can read
        token = secrets.token_hex(16)
        req = dataclasses.replace(req, rendezvous_key=rendezvous_key(self.nodes.signer, token))
        remotes: list[RedisRanks] = []
        try:
            for g, part in enumerate(req.remote, start=1):
                ask = ranks_request(req, part, g, leader_cfg, token)
                remotes.append(self.nodes.start_ranks(part.host, ask))
            local = self.base.start(dataclasses.replace(req, remote=()))
        except BaseException:
            for r in remotes:
                with contextlib.suppress(Exception):
                    r.close()
            raise
        return SpanningContext(local, remotes)
