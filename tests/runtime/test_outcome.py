"""The torch-free chunk outcome types and the runtime package's lazily loaded names."""

from __future__ import annotations

import subprocess
import sys

import pytest

import elastic_ops.runtime as runtime
from elastic_ops.agent.client import result_from_wire
from elastic_ops.errors import AgentProtocolError
from elastic_ops.runtime.outcome import LOSS_HISTORY_MAX, ChunkResult, ChunkStatus, loss_steps


def make_result(**overrides) -> ChunkResult:
    fields = dict(
        status=ChunkStatus.PREEMPTED,
        start=0,
        end=30,
        iteration=17,
        checkpoint_uri="file:///c/it-17",
        loss=0.25,
        metrics={"acc": 0.9},
        workers_timeline=[(0, 2, 1.0), (10, 3, 2.5)],
        samples_per_sec=100.0,
        duration_s=3.0,
        param_sha256="ab" * 32,
        train_samples_per_sec=120.0,
        loss_history=[(16, 0.5), (17, 0.25)],
    )
    return ChunkResult(**{**fields, **overrides})


def test_a_result_survives_its_json_round_trip():
    result = make_result()
    wire = result.to_dict()
    assert wire["status"] == "preempted" and wire["workers_timeline"] == [[0, 2, 1.0], [10, 3, 2.5]]
    assert wire["loss_history"] == [[16, 0.5], [17, 0.25]]
    assert ChunkResult.from_dict({**wire, "added_by_a_newer_sender": 1}) == result


def test_every_exported_name_resolves():
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None
    assert set(runtime.__all__) <= set(dir(runtime))


def test_the_outcome_types_do_not_import_torch():
    code = "import sys, elastic_ops.runtime.outcome; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("history", [
    {"16": 0.5}, [[16, 0.5], [16, 0.25]], [[17, 0.5], [16, 0.25]], [[0, 0.5]], [[True, 0.5]],
    [[16, None]], [[16, "0.5"]], [[16]], [[i, 0.5] for i in range(1, LOSS_HISTORY_MAX + 2)],
])
def test_a_loss_history_from_the_agent_is_checked_on_receipt(history):
    wire = make_result().to_dict() | {"loss_history": history}
    with pytest.raises(AgentProtocolError, match="malformed result.*loss_history must be a list of at most"):
        result_from_wire(wire)


def test_a_states_loss_history_gives_each_step_the_iteration_it_reached():
    """``metrics.loss`` holds [iteration a step started at, loss]; the step is the iteration
    it reached: the next one's start (an adaptive step of 3 iterations), the state's iteration
    for the last. Only the chunk's steps; a step without a finite loss is left out."""
    entries = [[8, 0.9], [9, 0.8], [10, 0.7], [13, float("nan")], [14, 0.5]]
    assert loss_steps(entries, 15, 9, 20) == [(10, 0.8), (13, 0.7), (15, 0.5)]
    assert loss_steps(entries, 15, 0, 13) == [(9, 0.9), (10, 0.8), (13, 0.7)]
    assert loss_steps([], 15, 0, 20) == []
