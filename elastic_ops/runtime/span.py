"""Segments that span hosts: one process group whose ranks run on several hosts' workers.

The leader (the host whose runner holds the chunk, rank 0 and the control channel) starts its
own ranks with its local launcher and asks each other host for its part (``RemotePart``). A
*follower* runs its part here with :func:`start_follower`: a ``segment.json`` of its own that
says ``"span": true, "leader": false`` (no control channel; the targets and the starting state
come from rank 0 by broadcast, :mod:`elastic_ops.runtime.segment`), the ranks' environment with
the leader's store as ``MASTER_ADDR:MASTER_PORT``. Node agents carry the request and the outcome
between hosts (:mod:`elastic_ops.agent.span`); :class:`SpanningContext` is the leader's view of
the whole segment, shaped like the ``PContext`` the runner waits on.

Failures: a rank that dies on any host breaks the others' next collective, so every host's
ranks end; the context waits a moment (``grace_s``) for every host to say how its ranks ended,
so the runner can name the host whose rank was killed (not the hosts whose ranks merely lost a
peer) and report a user's exception from whichever rank raised it. A host that has not said
anything by then counts as lost: its node agent died or hangs (a node killed outright takes
its ranks with it, and only the peer timeout would tell).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from elastic_ops.runtime.launcher import FailureReport, LaunchRequest, RemotePart, Segment, start_on

GRACE_S = 5.0  # after a failure, how long the leader waits for every host's account of its ranks


@dataclasses.dataclass(frozen=True)
class RemoteExit:
    """How one host's part of a segment ended: ``killed`` maps a global rank to the signal that
    ended it; ``failed`` lists ranks that exited non-zero; ``reports`` are their ``error-<rank>``
    files; ``lost``: the host (its node agent) went silent, nothing more is known; ``stopping``:
    its node agent stopped them because it is shutting down (not the host failing)."""

    host: str
    killed: dict[int, str] = dataclasses.field(default_factory=dict)
    failed: tuple[int, ...] = ()
    reports: tuple[dict[str, Any], ...] = ()
    lost: bool = False
    stopping: bool = False

    @property
    def ok(self) -> bool:
        return not (self.killed or self.failed or self.lost or self.stopping)

    def to_wire(self) -> dict[str, Any]:
        return {"killed": {str(k): v for k, v in self.killed.items()}, "failed": list(self.failed),
                "reports": list(self.reports), "stopping": self.stopping}

    @classmethod
    def from_wire(cls, host: str, msg: dict[str, Any]) -> RemoteExit:
        from elastic_ops.errors import SpecError

        killed, failed, reports = msg.get("killed"), msg.get("failed"), msg.get("reports")
        if not (isinstance(killed, dict) and isinstance(failed, list) and isinstance(reports, list)):
            raise SpecError("exited", msg, "an object with 'killed' {rank: signal}, 'failed' [rank], "
                            "'reports' [object]")
        try:
            killed = {int(k): str(v) for k, v in killed.items()}
            failed = tuple(int(r) for r in failed)
        except (TypeError, ValueError):
            raise SpecError("exited", msg, "integer ranks") from None
        return cls(host=host, killed=killed, failed=failed,
                   reports=tuple({**_report(r), "host": host} for r in reports if isinstance(r, dict)),
                   stopping=msg.get("stopping") is True)


def _report(r: dict[str, Any]) -> dict[str, Any]:
    """A rank's error report as the runner reads one (only the keys it uses, typed)."""
    def num(v: Any, default: float) -> float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default
    iteration = r.get("iteration")
    return {
        "kind": str(r.get("kind", "internal")),
        "message": str(r.get("message", ""))[:20000],
        "traceback": str(r.get("traceback") or "")[:20000],
        "iteration": iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None,
        "rank": int(num(r.get("rank"), -1)),
        "time": num(r.get("time"), math.inf),
    }


class RemoteRanks(Protocol):
    """One other host's ranks of a running segment, as the leader sees them."""

    host: str

    def poll(self) -> RemoteExit | None:
        """``None`` while they run; how they ended once they all have (or the host was lost)."""

    def close(self) -> None:
        """Stop them (the segment ended or failed here)."""


def follower_config(leader_cfg: dict[str, Any], directory: Path) -> dict[str, Any]:
    """A follower's ``segment.json``: the leader's, without control channel or state file."""
    return {**leader_cfg, "dir": str(directory), "state_path": None, "span": True, "leader": False}


def follower_request(req: LaunchRequest, part: RemotePart, group_rank: int, directory: Path) -> LaunchRequest:
    """The launch of ``part`` on its host, from the leader's request ``req``."""
    return dataclasses.replace(
        req,
        workers=part.count,
        log_dir=directory / "logs",
        env={**{k: v for k, v in req.env.items() if k != "ELASTIC_OPS_SEGMENT"},
             "ELASTIC_OPS_SEGMENT": str(directory / "segment.json")},
        slots=part.slots,
        rank_offset=part.rank_offset,
        group_rank=group_rank,
        remote=(),
    )


