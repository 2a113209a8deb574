"""A parameter-server process: holds one shard of the model's parameters and its optimizer
state for the whole chunk, and serves each segment's workers in turn.

Started by the runner (:mod:`.group`) when a chunk starts, with the state the chunk resumes
from; it builds the Trainable's model (seeded with ``data_seed``, as every worker does), keeps
its shard (:mod:`.layout`) and rebuilds the user's optimizer over it: the optimizer's class,
its ``defaults`` and each parameter group's hyperparameters, ``type(opt)(groups, **defaults)``,
then the user's scheduler over that optimizer. Every optimizer torch ships updates each element
from that element's own gradient and state, so a shard steps exactly as its part of the whole
model would (for a fixed ``servers``, which the spec hash includes).

Between segments it waits on its pipe from the runner: ``("segment", info)`` joins that
segment's process group (rank ``N + s``, the segment's signed rendezvous, whose key only the
pipe carries), serves until every worker said BYE, leaves the group and answers ``("left",
index, stats)``; ``("stop",)`` or the runner gone ends it. An error is reported as ``("error",
kind, message, traceback, iteration)`` before it exits.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_ops.runtime.data_order import OPTIMIZER_STREAM, iteration_seed
from elastic_ops.runtime.paramserver import wire
from elastic_ops.runtime.paramserver.layout import Layout, build_layout
from elastic_ops.runtime.segment import UserFailure, user_code

SERVER_ENV = "ELASTIC_OPS_PS_SERVER"  # the server's index, in its own environment (for test hooks)
CURRENT_ITERATION = -1  # the iteration this server last stepped or is stepping


def rebuild_optimizer(
    user_opt: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """The user's optimizer over the server's parameters: ``mapping`` from ``id()`` of a model
    parameter to the server's tensor for it (its whole value, or its rows). Groups keep their
    order and hyperparameters (a group with none of this server's parameters stays, empty, so
    a scheduler's per-group lambdas still line up)."""
    groups = []
    for group in user_opt.param_groups:
        params = [mapping[id(p)] for p in group["params"] if id(p) in mapping]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    cls = type(user_opt)
    try:
        opt = cls(groups[:1], **user_opt.defaults)
        for group in groups[1:]:
            opt.add_param_group(group)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"strategy parameter_server rebuilds build_optimizer()'s {cls.__name__} over each server's shard "
            f"as {cls.__name__}(param_groups, **optimizer.defaults), which failed ({exc}): use a torch.optim "
            "optimizer, or one whose constructor takes its defaults as keyword arguments"
        ) from exc
    return opt


