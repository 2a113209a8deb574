"""Deterministic, elastic data order.

The *sample stream* of a job is the concatenation of one permutation of the data set per epoch;
epoch ``e``'s permutation comes from a ``torch.Generator`` seeded from ``(data_seed, e)`` only.
Training consumes the stream front to back: an iteration whose global batch has ``B`` samples
takes ``stream[cursor:cursor + B]`` and advances the *cursor* (samples consumed so far, stored
in every checkpoint). How that batch is split among workers is recomputed from the current
worker count at every iteration, so the set of samples an epoch uses never depends on how many
workers ran, when they were rescaled, or where training was resumed: every sample of every
epoch is used exactly once.
"""

from __future__ import annotations

import functools
import hashlib

import torch


def _epoch_seed(data_seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"elastic-ops/order/{data_seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def iteration_seed(data_seed: int, iteration: int, stream: int) -> int:
    """The RNG seed of one (iteration, virtual shard or worker) pair, e.g. for dropout.

    A splitmix64-style mix (it runs every iteration, so no hashlib); distinct inputs give
    well-spread, practically distinct seeds.
    """
    z = (data_seed * 0x9E3779B97F4A7C15 + iteration * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) & (2**63 - 1)


_M64 = 2**64 - 1
# streams of iteration_seed besides shards and ranks (>= 0): draws every rank must make alike
OPTIMIZER_STREAM = -1  # optimizer.step() and scheduler.step() (an optimizer that adds noise)
EVALUATE_STREAM = -2  # evaluate() (a random validation subset, MC dropout)


@functools.lru_cache(maxsize=4)
def epoch_permutation(data_seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """The sample order of one epoch (a permutation of ``range(num_samples)``, int64)."""
    gen = torch.Generator()
    gen.manual_seed(_epoch_seed(data_seed, epoch))
    return torch.randperm(num_samples, generator=gen)


def stream_slice(data_seed: int, num_samples: int, cursor: int, count: int) -> torch.Tensor:
    """Samples ``stream[cursor:cursor + count]``; a batch may span an epoch boundary."""
    if num_samples < 1:
        raise ValueError("the training data set is empty")
    parts = []
    pos, left = cursor, count
    while left > 0:
        epoch, offset = divmod(pos, num_samples)
        take = min(left, num_samples - offset)
        parts.append(epoch_permutation(data_seed, epoch, num_samples)[offset : offset + take])
        pos += take
        left -= take
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges splitting ``total`` items into ``parts`` near-equal pieces.

    The first ``total % parts`` pieces get one extra item (fast mode weights each worker's
    gradient by its sample count, so uneven pieces are exact).
    """
    base, extra = divmod(total, parts)
    out, lo = [], 0
    for r in range(parts):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def shards_of_worker(virtual_shards: int, workers: int, rank: int) -> range:
    """The contiguous virtual shards worker ``rank`` computes (bitwise mode)."""
    lo, hi = even_split(virtual_shards, workers)[rank]
    return range(lo, hi)


def batch_size(global_batch: int, min_workers: int, workers: int, scaled: bool) -> int:
    """Samples per iteration: fixed, or ``global_batch / min_workers`` per worker when scaled."""
    return (global_batch // min_workers) * workers if scaled else global_batch
