"""What a newcomer meets first: a misspelt Trainable parameter is refused where the spec is
built (and before any worker starts), naming the parameter, the ones the Trainable accepts and
the closest; a model class named as the entrypoint is said to be a model, with how to wrap it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from elastic_ops.cli import main
from elastic_ops.errors import EntrypointError, SpecError
from elastic_ops.runtime import run_chunk
from elastic_ops.runtime.entrypoints import declared_params
from tests.runtime.builders import RecordingLauncher, make_spec

REPO = Path(__file__).resolve().parents[2]

MODELS = textwrap.dedent('''
    import torch
    from torch import nn

    from elastic_ops.runtime import Trainable


    class GRUNet(nn.Module):
        def __init__(self, hidden=8):
            super().__init__()
            self.gru = nn.GRU(4, hidden)


    class Base(Trainable):
        def build_model(self):
            return nn.Linear(4, 2)

        def build_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.1)

        def train_dataset(self):
            return torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))

        def loss(self, model, batch):
            return nn.functional.cross_entropy(model(batch[0]), batch[1])


    class Explicit(Base):
        def __init__(self, *, hidden: int = 32, layers: int = 1):
            super().__init__(hidden=hidden, layers=layers)


    class Required(Base):
        def __init__(self, data_dir, hidden=32):
            super().__init__(data_dir=data_dir, hidden=hidden)


    class Declared(Base):
        PARAMS = ("hidden", "dropout")


    class CatchAll(Base):
        pass


    class Extended(Declared):  # adds a parameter of its own: its **params declares nothing
        def __init__(self, **params):
            self.pace = params.pop("pace", 0)
            super().__init__(**params)


    class Narrowed(Declared):  # inherits PARAMS, and no __init__ of its own
        def loss(self, model, batch):
            return super().loss(model, batch)
''')


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "newcomer_nets.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "newcomer_nets"
    sys.modules.pop("newcomer_nets", None)


def test_a_misspelt_parameter_is_refused_before_any_worker_starts(models, tmp_path):
    launcher = RecordingLauncher()
    spec = make_spec(tmp_path, entrypoint=f"{models}:Explicit", params={"hiden": 32})
    with pytest.raises(SpecError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 4, launcher=launcher)
    assert str(err.value) == ("invalid params.hiden=32: Explicit takes no parameter 'hiden'; it accepts: "
                              "hidden, layers (hint: did you mean 'hidden'?)")
    assert launcher.requests == []  # no worker started


def test_where_the_trainable_is_imported_the_spec_itself_refuses_it(models, tmp_path):
    """A DAG that imports its model builds its spec at parse time: refused there."""
    make_spec(tmp_path, entrypoint=f"{models}:Explicit", params={"hidden": 8})  # not imported yet: unchecked
    __import__(models)
    with pytest.raises(SpecError, match=r"params.hiden=32: Explicit takes no parameter 'hiden'"):
        make_spec(tmp_path, entrypoint=f"{models}:Explicit", params={"hiden": 32})
    with pytest.raises(SpecError, match=r"params.dropuot=.*accepts: hidden, dropout.*'dropout'"):
        make_spec(tmp_path, entrypoint=f"{models}:Declared", params={"dropuot": 0.1})
    with pytest.raises(SpecError, match=r"missing params.data_dir: Required.__init__ requires it"):
        make_spec(tmp_path, entrypoint=f"{models}:Required", params={})
    make_spec(tmp_path, entrypoint=f"{models}:CatchAll", params={"anything": 1})  # **params: unchecked
    make_spec(tmp_path, entrypoint=f"{models}:Explicit", params={"hidden": 8, "layers": 2})


def test_what_counts_as_declared(models):
    mod = __import__(models)
    assert declared_params(mod.Explicit) == (("hidden", "layers"), ())
    assert declared_params(mod.Required) == (("data_dir", "hidden"), ("data_dir",))
    assert declared_params(mod.Declared) == (("hidden", "dropout"), ())
    assert declared_params(mod.CatchAll) is None
    assert declared_params(mod.Extended) is None
    assert declared_params(mod.Narrowed) == (("hidden", "dropout"), ())


def test_the_digits_example_declares_its_parameters(tmp_path, capsys):
    """``elastic-ops run`` with ``params: {hiden: 32}``: one line naming it, no traceback."""
    spec = yaml.safe_load((REPO / "examples" / "digits.yaml").read_text())
    spec["params"] = {"hiden": 32}
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["run", "--spec", str(path), "--checkpoint", f"file://{tmp_path}/ck", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "invalid params.hiden=32: DigitsMLP takes no parameter 'hiden'" in err
    assert "did you mean 'hidden'?" in err and "Traceback" not in err


def test_a_model_class_named_as_the_entrypoint_says_what_it_is_and_how_to_wrap_it(models, tmp_path):
    spec = make_spec(tmp_path, entrypoint=f"{models}:GRUNet")
    with pytest.raises(EntrypointError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 1)
    text = str(err.value)
    assert "GRUNet is a torch.nn.Module subclass (a model, not a Trainable)" in text
    assert "build_model(self): return GRUNet(**self.params)" in text and "Writing your own Trainable" in text
    assert "is type" not in text


def test_the_cli_shows_a_model_entrypoint_without_a_traceback(models, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "gru", "entrypoint": f"{models}:GRUNet", "total_iterations": 2,
                                    "global_batch": 4}))
    proc = subprocess.run([sys.executable, "-m", "elastic_ops.cli", "run", "--spec", str(path), "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "torch.nn.Module subclass" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_workers_are_titled_by_job_chunk_and_rank_and_their_pids_logged(tmp_path, caplog):
    """``ps`` showed every worker as the fork server's command line; now each names itself, and
    the chunk's log gives each segment's pids."""
    import logging
    import threading
    import time

    import psutil

    gate = tmp_path / "go"
    spec = make_spec(tmp_path, params={"hold_at": 3, "hold_file": str(gate)})
    caplog.set_level(logging.INFO, logger="elastic_ops")
    done: list = []
    runner = threading.Thread(target=lambda: done.append(run_chunk(spec, 0, 30, target=lambda i: 2)))
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while not (lines := [r.getMessage() for r in caplog.records if "pids rank0=" in r.getMessage()]):
            assert time.monotonic() < deadline and runner.is_alive(), "no segment started"
            time.sleep(0.1)
        assert lines[0].startswith("job tiny: segment 0, 2 worker(s) from iteration 0 on localhost, pids ")
        pids = dict(item.split("=") for item in lines[0].rsplit("pids ", 1)[1].split())
        titles = {}
        while len(titles) < 2 and time.monotonic() < deadline:  # set as each worker reads its segment
            titles = {r: " ".join(psutil.Process(int(p)).cmdline()).strip() for r, p in pids.items()}
            titles = {r: t for r, t in titles.items() if t.startswith("elastic-ops worker")}
            time.sleep(0.1)
        want = "elastic-ops worker tiny chunk 0-30 rank {}/2 segment 0 from iteration 0"
        assert titles == {f"rank{r}": want.format(r) for r in (0, 1)}
    finally:
        gate.write_text("")
        runner.join(120)
    assert done and done[0].iteration == 30