class ServerShard:
    """Server ``index`` of ``servers``: its parameters, optimizer and scheduler."""

    def __init__(self, spec: Any, index: int, state_path: str | None) -> None:
        from elastic_ops.runtime.consistency import trainable_params
        from elastic_ops.runtime.model_checks import check_scheduler
        from elastic_ops.runtime.trainable import load_trainable

        self.spec, self.index = spec, index
        self.servers = int(spec.servers)
        with user_code():
            trainable = load_trainable(spec.entrypoint, spec.params)
            torch.manual_seed(spec.data_seed)  # the initial model every worker builds too
            model = trainable.build_model()
            trainable_params(model)  # one dtype, at least one
            self.layout: Layout = build_layout(model, self.servers)
            user_opt = trainable.build_optimizer(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.dtype = named[0][1].dtype
        lay = self.layout
        self.dense = lay.dense_of(index)
        self.dense_numel = lay.dense_numel(index)
        self.dense_flat = torch.zeros(self.dense_numel, dtype=self.dtype)
        self.params: dict[int, nn.Parameter] = {}
        off = 0
        for i in self.dense:
            p = named[i][1]
            view = self.dense_flat[off : off + p.numel()].view_as(p)
            view.copy_(p.detach())
            self.params[i] = nn.Parameter(view)  # shares dense_flat's storage: a pull sends it whole
            off += p.numel()
        self.rows: list[tuple[int, int]] = []
        for t in lay.tables:
            lo, hi = t.ranges[index]
            self.rows.append((lo, hi))
            self.params[t.index] = nn.Parameter(named[t.index][1].detach()[lo:hi].clone())
        mapping = {id(named[i][1]): p for i, p in self.params.items()}
        with user_code():
            self.opt = rebuild_optimizer(user_opt, mapping) if self.params else None
            self.scheduler = trainable.build_scheduler(self.opt) if self.opt is not None else None
            check_scheduler(self.scheduler)
        del model, user_opt, named
        if state_path:
            self._restore(state_path)
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "snapshot_bytes": 0, "steps": 0}

    def _restore(self, path: str) -> None:
        from elastic_ops.runtime.state import load_state

        state = load_state(path, mmap=True)
        model, names = state["model"], self.layout.names
        for i in self.dense:
            self.params[i].data.copy_(model[names[i]])
        for t, (lo, hi) in zip(self.layout.tables, self.rows, strict=True):
            self.params[t.index].data.copy_(model[names[t.index]][lo:hi])
        ps = state.get("ps")
        if state.get("warm") or not ps:  # a warm start (weights only), or a state without servers'
            return
        if int(ps["servers"]) != self.servers:
            raise ValueError(f"the state holds {ps['servers']} servers' shards, the job has {self.servers}")
        with user_code():
            if self.opt is not None:
                self.opt.load_state_dict(ps["optimizer"][self.index])
            if self.scheduler is not None and ps["scheduler"][self.index]:
                self.scheduler.load_state_dict(ps["scheduler"][self.index])

    # --- what a snapshot holds ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        names = self.layout.names
        return {
            "server": self.index,
            "params": {names[i]: self.params[i].detach() for i in self.dense},
            "tables": {t.name: self.params[t.index].detach() for t in self.layout.tables},
            "optimizer": self.opt.state_dict() if self.opt is not None else {},
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
        }

    # --- one iteration's step ----------------------------------------------------------

    def step(self, it: int, pushes: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Sum the shards' gradients in shard order 0..V-1 and step; the global loss."""
        global CURRENT_ITERATION
        CURRENT_ITERATION = it
        lay, shards = self.layout, sorted(pushes)
        head = self.dense_numel + len(self.dense) + 1  # dense grads, used flags, loss
        out = pushes[shards[0]][1][:head].clone()
        for k in shards[1:]:
            out.add_(pushes[k][1][:head])
        flags = out[self.dense_numel : head - 1].tolist()
        off = 0
        for j, i in enumerate(self.dense):
            p = self.params[i]
            p.grad = out[off : off + p.numel()].view_as(p) if flags[j] > 0 else None
            off += p.numel()
        n_tables = len(lay.tables)
        parsed = [_parse_tables(lay, pushes[k], head) for k in shards]
        for pos, t in enumerate(lay.tables):
            p = self.params[t.index]
            lo, hi = self.rows[pos]
            parts = [(ids[pos], rows[pos]) for used, ids, rows in parsed if used[pos]]
            if not parts:
                p.grad = None
                continue
            union = torch.unique(torch.cat([ids for ids, _ in parts]))  # sorted
            agg = torch.zeros(len(union), t.dim, dtype=self.dtype)
            for ids, rows in parts:  # shard order: the same additions for any worker count
                if len(ids):
                    agg.index_add_(0, torch.searchsorted(union, ids), rows)
            if t.sparse:
                p.grad = torch.sparse_coo_tensor(union.unsqueeze(0), agg, (hi - lo, t.dim), is_coalesced=True,
                                                 check_invariants=False)
            else:
                g = torch.zeros(hi - lo, t.dim, dtype=self.dtype)
                g.index_copy_(0, union, agg)
                p.grad = g
        del n_tables
        torch.default_generator.manual_seed(iteration_seed(self.spec.data_seed, it, OPTIMIZER_STREAM))
        with user_code():
            if self.opt is not None:
                self.opt.step()
            if self.scheduler is not None:
                self.scheduler.step()
        for p in self.params.values():
            p.grad = None
        self.stats["steps"] += 1
        return float(out[-1].item())

    # --- one segment -------------------------------------------------------------------

    def serve(self, info: dict[str, Any]) -> dict[str, Any]:
        """Join segment ``info``'s group, serve its workers until they all said BYE, leave."""
        from elastic_ops.runtime.rendezvous import SignedStore

        workers, world = int(info["workers"]), int(info["world"])
        timeout = datetime.timedelta(seconds=float(info["timeout_s"]))
        store = dist.TCPStore(info["addr"], int(info["port"]), world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=SignedStore(store, info["key"]), rank=workers + self.index,
                                world_size=world, timeout=timeout)
        counter = wire.Counter()
        shards = int(self.spec.virtual_shards)
        steps0 = self.stats["steps"]
        try:
            byes, pushes, it = 0, {}, -1
            hdr = torch.zeros(wire.HEADER, dtype=torch.int64)
            while byes < workers:
                src = dist.recv(hdr, src=None, tag=wire.HDR)
                counter.add_received(hdr)
                kind, a, b, c, d = hdr[:5].tolist()
                if kind == wire.PULL:
                    dist.send(self.dense_flat, src, tag=wire.DATA)
                    counter.add_sent(self.dense_flat)
                elif kind == wire.ROWS:
                    ids = torch.empty(b, dtype=torch.int64)
                    dist.recv(ids, src, tag=wire.DATA)
                    rows = self.params[self.layout.tables[a].index].detach().index_select(0, ids)
                    dist.send(rows, src, tag=wire.DATA)
                    counter.add_received(ids)
                    counter.add_sent(rows)
                elif kind == wire.PUSH:
                    ints = torch.empty(c, dtype=torch.int64)
                    floats = torch.empty(d, dtype=self.dtype)
                    dist.recv(ints, src, tag=wire.DATA)
                    dist.recv(floats, src, tag=wire.DATA)
                    counter.add_received(ints)
                    counter.add_received(floats)
                    pushes[a], it = (ints, floats), b
                    if len(pushes) == shards:
                        loss = self.step(it, pushes)
                        pushes = {}
                        ack = torch.tensor([loss], dtype=torch.float64)
                        works = [dist.isend(ack, w, tag=wire.ACK) for w in range(workers)]
                        for w in works:
                            w.wait()
                            counter.add_sent(ack)
                elif kind == wire.SNAP:
                    wire.send_blob(wire.state_bytes(self.snapshot()), src, counter)
                elif kind == wire.BYE:
                    byes += 1
                    if a:
                        wire.send_blob(wire.state_bytes(self.snapshot()), src, counter)
                else:
                    raise RuntimeError(f"parameter server {self.index}: unknown request {hdr.tolist()} "
                                       f"from rank {src}")
            if pushes:
                raise RuntimeError(f"parameter server {self.index}: the workers left iteration {it} "
                                   "half pushed")
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.stats["bytes_sent"] += counter.sent
        self.stats["bytes_received"] += counter.received
        self.stats["snapshot_bytes"] += counter.snapshot
        return {"bytes_sent": counter.sent, "bytes_received": counter.received,
                "snapshot_bytes": counter.snapshot, "steps": self.stats["steps"] - steps0}


def _parse_tables(lay: Layout, push: tuple[torch.Tensor, torch.Tensor], head: int):
    """One shard's push as ``(used, ids, rows)`` per table (ids local to this server's range)."""
    ints, floats = push
    n = len(lay.tables)
    used = ints[:n].tolist()
    counts = ints[n : 2 * n].tolist()
    ids_list, rows_list = [], []
    io, fo = 2 * n, head
    for t, c in zip(lay.tables, counts, strict=True):
        ids_list.append(ints[io : io + c])
        rows_list.append(floats[fo : fo + c * t.dim].view(c, t.dim))
        io += c
        fo += c * t.dim
    return used, ids_list, rows_list


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, UserFailure):
        return "user"
    if isinstance(exc, (RuntimeError, TimeoutError, ConnectionError)) and not isinstance(
            exc, NotImplementedError):
        return "comm"
    return "internal"


