"""The verdict on a failed segment: which error the chunk ends with, and so whether it is
retried, and against which host (decisions as data: the rules below, tried in order)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from elastic_ops.errors import (
    AgentLostError,
    NonFiniteLossError,
    TrainingError,
    UserCodeError,
    WorkerLostError,
)
from elastic_ops.runtime.launcher import FailureReport
from elastic_ops.runtime.segment import PG_TIMEOUT_DEFAULT_S, PG_TIMEOUT_ENV

_TIMED_OUT = re.compile(r"timed out|timing out|timeout", re.IGNORECASE)  # gloo's and NCCL's words

# A worker's report kinds that are its host's fault: (kind, what the rank could not do, the fix)
_HOST_FAULTS = (
    ("storage", "could not write to its local disk",
     "free space where the host stages states (the chunk's work directory)"),
    ("device", "cannot use its GPU",
     "check the host's GPUs (nvidia-smi: a failed GPU, one busy in exclusive-process mode or held by a "
     "stray process, a driver older than torch's CUDA)"),
)


def segment_failure(
    host: str, segdir: Path, failures: dict[int, Any], report: FailureReport
) -> Exception:
    """The error a failed segment ends the chunk with: what its ranks reported (``error-*.json`` in
    ``segdir``, and the other hosts' ranks in ``report``), their exit codes (``failures``) and
    signals (``report.killed``), judged in order: the user's error, the host's fault, a stopped node
    agent, another host's lost ranks, an internal error, then the lost worker on ``host``."""
    reports = []
    for path in sorted(segdir.glob("error-*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    # a segment spanning hosts: what the other hosts' ranks reported, and who killed them
    reports += [dict(r) for r in report.remote_reports]
    remote_killed = dict(report.remote_killed)
    lost, stopped = report.lost_host, report.stopped_host
    signals = {rank: f.signal_name() for rank, f in failures.items() if f.exitcode < 0}
    signals = dict(sorted({**report.killed, **signals}.items()))
    # A user's error wins over a dead rank or a silent host: those often follow from it (our
    # teardown SIGKILLs a rank that ignored its SIGTERM; a spanning host busy past the grace
    # period counts as lost). A collective failing inside user code because a peer died is
    # reported as "comm", not "user", by the worker (worker._gloo_transport_error).
    for kind, cls in (("user", UserCodeError), ("nonfinite", NonFiniteLossError)):
        found = [r for r in reports if r["kind"] == kind]
        if found:
            r = min(found, key=lambda r: r["time"])
            when = "before training" if r["iteration"] is None else f"at iteration {r['iteration']}"
            msg = f"rank {r['rank']} {when}: {r['message']}"
            if r["traceback"]:
                msg += "\n" + r["traceback"]
            return cls(msg)
    for kind, what, fix in _HOST_FAULTS:  # the host's, reported by the rank that met it
        found = [r for r in reports if r["kind"] == kind]
        if found:
            r = min(found, key=lambda r: r["time"])
            host = r.get("host") or host
            return WorkerLostError(
                f"worker lost on {host}: rank {r['rank']} {what}: {r['message']}",
                host=host,
                hint=f"{fix}; the retry's grant avoids this host and resumes from the last committed "
                "checkpoint",
            )
    internal = [r for r in reports if r["kind"] == "internal"]
    if not signals and not remote_killed and stopped:
        return AgentLostError(  # an upgrade or restart, not the host failing: not held against it
            f"the elastic-ops node agent of host {stopped} stopped mid-segment",
            hint="retry resumes from the last committed checkpoint",
        )
    if not signals and (remote_killed or lost):
        # this host's ranks only lost their peers: the host whose ranks died is the one to blame
        host, what = lost, f"the node agent of host {lost} went away"
        if remote_killed:
            host = next(iter(remote_killed.values()))[0]
            what = ", ".join(f"rank {r} killed by {s}" for r, (_, s) in sorted(remote_killed.items()))
        return WorkerLostError(
            f"worker lost on {host}: {what}", host=host,
            hint="retry resumes from the last committed checkpoint",
        )
    if internal and not signals:
        r = internal[0]
        return TrainingError(f"runtime error on rank {r['rank']}: {r['message']}\n{r['traceback']}")
    what = ", ".join(f"rank {r} killed by {s}" for r, s in signals.items()) or ", ".join(
        f"rank {r} exited with {f.exitcode}" for r, f in failures.items()
    )
    hint = "retry resumes from the last committed checkpoint"
    comm = sorted((r for r in reports if r["kind"] == "comm"), key=lambda r: r["time"])
    timed_out = bool(comm) and _TIMED_OUT.search(comm[0]["message"]) is not None
    if comm and (not signals or timed_out):
        # no rank died (a peer stopped answering: hung, stopped, or slower than the process
        # group's timeout), or one that hung was then killed by the teardown (SIGKILL after
        # ignoring SIGTERM, e.g. a stopped process): say what the collective reported
        what += f" (rank {comm[0]['rank']}'s collective failed: {comm[0]['message']})"
        hint = (f"a rank that stops answering for {PG_TIMEOUT_ENV} seconds (default "
                f"{PG_TIMEOUT_DEFAULT_S}) fails its peers' collectives, and one that does not "
                f"exit on SIGTERM is killed with SIGKILL 30 s later; {hint}")
    return WorkerLostError(f"worker lost on {host}: {what}", host=host, hint=hint)
