"""Run every benchmark in turn (``make bench``); each writes its JSON to benchmarks/results/."""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = (
    ["benchmarks.runtime_overhead"],
    ["benchmarks.consistency_modes"],
    ["benchmarks.adaptive_digits"],
    ["benchmarks.checkpoint_io"],
    ["benchmarks.fence_cost"],
    ["benchmarks.handover"],
    ["benchmarks.pool_decision", "--repeats", "5"],
    ["benchmarks.pool_ledger", "--seconds", "3"],
    ["benchmarks.pool_simulator"],
    ["benchmarks.pool_repair"],
    ["benchmarks.airflow_overhead", "--iterations", "400"],
    ["benchmarks.node_dispatch", "--repeats", "9"],
    ["benchmarks.span_overhead", "--repeats", "5"],
    ["benchmarks.drain_notice"],
    ["benchmarks.parameter_server"],
)


def main() -> int:
    failed = []
    for module, *args in BENCHMARKS:
        print(f"== {module} {' '.join(args)}", flush=True)
        if subprocess.call([sys.executable, "-m", module, *args]) != 0:
            failed.append(module)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
