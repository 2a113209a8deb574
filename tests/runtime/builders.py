"""Small builders for runtime tests: a tiny Trainable on generated data, and spec helpers."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastic_ops.runtime import Trainable
from elastic_ops.runtime.launcher import LaunchRequest, LocalLauncher
from elastic_ops.spec import JobSpec

ENTRY = "tests.runtime.builders:TinyMLP"


def _data(n: int, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 3, generator=g)
    y = (x @ w).argmax(dim=1)
    ids = torch.arange(n)
    return TensorDataset(x, y, ids)


class TinyMLP(Trainable):
    """8 -> 16 -> 3 MLP with dropout on generated, learnable data (fast enough for many runs).

    Test hooks (params): ``record_dir`` writes every sample id a rank trains on;
    ``fail_at`` raises a user error at that iteration's loss (``exit_at``: calls
    ``sys.exit(exit_code)``); ``nan_at`` returns NaN there;
    ``kill_rank``/``kill_at`` SIGKILL that rank once (a marker file makes it one-shot; ``kill_from``:
    at the first iteration at or past it, for an adaptive job's counter, which skips some);
    ``hold_at`` waits there until the file ``hold_file`` exists (a test's gate, at most 120 s;
    each waiting rank first creates ``<hold_file>.rank<r>``);
    ``sleep_s`` slows every loss call (the runner then decides few boundaries ahead);
    ``double_head`` makes the last layer float64 (parameters of two dtypes); ``numpy_scheduler``
    keeps a numpy scalar in the scheduler's state (which the safe loader refuses);
    ``plateau`` builds a ReduceLROnPlateau; ``eval_extra`` adds its items to evaluate()'s;
    ``aux_head`` adds a layer the loss never uses; ``weight_decay`` is SGD's; ``noisy_step`` adds
    noise in the optimizer's step; ``eval_draw`` adds a random draw to the accuracy;
    ``full_disk_rank``: that rank's disk is full (its ``torch.save`` raises ENOSPC); ``autocast``
    (a dtype name, e.g. ``bfloat16``) runs the forward under ``torch.autocast``; ``clip`` clips the
    global gradient's norm to it in ``before_step``.
    """

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.n = int(params.get("samples", 96))

    def build_model(self) -> nn.Module:
        if os.environ.get("RANK") == str(self.params.get("full_disk_rank")):
            def full(*args: Any, **kwargs: Any) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            torch.save = full  # this worker process only
        drop = float(self.params.get("dropout", 0.1))
        head = nn.Linear(16, 3).double() if self.params.get("double_head") else nn.Linear(16, 3)
        body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(drop), head)
        return WithAux(body) if self.params.get("aux_head") else body

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        sgd = NoisySGD if self.params.get("noisy_step") else torch.optim.SGD
        return sgd(model.parameters(), lr=float(self.params.get("lr", 0.1)), momentum=0.9,
                   weight_decay=float(self.params.get("weight_decay", 0.0)))

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        if self.params.get("plateau"):
            return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        if self.params.get("numpy_scheduler"):
            import numpy as np

            scheduler.base = np.float64(0.1)  # in state_dict(): every attribute but the optimizer
        return scheduler

    def train_dataset(self) -> TensorDataset:
        return _data(self.n)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y, ids = batch
        self._hooks(ids)
        p = self.params
        if p.get("autocast"):  # mixed precision as a user writes it: the forward under autocast
            with torch.autocast(x.device.type, dtype=getattr(torch, p["autocast"])):
                out = F.cross_entropy(model(x), y)
        else:
            out = F.cross_entropy(model(x), y)
        if p.get("nan_at") is not None and self._at(p["nan_at"]):
            return out * float("nan")
        return out

    def _hooks(self, ids: torch.Tensor) -> None:
        """The test hooks of every loss call (see the class doc)."""
        p = self.params
        if p.get("record_dir"):
            rank = os.environ["RANK"]
            with open(Path(p["record_dir"]) / f"rank{rank}-pid{os.getpid()}.txt", "a") as fh:
                fh.write(" ".join(str(int(i)) for i in ids) + "\n")
        kill = p.get("kill_at") is not None and os.environ["RANK"] == str(p["kill_rank"])
        if p.get("kill_from") is not None and os.environ["RANK"] == str(p["kill_rank"]):
            kill = kill or _current_iteration() >= int(p["kill_from"])
        if kill and (p.get("kill_at") is None or self._at(p["kill_at"])):
            marker = Path(p["marker"])
            if not marker.exists():
                marker.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
        if p.get("hold_at") is not None and self._at(p["hold_at"]):
            _hold(Path(p["hold_file"]))
        if p.get("sleep_s"):
            time.sleep(float(p["sleep_s"]))
        if p.get("fail_at") is not None and self._at(p["fail_at"]):
            raise ValueError("tiny model refuses this batch")
        if p.get("exit_at") is not None and self._at(p["exit_at"]):
            sys.exit(p.get("exit_code", 1))

    def before_step(self, model: nn.Module) -> None:
        if self.params.get("clip") is not None:  # clipping the global gradient, as users do
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(self.params["clip"]))

    def _at(self, iteration: int) -> bool:
        """Whether this call belongs to ``iteration`` (counts optimizer steps via the model)."""
        return _current_iteration() == int(iteration)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device  # the worker's GPU on CUDA: the data goes there
        x, y, _ = (t.to(device) for t in _data(self.n).tensors)
        with torch.no_grad():
            acc = (model(x).argmax(dim=1) == y).float().mean().item()
        if self.params.get("nan_eval"):
            return {"accuracy": acc, "perplexity": float("inf"), "r2": float("nan")}
        if self.params.get("eval_draw"):  # an evaluation that samples (a random subset, MC dropout)
            acc += float(torch.rand(1))
        return {"accuracy": acc, **self.params.get("eval_extra", {})}


class NoClipMLP(TinyMLP):
    """TinyMLP without its before_step (which the parameter server refuses)."""

    before_step = Trainable.before_step


REC_ENTRY = "tests.runtime.builders:TinyRec"


def _rec_data(n: int, users: int, items: int, seed: int = 321) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(users, (n,), generator=g)
    i = torch.randint(items, (n,), generator=g)
    y = ((u * 7 + i * 3) % 5 < 2).float()  # a learnable rule over the pairs
    return TensorDataset(u, i, y, torch.arange(n))


class RecNet(nn.Module):
    """Two embedding tables (users with a sparse gradient, items with a dense one) and an MLP
    head with dropout: the parameter server's row-served and dense parameters, both kinds."""

    def __init__(self, users: int, items: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.users = nn.Embedding(users, dim, sparse=True)
        self.items = nn.Embedding(items, dim)
        self.head = nn.Sequential(nn.Linear(2 * dim, 8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 1))

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        eu, ei = self.users(u), self.items(i)
        return (eu * ei).sum(-1) + self.head(torch.cat([eu, ei], -1)).squeeze(-1)


class KillingAdagrad(torch.optim.Adagrad):
    """Adagrad that SIGKILLs its parameter-server process once, at one iteration (a test hook)."""

    kill_server: int | None = None
    kill_at: int | None = None
    marker: str | None = None

    def step(self, closure: Any = None) -> Any:
        from elastic_ops.runtime.paramserver import server

        cls = type(self)
        if (cls.kill_server is not None and os.environ.get(server.SERVER_ENV) == str(cls.kill_server)
                and server.CURRENT_ITERATION == cls.kill_at and not Path(cls.marker).exists()):
            Path(cls.marker).write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(closure)


class TinyRec(TinyMLP):
    """A tiny recommender (:class:`RecNet`, 40 users x 60 items, Adagrad, StepLR) with TinyMLP's
    test hooks; ``kill_server``/``kill_server_at``/``marker``: that parameter server SIGKILLs
    itself once, in its optimizer's step of that iteration; ``read_weight`` looks a row up by
    indexing the table's weight (which the parameter server cannot see)."""

    before_step = Trainable.before_step  # TinyMLP's clips the whole gradient, which no server holds

    def build_model(self) -> nn.Module:
        return RecNet(int(self.params.get("users", 40)), int(self.params.get("items", 60)), 4,
                      float(self.params.get("dropout", 0.1)))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        p = self.params
        if p.get("kill_server") is not None:
            KillingAdagrad.kill_server = int(p["kill_server"])
            KillingAdagrad.kill_at = int(p["kill_server_at"])
            KillingAdagrad.marker = str(p["marker"])
            return KillingAdagrad(model.parameters(), lr=float(p.get("lr", 0.2)))
        return torch.optim.Adagrad(model.parameters(), lr=float(p.get("lr", 0.2)))

    def train_dataset(self) -> TensorDataset:
        return _rec_data(self.n, int(self.params.get("users", 40)), int(self.params.get("items", 60)))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        u, i, y, ids = batch
        self._hooks(ids)
        logits = model(u, i)
        if self.params.get("read_weight"):
            logits = logits + model.users.weight[u].sum(-1) * 0.0 + model.users.weight[0].sum() * 1e-3
        return F.binary_cross_entropy_with_logits(logits, y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        u, i, y, _ = self.train_dataset().tensors
        with torch.no_grad():
            acc = ((model(u, i) > 0).float() == y).float().mean().item()
        return {"accuracy": acc}


class NoisySGD(torch.optim.SGD):
    """SGD whose step adds noise to the gradients (the override pattern the docs give)."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(torch.randn_like(p.grad), alpha=0.01)
        return super().step(closure)


class WithAux(nn.Module):
    """A model with a head its forward never uses (an auxiliary head kept for later)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.aux = body, nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _hold(gate: Path) -> None:
    # says that this rank waits (``<gate>.rank<r>``): a test can act once every rank is past its
    # rendezvous and training
    gate.with_name(f"{gate.name}.rank{os.environ['RANK']}").touch()
    deadline = time.monotonic() + 120
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _current_iteration() -> int:
    """The iteration the worker is running (the worker's loop exposes it for test hooks)."""
    from elastic_ops.runtime import worker

    return worker.CURRENT_ITERATION


def final_state(spec: JobSpec) -> dict[str, Any]:
    """The state of ``spec``'s latest committed checkpoint (of its own trajectory)."""
    from elastic_ops.checkpoint import open_store

    store = open_store(spec.checkpoint)
    return store.load(store.latest(spec_hash=spec.spec_hash()))


def make_ps_spec(tmp_path: Path, **overrides: Any) -> JobSpec:
    """The standard tiny parameter-server job: TinyRec, 2 servers, 6 virtual shards, 30 iterations."""
    fields: dict[str, Any] = dict(entrypoint=REC_ENTRY, name="tinyrec", strategy="parameter_server",
                                  servers=2, global_batch=12, params={})
    fields.update(overrides)
    return make_spec(tmp_path, **fields)


def make_spec(tmp_path: Path, **overrides: Any) -> JobSpec:
    fields: dict[str, Any] = dict(
        name="tiny",
        entrypoint=ENTRY,
        total_iterations=30,
        global_batch=12,
        min_workers=1,
        max_workers=3,
        consistency="bitwise",
        virtual_shards=6,
        checkpoint=f"file://{tmp_path}/ckpt",
        checkpoint_interval=10,
        data_seed=7,
        params={},
    )
    fields.update(overrides)
    return JobSpec(**fields)


class RecordingLauncher(LocalLauncher):
    """The real launcher, keeping every request it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[LaunchRequest] = []

    def start(self, req: LaunchRequest) -> Any:
        self.requests.append(req)
        return super().start(req)
