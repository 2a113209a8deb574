"""A chunk on a cluster's node agent (over Redis) vs on the per-host agent (over its Unix socket),
side by side in one run.

    .venv/bin/python -m benchmarks.node_dispatch [--iterations 1000] [--repeats 5]

Both agents run as their own processes on this machine, warm (torch imported, fork server
started), as in a deployment: ``elastic-ops agent --socket`` and ``elastic-ops node --host``
(with the local Redis at ``ELASTIC_OPS_NODE_REDIS_URL``, default ``redis://127.0.0.1:6379/0``).
Each repeat runs the same chunk of the digits MLP (``digits-fast.yaml``, 1 worker, a fresh
store) through each client, in alternating order, and measures:

* ``chunk_s``: the client's wall time for the whole chunk (request → result: dispatch, worker
  start, training, the final commit, the reply);
* ``start_s``: from the call to the ``applied`` callback of the first segment (the request
  delivered, validated, the store opened, the workers started and their start reported back):
  the fixed cost per chunk;
* ``rescale_s``: from the moment the pool's target turns 1 → 2 (once progress shows iteration 200) to the
  ``applied`` callback that reports the 2 workers running (target forwarding, the boundary, the
  relaunch, the reply).

Ratios are ``node / agent`` (1.0 = the cluster path costs nothing more). The node path adds Redis
round trips, the HMAC seal/open of every message and the 1-s beats; the training itself is the
same code. Writes ``benchmarks/results/node_dispatch.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks._results import write_json
from elastic_ops.runtime.allocation import Allocation

RESULTS = Path(__file__).resolve().parent / "results" / "node_dispatch.json"
SPEC_FILE = Path(__file__).resolve().parents[1] / "elastic_ops" / "examples" / "digits-fast.yaml"
GROW_AT = 200
METRICS = ("chunk_s", "start_s", "rescale_s")


@contextlib.contextmanager
def process(args: list[str], env: dict[str, str], ready: Callable[[], bool]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ops.cli", *args], env=env,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"elastic-ops {args[0]} did not come up")
            time.sleep(0.2)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def bench_cluster() -> tuple[Any, dict[str, str]]:
    """A namespace of its own on the local Redis (``ELASTIC_OPS_NODE_REDIS_URL``), and the
    environment of the agent processes started in it (this checkout on their ``PYTHONPATH``)."""
    from elastic_ops.agent.cluster import NodeConfig

    url = os.environ.get("ELASTIC_OPS_NODE_REDIS_URL", "redis://127.0.0.1:6379/0")
    config = NodeConfig(url=url, secret=secrets.token_urlsafe(24), namespace=f"bench-{secrets.token_hex(4)}")
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
               ELASTIC_OPS_NODE_REDIS_URL=config.url, ELASTIC_OPS_NODE_SECRET=config.secret,
               ELASTIC_OPS_NODE_NAMESPACE=config.namespace)
    return config, env


def drop_namespace(config: Any) -> None:
    r = config.redis()
    keys = list(r.scan_iter(f"{config.namespace}:*"))
    if keys:
        r.delete(*keys)


def one_chunk(client: Any, host: str, iterations: int, root: Path) -> dict[str, float]:
    from elastic_ops.agent.protocol import StoreConfig
    from elastic_ops.spec import JobSpec

    ckpt = f"file://{root}/{secrets.token_hex(4)}"
    spec = JobSpec.from_yaml(SPEC_FILE).replace(
        total_iterations=iterations, chunk_iterations=iterations, checkpoint_interval=iterations,
        checkpoint=ckpt, max_workers=2,
    )
    seen: list[int] = []
    grown: dict[str, float] = {}

    def wanted() -> int:
        if seen and seen[-1] >= GROW_AT:
            grown.setdefault("asked", time.perf_counter())
            return 2
        return 1

    def applied(i: int, running: Allocation) -> None:
        grown.setdefault("first_segment", time.perf_counter())
        if running.workers == 2:
            grown.setdefault("applied", time.perf_counter())

    t0 = time.perf_counter()
    result = client.run_chunk(
        spec.to_dict(), 0, iterations, epoch=1, host=host, store=StoreConfig(spec.checkpoint_uri()),
        target=lambda: Allocation(wanted()), on_progress=lambda p: seen.append(p.iteration),
        on_applied=applied,
    )
    wall = time.perf_counter() - t0
    if result.iteration != iterations or "applied" not in grown:
        raise RuntimeError(f"chunk ended at {result.iteration} without the grow: {result.workers_timeline}")
    return {
        "chunk_s": wall,
        "start_s": grown["first_segment"] - t0,
        "rescale_s": grown["applied"] - grown["asked"],
        "loss": result.loss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    if args.iterations <= GROW_AT + 20:
        p.error(f"--iterations must be > {GROW_AT + 20} (the grow happens at {GROW_AT})")

    from elastic_ops.agent.client import AgentClient
    from elastic_ops.agent.node_client import NodeClient
    from elastic_ops.errors import AgentUnavailableError

    config, env = bench_cluster()
    root = Path(tempfile.mkdtemp(prefix="node-dispatch-"))
    sock = str(root / "agent.sock")
    node_client = NodeClient(config)

    def agent_up() -> bool:
        try:
            AgentClient(sock).ping()
            return True
        except AgentUnavailableError:
            return False

    runs: dict[str, list[dict[str, float]]] = {"agent": [], "node": []}
    try:
        with process(["agent", "--socket", sock], env, agent_up), process(
            ["node", "--host", "bench"], env, lambda: node_client.alive("bench") is not None
        ):
            clients = {"agent": AgentClient(sock), "node": node_client}
            for r in range(args.repeats + 1):  # the first round warms both up and is not counted
                order = ["agent", "node"] if r % 2 else ["node", "agent"]
                for name in order:
                    m = one_chunk(clients[name], "bench", args.iterations, root)
                    if r:
                        runs[name].append(m)
                    print(f"round {r} {name}: chunk {m['chunk_s']:.2f} s, start {m['start_s']:.3f} s, "
                          f"rescale {m['rescale_s']:.3f} s", flush=True)
    finally:
        drop_namespace(config)

    med = {name: {k: statistics.median(m[k] for m in ms) for k in METRICS}
           for name, ms in runs.items()}
    ratios = {k: med["node"][k] / med["agent"][k] for k in METRICS}
    out = {
        "benchmark": "node_dispatch",
        "command": " ".join(["python -m benchmarks.node_dispatch", *given]),
        "iterations": args.iterations,
        "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "median": med,
        "ratio_node_over_agent": ratios,
        "extra_s_per_chunk": med["node"]["chunk_s"] - med["agent"]["chunk_s"],
        "runs": runs,
    }
    path = write_json(args.out, out)
    for k in METRICS:
        print(f"{k}: agent {med['agent'][k]:.3f} s, node {med['node'][k]:.3f} s (x{ratios[k]:.3f})")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
