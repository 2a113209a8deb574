"""``elastic-ops run``: train a job locally, print progress, end with one JSON line."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

from elastic_ops.errors import SpecError


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="train a job locally with N worker processes",
        description="Train a job's iterations locally. Progress goes to stderr; the last line on "
        "stdout is one JSON object with the result.",
    )
    p.add_argument("--spec", required=True, help="job spec YAML file")
    p.add_argument(
        "--workers-schedule",
        default=None,
        help="worker counts: '1,3,2' (equal parts of the run) or '1@0,3@40,2@70' "
        "(from iteration 40 on: 3 workers); default: max_workers throughout",
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint URI (file:///path or s3://bucket/prefix)")
    p.add_argument("--iterations", default=None, help="START:END range to train (default: the whole job)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_run, flags={})  # a spec field's error is the spec file's (see elastic_ops.cli)


def cmd_run(args: argparse.Namespace) -> int:
    from elastic_ops.runtime.job import Schedule, parse_range, run_job
    from elastic_ops.runtime.launcher import stop_processes
    from elastic_ops.runtime.outcome import jsonable
    from elastic_ops.spec import JobSpec, stop_reached

    spec = JobSpec.from_yaml(args.spec)
    if args.checkpoint is not None:
        try:
            spec = spec.replace(checkpoint=args.checkpoint)
        except SpecError as exc:
            raise exc.naming("--checkpoint") from None  # with the spec's hint (file:/// needs three slashes)
    start, end = parse_range(args.iterations, spec)
    schedule = args.workers_schedule
    schedule = None if schedule is None else Schedule.parse(schedule, spec, start, end)
    if not os.environ.get("ELASTIC_OPS_DEBUG"):
        # torch's launcher logs a worker's exit as a traceback of its own (ProcessExitedException)
        # before the error this command reports with the worker's cause
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    if not args.quiet:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("elastic-ops: %(message)s"))
        logger = logging.getLogger("elastic_ops.runtime")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    stopping = threading.Event()
    previous = _stop_on_sigterm(stopping)
    try:
        result = run_job(spec, schedule=schedule, start=start, end=end)
    except BaseException as exc:
        if stopped_by_sigterm(exc, stopping):  # whatever a launch under way made of the signal
            # a worker left running (the signal landed where no segment owned it yet) would hold
            # the exit: multiprocessing's exit handler joins every child, however long it waits
            stop_processes(multiprocessing.active_children())
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    ends = {"loss": result.loss, **result.metrics}
    out = {
        "job": spec.name,
        "status": result.status.value,
        "iterations": result.iteration - start if result.status.value != "already_done" else 0,
        "start": start,
        "end": end,
        "iteration": result.iteration,
        "loss": result.loss,
        "metrics": result.metrics,
        "param_sha256": result.param_sha256,
        "samples_per_sec": round(result.samples_per_sec, 2),
        "train_samples_per_sec": round(result.train_samples_per_sec, 2),
        "checkpoint": result.checkpoint_uri,
        "workers_timeline": [[i, n, round(t, 3)] for i, n, t in result.workers_timeline],
        "duration_s": round(result.duration_s, 3),
        "stopped_early": result.iteration < end and stop_reached(spec.stop_when, ends),
    }
    # strict JSON for whatever parses it: a NaN or inf metric (a diverged evaluation) is null
    print(json.dumps(jsonable(out), allow_nan=False), flush=True)
    return 0


def stopped_by_sigterm(exc: BaseException, stopping: threading.Event) -> bool:
    """Whether ``exc`` ends a run that SIGTERM stopped: our handler ran (``stopping``), or the
    signal reached torch's own handler (a launch installs one: it raises ``SignalException``)
    somewhere in the exception's chain. A SIGTERM during a segment launch surfaced as torch's
    exception, a fork server's ``FileNotFoundError`` or a worker's error: exit status 1, not 143."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if stopping.is_set():
        return True
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, SignalException) and exc.sigval == signal.SIGTERM:
            return True
        if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _stop_on_sigterm(stopping: threading.Event | None = None) -> Any:
    """SIGTERM (``docker stop``, systemd, ``kill``) ends the run as Ctrl-C does: the workers are
    stopped, a commit under way completes, and the chunk's work directory (its staged states)
    is removed. Python's default action ended the process at once, mid-commit, and left the
    directory to the next chunk on this host to sweep. Exit status 143 (128 + SIGTERM). Returns
    the handler it replaced (None where signals cannot be set: not the main thread)."""

    def stop(signum: int, frame: Any) -> None:
        if stopping is not None:
            stopping.set()
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, stop)
