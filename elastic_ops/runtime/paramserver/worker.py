"""A worker of a parameter-server job: the loop of :class:`~elastic_ops.runtime.worker.TrainableWorker`
with the servers in place of the all-reduce and the optimizer.

Each iteration: pull the dense parameters (each from the server holding it); compute each of
this worker's virtual shards (seeded by shard, as in ``consistency: bitwise``), pulling the
rows of each table that the shard looks up and this iteration has not pulled yet (a forward
pre-hook on the table's module: model code calls its embeddings as usual); push each shard's
gradient to every server, the tables' as the rows touched and their gradient; wait for every
server's acknowledgement (which carries the global loss). The worker's copy of a table is a
cache: only rows pulled this iteration are ever read.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic_ops.runtime.consistency import _chunks, trainable_params
from elastic_ops.runtime.control import continues
from elastic_ops.runtime.data_order import EVALUATE_STREAM, iteration_seed, shards_of_worker, stream_slice
from elastic_ops.runtime.model_checks import metric_values, norm_layer_warning, warn
from elastic_ops.runtime.paramserver import wire
from elastic_ops.runtime.paramserver.layout import TABLE_MODULES, build_layout, split_by_server
from elastic_ops.runtime.segment import NonFiniteLoss, Segment, UserFailure, user_code
from elastic_ops.runtime.state import build_state, restore_rng
from elastic_ops.runtime.trainable import Trainable, load_trainable


def _refuse_before_step(trainable: Trainable) -> None:
    if type(trainable).before_step is not Trainable.before_step:
        raise TypeError(
            f"{type(trainable).__name__} overrides before_step(), which sees the whole reduced gradient; "
            "under "
            "strategy parameter_server no process holds it (each server steps its own shard): clip in the "
            "optimizer (a torch.optim subclass whose step() clips its own parameters' gradients) or use "
            "strategy allreduce"
        )


class PSWorker:
    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        spec = seg.spec
        self.servers = int(spec.servers)
        self.workers = seg.workers
        with user_code():
            self.trainable = load_trainable(spec.entrypoint, spec.params)
            _refuse_before_step(self.trainable)
            torch.manual_seed(spec.data_seed)  # the initial model the servers build too
            self.model = self.trainable.build_model()
            self.dataset = self.trainable.train_dataset()
            self.num_samples = len(self.dataset)
            trainable_params(self.model)
            self.layout = build_layout(self.model, self.servers)
        self.params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        self.dtype = self.params[0].dtype
        lay = self.layout
        self.shards = int(spec.virtual_shards)
        self.my_shards = shards_of_worker(self.shards, self.workers, seg.rank)
        self.dense_servers = [s for s in range(self.servers) if lay.dense_numel(s)]
        self.stamp = [torch.full((t.rows,), -1, dtype=torch.int64) for t in lay.tables]
        self._seen: list[list[torch.Tensor]] = [[] for _ in lay.tables]
        by_weight = {id(self.params[t.index]): pos for pos, t in enumerate(lay.tables)}
        for module in self.model.modules():
            if isinstance(module, TABLE_MODULES) and id(module.weight) in by_weight:
                hook = functools.partial(self._lookup, by_weight[id(module.weight)])
                module.register_forward_pre_hook(hook)
        self.iteration, self.cursor = seg.start, 0
        self.metrics: dict[str, list] = {"loss": [], "eval": []}
        self.it = -1
        self.training = False  # inside step(): lookups pull
        self.counter = wire.Counter()
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._restore(seg.load_state())
        if seg.rank == 0 and (norms := norm_layer_warning(self.model, "bitwise")):
            warn(norms)

    def _restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        with user_code():
            self.model.load_state_dict(state["model"])  # buffers; parameters are pulled
        if state.get("warm"):
            return
        self.iteration, self.cursor = int(state["iteration"]), int(state["cursor"])
        self.metrics = {"loss": list(state["metrics"]["loss"]), "eval": list(state["metrics"]["eval"])}
        restore_rng(state["rng"])

    def server_rank(self, s: int) -> int:
        return self.workers + s

    # --- pulls ---------------------------------------------------------------------------

    def _lookup(self, pos: int, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook of table ``pos``'s module: record the rows looked up, pull those this
        iteration has not pulled yet. Outside a training step (evaluate() on rank 0, after the
        servers' parameters were gathered into the model) it does nothing."""
        if not self.training:
            return
        ids = args[0].reshape(-1).to(torch.int64)
        self._seen[pos].append(ids)
        rows = torch.unique(ids)
        need = rows[self.stamp[pos][rows] != self.it]
        if len(need):
            self._pull_rows(pos, need)
            self.stamp[pos][need] = self.it

    def _pull_rows(self, pos: int, ids: torch.Tensor) -> None:
        t = self.layout.tables[pos]
        weight = self.params[t.index]
        works, parts = [], []
        for s, (a, b) in enumerate(split_by_server(ids, t)):
            if b == a:
                continue
            part = ids[a:b]
            rows = torch.empty(b - a, t.dim, dtype=self.dtype)
            local = part - t.ranges[s][0]
            works.append(dist.irecv(rows, self.server_rank(s), tag=wire.DATA))
            h = wire.header(wire.ROWS, pos, b - a, self.it)
            works.append(dist.isend(h, self.server_rank(s), tag=wire.HDR))
            works.append(dist.isend(local, self.server_rank(s), tag=wire.DATA))
            self.counter.add_sent(h)
            self.counter.add_sent(local)
            self.counter.add_received(rows)
            parts.append((part, rows, h, local))
        for w in works:
            w.wait()
        with torch.no_grad():
            for part, rows, _, _ in parts:
                weight.index_copy_(0, part, rows)

    def _pull_dense(self) -> None:
        lay = self.layout
        bufs, works, hs = {}, [], []
        for s in self.dense_servers:
            bufs[s] = torch.empty(lay.dense_numel(s), dtype=self.dtype)
            works.append(dist.irecv(bufs[s], self.server_rank(s), tag=wire.DATA))
            h = wire.header(wire.PULL, self.it)
            hs.append(h)
            works.append(dist.isend(h, self.server_rank(s), tag=wire.HDR))
            self.counter.add_sent(h)
            self.counter.add_received(bufs[s])
        for w in works:
            w.wait()
        with torch.no_grad():
            for s, buf in bufs.items():
                off = 0
                for i in lay.dense_of(s):
                    p = self.params[i]
                    p.copy_(buf[off : off + p.numel()].view_as(p))
                    off += p.numel()

    # --- one iteration ---------------------------------------------------------------------

    def step(self, it: int, batch: torch.Tensor) -> float:
        self.it = it
        self.training = True
        try:
            return self._step(it, batch)
        finally:
            self.training = False

    def _step(self, it: int, batch: torch.Tensor) -> float:
        self._pull_dense()
        size, total = len(batch) // self.shards, len(batch)
        for k in self.my_shards:
            for p in self.params:
                p.grad = None
            self._seen = [[] for _ in self.layout.tables]
            torch.default_generator.manual_seed(iteration_seed(self.seg.spec.data_seed, it, k))
            loss = torch.zeros((), dtype=self.dtype)
            with user_code():
                for micro in _chunks(batch[k * size : (k + 1) * size], self.seg.spec.micro_batch):
                    part = self.trainable.loss(self.model, self.trainable.fetch(self.dataset, micro))
                    if len(micro) != total:
                        part = part * (len(micro) / total)
                    part.backward()
                    loss.add_(part.detach())
            self._push(k, it, loss)
        acks = [torch.zeros(1, dtype=torch.float64) for _ in range(self.servers)]
        works = [dist.irecv(acks[s], self.server_rank(s), tag=wire.ACK) for s in range(self.servers)]
        for w, _ in self._sends:
            w.wait()
        self._sends = []
        for w in works:
            w.wait()
        for a in acks:
            self.counter.add_received(a)
        for p in self.params:
            p.grad = None
        return float(acks[0].item())

    def _table_grads(self) -> list[tuple[bool, torch.Tensor, torch.Tensor]]:
        """Each table's ``(used, ids, rows)`` for the shard just computed: the rows it looked up
        (sorted) and their gradient."""
        out = []
        for pos, t in enumerate(self.layout.tables):
            g = self.params[t.index].grad
            seen = self._seen[pos]
            ids = torch.unique(torch.cat(seen)) if seen else torch.empty(0, dtype=torch.int64)
            rows = torch.zeros(len(ids), t.dim, dtype=self.dtype)
            if g is None:
                out.append((False, ids[:0], rows[:0]))
                continue
            if g.is_sparse:
                g = g.coalesce()
                gi = g.indices()[0]
                where = torch.searchsorted(ids, gi)
                if len(gi) and (int(where.max()) >= len(ids) or not torch.equal(ids[where], gi)):
                    raise self._unpulled(t.name)
                rows.index_copy_(0, where, g.values())
            else:
                rows.copy_(g.index_select(0, ids))
                outside = g.ne(0).any(dim=1)
                outside[ids] = False
                if bool(outside.any()):
                    raise self._unpulled(t.name)
            out.append((True, ids, rows))
        return out

    @staticmethod
    def _unpulled(name: str) -> UserFailure:
        return UserFailure(ValueError(
            f"the loss has a gradient for rows of {name!r} its module's forward did not look up (the model "
            "read the table's weight directly?): under strategy parameter_server a table's rows are pulled "
            "when its nn.Embedding / nn.EmbeddingBag is called; call the module"
        ))

    def _push(self, k: int, it: int, loss: torch.Tensor) -> None:
        lay = self.layout
        tables = self._table_grads()
        n = len(lay.tables)
        cuts = [split_by_server(ids, t) for (_, ids, _), t in zip(tables, lay.tables, strict=True)]
        for s in range(self.servers):
            dense = lay.dense_of(s)
            numel = lay.dense_numel(s)
            head = torch.zeros(numel + len(dense) + 1, dtype=self.dtype)
            off = 0
            for j, i in enumerate(dense):
                p = self.params[i]
                if p.grad is not None:
                    g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                    head[off : off + p.numel()] = g.reshape(-1)
                    head[numel + j] = 1
                off += p.numel()
            head[-1] = loss
            used, counts, ids, rows = [], [], [], []
            for pos, (u, tids, trows) in enumerate(tables):
                a, b = cuts[pos][s]
                used.append(1 if u else 0)
                counts.append(b - a)
                ids.append(tids[a:b] - lay.tables[pos].ranges[s][0])
                rows.append(trows[a:b].reshape(-1))
            ints = (torch.cat([torch.tensor(used + counts, dtype=torch.int64), *ids]) if n
                    else torch.zeros(0, dtype=torch.int64))
            floats = torch.cat([head, *rows])
            h = wire.header(wire.PUSH, k, it, len(ints), len(floats))
            dst = self.server_rank(s)
            for tensor, tag in ((h, wire.HDR), (ints, wire.DATA), (floats, wire.DATA)):
                self._sends.append((dist.isend(tensor, dst, tag=tag), tensor))
                self.counter.add_sent(tensor)

    # --- state ---------------------------------------------------------------------------

    def _gather(self, kind: int) -> dict[str, Any]:
        """Rank 0: every server's snapshot (``SNAP``, or ``BYE`` with one), assembled into the
        job's state: the whole model (the servers' parameters, rank 0's buffers) and, under
        ``ps``, each server's optimizer and scheduler state."""
        for s in range(self.servers):
            h = wire.header(kind, *((1, self.iteration) if kind == wire.BYE else (self.iteration,)))
            dist.send(h, self.server_rank(s), tag=wire.HDR)
            self.counter.add_sent(h)
        snaps = [wire.bytes_state(wire.recv_blob(self.server_rank(s), self.counter))
                 for s in range(self.servers)]
        lay = self.layout
        with torch.no_grad():
            for i, name in enumerate(lay.names):
                if i in lay.dense_owner:
                    self.params[i].copy_(snaps[lay.dense_owner[i]]["params"][name])
            for t in lay.tables:
                self.params[t.index].copy_(torch.cat([sn["tables"][t.name] for sn in snaps]))
        self.stamp = [torch.full((t.rows,), -1, dtype=torch.int64) for t in lay.tables]
        state = build_state(iteration=self.iteration, cursor=self.cursor, model=self.model, optimizer=None,
                            scheduler=None, metrics=self.metrics)
        state["ps"] = {
            "servers": self.servers,
            "optimizer": [sn["optimizer"] for sn in snaps],
            "scheduler": [sn["scheduler"] for sn in snaps],
        }
        return state

    def _bye(self) -> None:
        for s in range(self.servers):
            h = wire.header(wire.BYE, 0, self.iteration)
            dist.send(h, self.server_rank(s), tag=wire.HDR)
            self.counter.add_sent(h)

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        seg, spec = self.seg, self.seg.spec
        loss, next_workers = math.nan, seg.workers
        t0, c0 = time.time(), self.cursor
        last, steps = seg.start - 1, 0
        from elastic_ops.runtime import worker as worker_module

        while True:
            it = self.iteration
            if it >= seg.end:
                break
            next_workers = seg.target(it)
            if not continues(next_workers, seg.workers):
                break
            if seg.rank == 0 and seg.checkpoint_due(it, since=last + 1):
                seg.write_checkpoint(it, self._gather(wire.SNAP))
            seg.publish(it, loss, self.cursor, since=last + 1, steps=steps)
            last = it
            worker_module.CURRENT_ITERATION = it
            b = spec.global_batch
            loss = self.step(it, stream_slice(spec.data_seed, self.num_samples, self.cursor, b))
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss} at iteration {it}")
            self.metrics["loss"].append([it, loss])
            self.cursor += b
            self.iteration = it + 1
            steps += 1
        seg.publish(self.iteration, loss, self.cursor, since=last + 1, steps=steps)
        train_s = time.time() - t0
        if seg.rank != 0:
            self._bye()
            return
        state = self._gather(wire.BYE)
        evaluation: dict[str, float] = {}
        if self.iteration >= seg.end:
            was_training = self.model.training
            self.model.eval()
            seed = iteration_seed(spec.data_seed, self.iteration, EVALUATE_STREAM)
            torch.default_generator.manual_seed(seed)
            with user_code(), torch.no_grad():
                evaluation = metric_values(self.trainable.evaluate(self.model))
            self.model.train(was_training)
            self.metrics["eval"].append([self.iteration, evaluation])
            state["metrics"]["eval"] = list(self.metrics["eval"])
        seg.write_result(
            self.iteration,
            state,
            cursor=self.cursor,
            next_workers=next_workers,
            loss=loss,
            evaluation=evaluation,
            train_seconds=train_s,
            samples=self.cursor - c0,
            steps=steps,
            ps_bytes_rank0=self.counter.sent + self.counter.received,
        )
