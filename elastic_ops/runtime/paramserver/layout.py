"""Which parameter lives on which server: deterministic from the model's structure and the
number of servers, so every process (each server, each worker, any worker count) computes the
same layout without talking.

- A *table* is the weight of an ``nn.Embedding`` or ``nn.EmbeddingBag`` that is used nowhere
  else (a weight tied to an output layer gets a dense gradient: it is a dense parameter). Its
  rows are split over all ``K`` servers in contiguous ranges (:func:`even_split`); workers pull
  and push only the rows a batch touches.
- Every other trainable parameter is *dense*: held whole by one server, the servers balanced by
  elements (largest first, to the least loaded server; ties to the lowest index).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from elastic_ops.runtime.data_order import even_split

TABLE_MODULES = (nn.Embedding, nn.EmbeddingBag)


@dataclasses.dataclass(frozen=True)
class Table:
    """A row-served parameter: ``rows x dim``, rows ``ranges[s]`` on server ``s``."""

    index: int  # its position among the trainable parameters
    name: str
    rows: int
    dim: int
    sparse: bool  # the module gives a sparse gradient (``sparse=True``): the servers pass one on
    ranges: tuple[tuple[int, int], ...]

    def bounds(self) -> torch.Tensor:
        """The first row of each server's range after server 0's (for ``searchsorted``)."""
        return torch.tensor([lo for lo, _ in self.ranges[1:]], dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class Layout:
    servers: int
    names: tuple[str, ...]  # the trainable parameters, in model order
    shapes: tuple[tuple[int, ...], ...]
    tables: tuple[Table, ...]
    dense_owner: dict[int, int]  # dense parameter index -> its server

    def dense_of(self, server: int) -> list[int]:
        """The dense parameters ``server`` holds, in model order."""
        return [i for i, s in sorted(self.dense_owner.items()) if s == server]

    def dense_numel(self, server: int) -> int:
        return sum(_numel(self.shapes[i]) for i in self.dense_of(server))

    def elements(self, server: int) -> int:
        """Parameter elements ``server`` holds (its share of the model)."""
        rows = sum((t.ranges[server][1] - t.ranges[server][0]) * t.dim for t in self.tables)
        return rows + self.dense_numel(server)

    def table_elements(self) -> int:
        return sum(t.rows * t.dim for t in self.tables)

    def total_elements(self) -> int:
        return sum(_numel(s) for s in self.shapes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_layout(model: nn.Module, servers: int) -> Layout:
    """The layout of ``model``'s trainable parameters over ``servers`` servers."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ids = {id(p): i for i, (_, p) in enumerate(named)}
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    tables: list[Table] = []
    for name, module in model.named_modules():
        if not isinstance(module, TABLE_MODULES):
            continue
        weight = module.weight
        if not weight.requires_grad or uses.get(id(weight), 0) != 1 or weight.dim() != 2:
            continue  # frozen, tied to another layer (a dense gradient), or not a plain table
        if getattr(module, "max_norm", None) is not None:
            raise ValueError(
                f"embedding {name or '<model>'!r} has max_norm, which renormalises the rows it looks "
                "up in place, on the worker's copy: under strategy parameter_server the rows live on "
                "the servers; drop max_norm (or renormalise in the loss)"
            )
        rows, dim = weight.shape
        tables.append(Table(
            index=ids[id(weight)], name=f"{name}.weight" if name else "weight", rows=int(rows), dim=int(dim),
            sparse=bool(module.sparse), ranges=tuple(even_split(int(rows), servers)),
        ))
    tables.sort(key=lambda t: t.index)
    table_idx = {t.index for t in tables}
    load = [sum((t.ranges[s][1] - t.ranges[s][0]) * t.dim for t in tables) for s in range(servers)]
    dense = [i for i in range(len(named)) if i not in table_idx]
    owner: dict[int, int] = {}
    for i in sorted(dense, key=lambda i: (-named[i][1].numel(), i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += named[i][1].numel()
    return Layout(
        servers=servers,
        names=tuple(n for n, _ in named),
        shapes=tuple(tuple(p.shape) for _, p in named),
        tables=tuple(tables),
        dense_owner=owner,
    )


def split_by_server(ids: torch.Tensor, table: Table) -> list[tuple[int, int]]:
    """``[lo, hi)`` positions in the sorted ``ids`` that fall into each server's range."""
    cuts = torch.searchsorted(ids, table.bounds()).tolist() if table.ranges[1:] else []
    edges = [0, *cuts, len(ids)]
    return [(edges[s], edges[s + 1]) for s in range(len(table.ranges))]