def server_entry(conn: Any, cfg: dict[str, Any]) -> None:
    """What a server process runs (started by :class:`~.group.ServerGroup`)."""
    os.environ.update(cfg["env"])
    from elastic_ops.runtime.worker import die_with_launcher

    die_with_launcher()
    if cfg.get("import_path"):
        from elastic_ops.runtime.entrypoints import extend_import_path

        extend_import_path(cfg["import_path"])
    try:
        from setproctitle import setproctitle

        setproctitle(f"elastic-ops parameter-server {cfg['spec'].get('name', '?')} {cfg['server']}/"
                     f"{cfg['spec'].get('servers')}")
    except ImportError:
        pass
    code = 0
    try:
        code = _serve_forever(conn, cfg)
    finally:
        conn.close()
    sys.exit(code)


def _serve_forever(conn: Any, cfg: dict[str, Any]) -> int:
    from elastic_ops.spec import JobSpec

    spec = JobSpec.from_dict(cfg["spec"])
    torch.set_num_threads(spec.threads_per_worker)
    torch.use_deterministic_algorithms(True)
    # the sparse gradients built here and in torch's sparse optimizers are well formed: say so
    # (torch warns on every one it builds while the choice is left implicit)
    torch.sparse.check_sparse_tensor_invariants.disable()
    shard = None
    try:
        shard = ServerShard(spec, int(cfg["server"]), cfg.get("state_path"))
        conn.send(("ready", int(cfg["server"]), shard.layout.elements(shard.index)))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the runner is gone
                return 0
            if msg[0] == "stop":
                return 0
            if msg[0] == "segment":
                stats = shard.serve(msg[1])
                conn.send(("left", int(msg[1]["index"]), stats))
    except BaseException as exc:
        text = exc.text if isinstance(exc, UserFailure) else traceback.format_exc()
        with contextlib.suppress(Exception):
            message = str(exc) if isinstance(exc, UserFailure) else f"{type(exc).__name__}: {exc}"
            conn.send(("error", _error_kind(exc), message, text, CURRENT_ITERATION))
        return 1