class FollowerRanks:
    """A follower host's part, started here with ``launcher`` (a node agent's, or in tests this
    host's own: several "hosts" on one machine)."""

    def __init__(self, launcher: Any, req: LaunchRequest, leader_cfg: dict[str, Any], host: str) -> None:
        directory = Path(req.env["ELASTIC_OPS_SEGMENT"]).parent
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "segment.json").write_text(json.dumps(follower_config(leader_cfg, directory)))
        self.host, self.dir, self.offset = host, directory, req.rank_offset
        self.pc = start_on(launcher, req, host)  # a host fault of its launcher is this follower's

    def pids(self) -> dict[int, int]:
        return self.pc.pids()

    def poll(self) -> RemoteExit | None:
        result = self.pc.wait(0)
        if result is None:
            return None
        killed = {self.offset + r: sig for r, sig in self.pc.failure_report().killed.items()}
        failed = [self.offset + r for r in result.failures if self.offset + r not in killed]
        reports = []
        for path in sorted(self.dir.glob("error-*.json")):
            with contextlib.suppress(OSError, ValueError):
                reports.append({**_report(json.loads(path.read_text())), "host": self.host})  # as from_wire
        return RemoteExit(host=self.host, killed=killed, failed=tuple(sorted(failed)), reports=tuple(reports))

    def close(self) -> None:
        self.pc.close()


@dataclasses.dataclass
class _Failure:
    """A stand-in for a failed rank the leader's own processes do not show (it ran elsewhere)."""

    exitcode: int = 1

    def signal_name(self) -> str:
        return ""


@dataclasses.dataclass
class _Result:
    failures: dict[int, Any]
    return_values: dict[int, Any] = dataclasses.field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)


class SpanningContext:
    """The leader's local ranks plus the other hosts' :class:`RemoteRanks`, as one
    :class:`~elastic_ops.runtime.launcher.Segment`."""

    def __init__(self, local: Segment, remotes: Sequence[RemoteRanks], *, grace_s: float = GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.local, self.remotes = local, list(remotes)
        self.grace_s, self.clock = grace_s, clock
        self._exits: dict[str, RemoteExit] = {}
        self._local_result: Any = None
        self._failed_at: float | None = None

    def pids(self) -> dict[int, int]:
        return self.local.pids()

    def wait(self, timeout: float = -1, period: float = 1) -> Any:
        end = self.clock() + timeout if timeout >= 0 else math.inf
        while True:
            result = self._poll()
            if result is not None or self.clock() >= end:
                return result
            time.sleep(max(min(period, end - self.clock()), 0.0))

    def _poll(self) -> Any:
        if self._local_result is None:
            self._local_result = self.local.wait(0)
        for remote in self.remotes:
            if remote.host not in self._exits:
                ended = remote.poll()
                if ended is not None:
                    self._exits[remote.host] = ended
        local = self._local_result
        failed = (local is not None and local.failures) or any(not e.ok for e in self._exits.values())
        everyone = local is not None and len(self._exits) == len(self.remotes)
        if not failed:
            return local if everyone else None
        if self._failed_at is None:
            self._failed_at = self.clock()
        if not everyone and self.clock() - self._failed_at < self.grace_s:
            return None  # let every host say how its ranks ended
        return self._failure_result()

    def _failure_result(self) -> _Result:
        local = self._local_result
        failures = dict(local.failures) if local is not None else {}
        if local is None:
            self.local.close()  # they cannot go on without their peers
        for remote in self.remotes:
            if remote.host not in self._exits:
                # silent through the grace period while its peers failed: its node (or host) is
                # the likely cause (a node killed outright takes its ranks with it)
                self._exits[remote.host] = RemoteExit(host=remote.host, lost=True)
        for ended in self._exits.values():
            for rank in (*ended.killed, *ended.failed):
                failures.setdefault(rank, _Failure())
            if (ended.lost or ended.stopping) and not failures:
                failures[-1] = _Failure()
        if not failures:  # a remote part ended badly without naming a rank (should not happen)
            failures[-1] = _Failure()
        return _Result(failures=failures)

    def remote_reports(self) -> list[dict[str, Any]]:
        return [r for e in self._exits.values() for r in e.reports]

    def remote_killed(self) -> dict[int, tuple[str, str]]:
        return {rank: (e.host, sig) for e in self._exits.values() for rank, sig in e.killed.items()}

    def lost_host(self) -> str | None:
        return next((e.host for e in self._exits.values() if e.lost), None)

    def stopped_host(self) -> str | None:
        """A host whose node agent stopped its ranks because it is shutting down."""
        return next((e.host for e in self._exits.values() if e.stopping), None)

    def close(self) -> None:
        for remote in self.remotes:
            with contextlib.suppress(Exception):
                remote.close()
        self.local.close()

    def abort(self) -> None:
        """Stop every rank now (the chunk is being aborted): the other hosts' nodes stop theirs."""
        for remote in self.remotes:
            with contextlib.suppress(Exception):
                remote.close()
        self.local.abort()

    def failure_report(self) -> FailureReport:
        return FailureReport(
            killed=self.local.failure_report().killed, remote_reports=tuple(self.remote_reports()),
            remote_killed=self.remote_killed(), lost_host=self.lost_host(), stopped_host=self.stopped_host(),
        )
