"""What fencing costs a chunk: ``store.fence(epoch)`` with a new epoch, which every chunk try now
takes before it restores (``run_chunk`` with ``epoch > 0``), against the bare alternative it
adds to: one small object written to the same store (``backend.put``), side by side.

Local directory and S3 (moto server in a child process). Medians of ``--repeats`` calls, each
side alternating first. Writes ``benchmarks/results/fence_cost.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import write_json
from elastic_ops.checkpoint import open_store
from elastic_ops.checkpoint.s3 import make_client

RESULTS = Path(__file__).parent / "results" / "fence_cost.json"


def side_by_side(store: Any, repeats: int) -> dict[str, float]:
    fence, put = [], []
    for i in range(1, repeats + 1):
        runs = [
            ("fence", lambda i=i: store.fence(i)),
            ("put", lambda i=i: store.backend.put(f"bare/{i}", b"1")),
        ]
        for name, fn in runs if i % 2 else reversed(runs):
            t = time.perf_counter()
            fn()
            (fence if name == "fence" else put).append(time.perf_counter() - t)
    f, p = statistics.median(fence), statistics.median(put)
    return {"fence_s": f, "small_put_s": p, "fence_over_small_put": f / p}


def run(repeats: int) -> dict[str, Any]:
    from tests.s3_server import S3ServerProcess

    out: dict[str, Any] = {
        "command": "python -m benchmarks.fence_cost " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "repeats": repeats,
    }
    with tempfile.TemporaryDirectory(prefix="fence-bench-") as tmp:
        out["local"] = side_by_side(open_store(f"file://{tmp}/store"), repeats)
    with S3ServerProcess() as server:
        ep = server.endpoint("fence")
        client = make_client(ep.endpoint_url, region_name=ep.region, **ep.credentials)
        out["s3"] = side_by_side(open_store(ep.uri("store"), s3_client=client), repeats)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run(args.repeats)
    write_json(args.out, result)
    for where in ("local", "s3"):
        r = result[where]
        print(f"{where:5s} fence {r['fence_s'] * 1e3:.2f} ms, one small put {r['small_put_s'] * 1e3:.2f} ms "
              f"(x{r['fence_over_small_put']:.1f})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
