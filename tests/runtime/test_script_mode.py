"""Script mode: an existing DDP script, rescaled and resumed by the same runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_ops.checkpoint import open_store
from elastic_ops.errors import SpecError, TrainingError
from elastic_ops.runtime import ChunkStatus, Schedule, run_chunk
from elastic_ops.spec import JobSpec

SCRIPT = str(Path(__file__).with_name("ddp_script.py"))


def script_spec(tmp_path: Path, **kw) -> JobSpec:
    fields = dict(
        name="script",
        entrypoint=SCRIPT,
        total_iterations=24,
        global_batch=12,
        max_workers=3,
        consistency="fast",
        checkpoint=f"file://{tmp_path}/ckpt",
        checkpoint_interval=8,
        data_seed=1,
    )
    fields.update(kw)
    return JobSpec(**fields)


def test_a_ddp_script_trains_across_rescales_and_learns(tmp_path):
    spec = script_spec(tmp_path)
    first = run_chunk(spec, 0, 10, target=Schedule.parse("1@0,2@4", spec, 0, 10))
    assert first.status is ChunkStatus.COMPLETED
    result = run_chunk(spec, 10, 24, target=Schedule.parse("3@10,2@18", spec, 10, 24))
    assert [n for _, n, _ in result.workers_timeline] == [3, 2]
    store = open_store(spec.checkpoint)
    state = store.load(store.latest())
    assert state["iteration"] == 24 and state["cursor"] == 24 * 12
    losses = [loss for _, loss in state["metrics"]["loss"]]
    assert len(losses) == 24 and losses[-1] < losses[0] / 4  # it trained, from one trajectory
    w = state["model"]["weight"]
    assert torch.isfinite(w).all()


def _trained(tmp_path: Path, name: str, schedule: str, **kw) -> dict:
    spec = script_spec(tmp_path / name, total_iterations=12, **kw)
    result = run_chunk(spec, 0, 12, target=Schedule.parse(schedule, spec, 0, 12))
    assert result.status is ChunkStatus.COMPLETED
    store = open_store(spec.checkpoint)
    return store.load(store.latest())


def test_a_batch_that_splits_unevenly_trains_and_reports_the_same_whatever_the_workers(tmp_path):
    """7 samples on 3 workers are shares 3, 2, 2: DDP's equal-weight average of the workers'
    means is not the batch mean unless each is weighted (``loss_weight``), and rank 0's own
    loss is not the job's (a probe found 4199x the tolerance, and three different losses)."""
    one = _trained(tmp_path, "one", "1", global_batch=7)
    for schedule in ("3", "1@0,3@4,2@8"):
        other = _trained(tmp_path, schedule, schedule, global_batch=7)
        for k in one["model"]:
            assert torch.allclose(one["model"][k], other["model"][k], rtol=1e-5, atol=1e-6), (schedule, k)
        losses = torch.tensor([loss for _, loss in one["metrics"]["loss"]])
        theirs = torch.tensor([loss for _, loss in other["metrics"]["loss"]])
        assert torch.allclose(losses, theirs, rtol=1e-5, atol=1e-7), schedule


def test_script_mode_refuses_bitwise_consistency(tmp_path):
    with pytest.raises(SpecError, match="consistency"):
        run_chunk(script_spec(tmp_path, consistency="bitwise", virtual_shards=3), 0, 4, target=lambda i: 1)
    # the script runs its own forward and backward: a micro_batch would be silently ignored
    with pytest.raises(SpecError, match="invalid micro_batch=2: not with a script entrypoint"):
        run_chunk(script_spec(tmp_path, micro_batch=2), 0, 4, target=lambda i: 1)


def test_a_script_that_skips_the_loop_gets_a_clear_error(tmp_path):
    script = tmp_path / "lazy.py"
    script.write_text("print('I do not train')\n")
    spec = script_spec(tmp_path, entrypoint=str(script))
    with pytest.raises(TrainingError, match="without handing over"):
        run_chunk(spec, 0, 4, target=lambda i: 1)


ARGPARSE_SCRIPT = """
import argparse, json, sys
import torch
import elastic_ops.runtime.script as elastic

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
args = parser.parse_args()
ctx = elastic.init(num_samples=8)
model = torch.nn.Linear(2, 1)
if ctx.rank == 0:  # what the script saw: its argv, params and the seeded initial weights
    with open(ctx.params["seen"], "w") as f:
        json.dump({"argv": sys.argv[1:], "lr": args.lr, "params": ctx.params,
                   "weight": model.weight.tolist()}, f)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
ctx.restore(model, optimizer)
for it in ctx.iterations():
    ctx.commit(it, 0.0)
"""


def test_a_script_gets_the_specs_arguments_and_params_and_a_seeded_start(tmp_path):
    """An argparse script parsed the runner's own command line (``run --spec …``) and failed;
    scripts were not seeded, so two runs started from different models (a probe)."""
    import json

    script = tmp_path / "train.py"
    script.write_text(ARGPARSE_SCRIPT)
    seen = []
    for run in ("a", "b"):
        params = {"depth": 2, "seen": str(tmp_path / f"{run}.json")}
        spec = script_spec(tmp_path / run, entrypoint=str(script), script_args=["--lr", "0.5"],
                           params=params, total_iterations=2, global_batch=4)
        assert run_chunk(spec, 0, 2, target=lambda i: 2).status is ChunkStatus.COMPLETED
        seen.append(json.loads((tmp_path / f"{run}.json").read_text()))
    assert seen[0]["argv"] == ["--lr", "0.5"] and seen[0]["lr"] == 0.5
    assert seen[0]["params"] == {"depth": 2, "seen": str(tmp_path / "a.json")}
    assert seen[0]["weight"] == seen[1]["weight"]  # seeded with data_seed, as a Trainable's model


