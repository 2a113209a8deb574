"""The agents run on GPU hosts without Airflow's machinery: nothing in ``elastic_ops.agent`` (nor
the runtime and checkpoint layers below it) imports Airflow; the top-level CLI wires Airflow's
metrics into the node agent instead."""

from __future__ import annotations

import subprocess
import sys

IMPORTS = [
    "elastic_ops.agent.cli", "elastic_ops.agent.node", "elastic_ops.agent.server", "elastic_ops.agent.client",
    "elastic_ops.agent.node_client", "elastic_ops.agent.span", "elastic_ops.runtime.chunk",
    "elastic_ops.checkpoint", "elastic_ops.executors.api",
]


def test_the_agent_runtime_and_checkpoint_layers_never_import_airflow():
    code = (f"import sys\nfor m in {IMPORTS!r}:\n    __import__(m)\n"
            "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_cli_hands_the_node_agent_airflows_metrics():
    from elastic_ops.cli import _airflow_metrics, build_parser

    args = build_parser().parse_args(["node", "--host", "h1"])
    assert args.metrics is _airflow_metrics
