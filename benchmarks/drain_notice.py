"""Work lost per termination notice: a node agent killed at once vs drained.

    .venv/bin/python -m benchmarks.drain_notice [--notices 6] [--interval 100] [--seed 0]

Each notice starts a node agent process (``elastic-ops node --host bench --grace 60``, the local
Redis at ``ELASTIC_OPS_NODE_REDIS_URL``, default ``redis://127.0.0.1:6379/0``), runs a long chunk
of the digits MLP on it (1 worker, a fresh store, a periodic commit every ``--interval``
iterations) and, once the chunk's progress passes an iteration drawn uniformly from
``[interval, 4 * interval)``, sends the notice:

* ``kill``: SIGINT, which stops a node at once, killing the chunk's workers — what SIGTERM did
  before drains; the task's retry resumes from the last periodic commit;
* ``drain``: SIGTERM, which now drains the node: the chunk commits at its next iteration
  boundary and ends preempted; the next grant resumes from there.

The model is ``digits-fast.yaml``'s MLP made wider (hidden 1024, depth 4: tens of milliseconds
an iteration), so that the second a node takes to act on a stop (its request loop polls every
second) is a few iterations, not a whole interval. Per notice: ``reached`` (the iteration at the
notice: the node reports progress every 0.5 s, so the last report plus the time since at the
chunk's rate), ``trained`` (the larger of that and the last iteration reported before the chunk
ended), ``committed`` (the newest checkpoint once the node has exited), ``lost`` =
``max(0, trained - committed)`` iterations of work to redo (and in seconds, at the chunk's
measured rate), and ``exit_s``, notice → the node process exited. Notices alternate between the
two modes, each notice point drawn once for both. Writes ``benchmarks/results/drain_notice.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._results import record, write_json
from benchmarks.node_dispatch import bench_cluster, drop_namespace

RESULTS = Path(__file__).resolve().parent / "results" / "drain_notice.json"
SPEC_FILE = Path(__file__).resolve().parents[1] / "elastic_ops" / "examples" / "digits-fast.yaml"
NOTICE = {"kill": signal.SIGINT, "drain": signal.SIGTERM}
MODEL = {"hidden": 1024, "depth": 4}  # tens of ms an iteration: a stop takes few of them


def one_notice(
    mode: str, at: int, interval: int, env: dict[str, str], config: Any, root: Path
) -> dict[str, Any]:
    from elastic_ops.agent.node_client import NodeClient
    from elastic_ops.agent.protocol import StoreConfig
    from elastic_ops.checkpoint import open_store
    from elastic_ops.runtime.allocation import Allocation
    from elastic_ops.spec import JobSpec

    spec = JobSpec.from_yaml(SPEC_FILE).replace(
        total_iterations=100_000, chunk_iterations=100_000, checkpoint_interval=interval,
        checkpoint=f"file://{root}/{secrets.token_hex(4)}", max_workers=1,
        params={**JobSpec.from_yaml(SPEC_FILE).params, **MODEL},
    )
    client = NodeClient(config, accept_timeout_s=30.0)
    argv = [sys.executable, "-m", "elastic_ops.cli", "node", "--host", "bench", "--grace", "60"]
    node = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL, start_new_session=True)
    seen: list[tuple[int, float]] = []
    reached = threading.Event()
    outcome: dict[str, Any] = {}

    def progress(p: Any) -> None:
        seen.append((p.iteration, time.perf_counter()))
        if p.iteration >= at:
            reached.set()

    def task() -> None:
        try:
            outcome["result"] = client.run_chunk(
                spec.to_dict(), 0, spec.total_iterations, epoch=1, host="bench",
                store=StoreConfig(spec.checkpoint_uri()), target=lambda: Allocation(1), on_progress=progress)
        except Exception as exc:  # noqa: BLE001 - the kill's AgentLostError is the expected outcome
            outcome["error"] = type(exc).__name__

    try:
        deadline = time.monotonic() + 180
        while client.alive("bench") is None:
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the node agent did not come up")
            time.sleep(0.1)
        thread = threading.Thread(target=task, daemon=True)
        thread.start()
        if not reached.wait(300):
            raise RuntimeError(f"the chunk did not reach iteration {at}: {outcome}")
        t0 = time.perf_counter()
        node.send_signal(NOTICE[mode])
        node.wait(120)
        exit_s = time.perf_counter() - t0
        thread.join(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait(30)
    latest = open_store(spec.checkpoint_uri()).latest(decode=False)
    committed = latest.iteration if latest is not None else 0
    (i0, t_0), (i1, t_1) = seen[0], [x for x in seen if x[1] <= t0][-1]
    s_per_it = (t_1 - t_0) / max(i1 - i0, 1)
    # the node reports progress every 0.5 s: the iteration at the notice, from the last report and the rate
    iteration = i1 + int((t0 - t_1) / s_per_it)
    # trained before the workers stopped: at least that, and at least the last report (a node that
    # kills at once still trains until its request loop wakes, up to a second)
    trained = max(iteration, seen[-1][0])
    lost = max(0, trained - committed)
    status = outcome["result"].status.value if "result" in outcome else outcome.get("error")
    return {"mode": mode, "notice_at": at, "reached": iteration, "trained": trained, "committed": committed,
            "lost": lost,
            "lost_s": lost * s_per_it, "exit_s": exit_s, "s_per_iteration": s_per_it, "outcome": status}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--notices", type=int, default=6, help="notices per mode")
    p.add_argument("--interval", type=int, default=100, help="checkpoint_interval of the chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)

    config, env = bench_cluster()
    root = Path(tempfile.mkdtemp(prefix="drain-notice-"))
    rng = random.Random(args.seed)
    runs: list[dict[str, Any]] = []
    try:
        for n in range(args.notices):
            at = rng.randrange(args.interval, 4 * args.interval)
            for mode in (("kill", "drain") if n % 2 == 0 else ("drain", "kill")):  # the same point for both
                m = one_notice(mode, at, args.interval, env, config, root)
                runs.append(m)
                print(f"notice {n} {mode}: at ~{m['reached']}, committed {m['committed']}, lost {m['lost']} "
                      f"iterations ({m['lost_s']:.2f} s), node exited in {m['exit_s']:.2f} s "
                      f"({m['outcome']})", flush=True)
    finally:
        drop_namespace(config)

    summary = {}
    for mode in NOTICE:
        ms = [m for m in runs if m["mode"] == mode]
        summary[mode] = {
            "lost_mean": statistics.mean(m["lost"] for m in ms), "lost_max": max(m["lost"] for m in ms),
            "lost_s_mean": statistics.mean(m["lost_s"] for m in ms),
            "exit_s_median": statistics.median(m["exit_s"] for m in ms),
            # how far past the notice the newest commit is (a drain's: the next boundary)
            "committed_after_notice_mean": statistics.mean(m["committed"] - m["reached"] for m in ms),
            "outcomes": sorted({str(m["outcome"]) for m in ms}),
        }
    out = record("drain_notice", argv, notices=args.notices, interval=args.interval, seed=args.seed,
                 summary=summary, runs=runs)
    path = write_json(args.out, out)
    for mode, s in summary.items():
        print(f"{mode}: lost {s['lost_mean']:.1f} iterations per notice on average (max {s['lost_max']}, "
              f"{s['lost_s_mean']:.2f} s of training), node exit {s['exit_s_median']:.2f} s, {s['outcomes']}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