@pytest.mark.parametrize(("args", "says"), [
    ([], r"the script exited with status 2 \(sys.exit; argparse exits with 2 .* script_args \[\]\)"),
    (["--lr", "x"], r"exited with status 2"),
])
def test_a_script_that_exits_with_an_error_is_a_user_error_not_a_lost_worker(tmp_path, args, says):
    """A non-zero exit was reported as a lost worker: retryable, blamed on the host."""
    from elastic_ops.errors import UserCodeError

    script = tmp_path / "train.py"
    script.write_text(ARGPARSE_SCRIPT)
    spec = script_spec(tmp_path, entrypoint=str(script), script_args=args, total_iterations=2, global_batch=4)
    with pytest.raises(UserCodeError, match=says) as err:
        run_chunk(spec, 0, 2, target=lambda i: 2)
    assert not err.value.retryable


def test_sys_exit_with_a_message_is_that_message(tmp_path):
    from elastic_ops.errors import UserCodeError

    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit('no data in /nowhere')\n")
    with pytest.raises(UserCodeError, match="exited with the message 'no data in /nowhere'"):
        run_chunk(script_spec(tmp_path, entrypoint=str(script)), 0, 4, target=lambda i: 1)


KILLED_SCRIPT = """
import os, signal
from pathlib import Path
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import elastic_ops.runtime.script as elastic

ctx = elastic.init(num_samples=40)
model = DDP(nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
ctx.restore(model, optimizer)
marker = Path(ctx.params["marker"])
for it in ctx.iterations():
    if it == 3 and ctx.rank == 1 and not marker.exists():
        marker.write_text("killed")
        os.kill(os.getpid(), getattr(signal, ctx.params["signal"]))
    optimizer.zero_grad()
    loss = model(torch.ones(len(ctx.my_samples(it)), 4)).pow(2).mean()
    (loss * ctx.loss_weight()).backward()
    optimizer.step()
    ctx.commit(it, loss.item())
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_killed_script_worker_is_a_lost_worker_not_the_users_error(tmp_path, sig):
    """Rank 0's DDP allreduce fails inside the script when rank 1 is killed (gloo: a plain
    RuntimeError); that was a UserCodeError (not retried) in 2 of 3 runs for SIGKILL, in every
    run for SIGTERM (a signal the runner's own teardown sends, so not counted as the cause)."""
    from elastic_ops.errors import WorkerLostError

    script = tmp_path / "train.py"
    script.write_text(KILLED_SCRIPT)
    spec = script_spec(tmp_path, entrypoint=str(script), total_iterations=8, global_batch=4,
                       params={"marker": str(tmp_path / "killed"), "signal": sig})
    with pytest.raises(WorkerLostError, match="worker lost on host-a: rank . (killed|exited)") as err:
        run_chunk(spec, 0, 8, target=lambda i: 2, host="host-a")
    assert err.value.retryable and err.value.host == "host-a"
    assert run_chunk(spec, 0, 8, target=lambda i: 2).status is ChunkStatus.COMPLETED


@pytest.mark.parametrize(("line", "says"), [
    ("raise ValueError('bad row')", "rank 0 at iteration 2: ValueError: bad row"),
    ("sys.exit('no data')", "rank 0 at iteration 2: the script exited with the message 'no data'"),
])
def test_a_script_error_in_the_loop_names_its_iteration(tmp_path, line, says):
    """Every script error said 'before training', wherever the loop was."""
    from elastic_ops.errors import UserCodeError

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\nimport elastic_ops.runtime.script as elastic\n"
        "ctx = elastic.init(num_samples=8)\nmodel = torch.nn.Linear(1, 1)\n"
        "ctx.restore(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        f"for it in ctx.iterations():\n    if it == 2:\n        {line}\n    ctx.commit(it, 0.0)\n"
    )
    spec = script_spec(tmp_path, entrypoint=str(script), total_iterations=4, global_batch=4)
    with pytest.raises(UserCodeError, match=says):
        run_chunk(spec, 0, 4, target=lambda i: 1)


def test_a_script_error_after_the_loop_is_at_its_end(tmp_path):
    """A final evaluation failing after ctx.iterations() said 'at iteration 3' (the last one run)."""
    from elastic_ops.errors import UserCodeError

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nimport elastic_ops.runtime.script as elastic\n"
        "ctx = elastic.init(num_samples=8)\nmodel = torch.nn.Linear(1, 1)\n"
        "ctx.restore(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "for it in ctx.iterations():\n    ctx.commit(it, 0.0)\nraise ValueError('evaluation set missing')\n"
    )
    spec = script_spec(tmp_path, entrypoint=str(script), total_iterations=4, global_batch=4)
    with pytest.raises(UserCodeError, match="rank 0 at iteration 4: ValueError: evaluation set missing"):
        run_chunk(spec, 0, 4, target=lambda i: 1)
