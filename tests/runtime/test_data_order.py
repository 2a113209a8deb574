"""Invariants of the elastic data order: every sample of an epoch is used exactly once,
whatever the worker counts, rescale points, batch growth and resume points."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ops.runtime.data_order import (
    batch_size,
    epoch_permutation,
    even_split,
    shards_of_worker,
    stream_slice,
)


def simulate(
    num_samples: int,
    seed: int,
    segments: list[tuple[int, int]],
    per_worker: int,
    scaled: bool,
    global_batch: int,
    bitwise_shards: int | None = None,
) -> list[list[int]]:
    """Replay a job as the workers see it: ``segments`` = (iterations, workers), resuming from
    the stored cursor at every segment start (a rescale, a preemption or a resume). Returns,
    per iteration, the concatenation of what each worker trained on (in rank order)."""
    cursor, out = 0, []
    for iterations, workers in segments:
        for _ in range(iterations):
            b = batch_size(global_batch, 1, workers, scaled) if scaled else global_batch
            batch = stream_slice(seed, num_samples, cursor, b)
            taken: list[int] = []
            if bitwise_shards:
                size = b // bitwise_shards
                for r in range(workers):
                    for k in shards_of_worker(bitwise_shards, workers, r):
                        taken += batch[k * size : (k + 1) * size].tolist()
            else:
                for lo, hi in even_split(len(batch), workers):
                    taken += batch[lo:hi].tolist()
            out.append(taken)
            cursor += b
    return out


def check_exactly_once(num_samples: int, iterations: list[list[int]]) -> None:
    flat = [i for it in iterations for i in it]
    full, rest = divmod(len(flat), num_samples)
    for e in range(full):
        epoch = flat[e * num_samples : (e + 1) * num_samples]
        assert sorted(epoch) == list(range(num_samples)), f"epoch {e} is not a permutation"
    tail = flat[full * num_samples :]
    assert len(set(tail)) == len(tail) == rest, "a sample repeats inside the unfinished epoch"


segments_st = st.lists(st.tuples(st.integers(1, 7), st.integers(1, 5)), min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(
    num_samples=st.integers(1, 50),
    seed=st.integers(0, 2**40),
    segments=segments_st,
    global_batch=st.integers(1, 23),
    scaled=st.booleans(),
)
def test_every_sample_of_an_epoch_is_used_exactly_once(num_samples, seed, segments, global_batch, scaled):
    check_exactly_once(num_samples, simulate(num_samples, seed, segments, 0, scaled, global_batch))


@settings(max_examples=100, deadline=None)
@given(
    num_samples=st.integers(1, 40),
    seed=st.integers(0, 1000),
    segments=segments_st,
    shards=st.sampled_from([1, 2, 4, 8]),
    mult=st.integers(1, 3),
)
def test_bitwise_shards_see_the_same_samples_for_any_worker_count(num_samples, seed, segments, shards, mult):
    """With fixed shards, what each iteration trains on is independent of the worker schedule."""
    gb = shards * mult
    segments = [(n, min(w, shards)) for n, w in segments]
    total = sum(n for n, _ in segments)
    elastic = simulate(num_samples, seed, segments, 0, False, gb, bitwise_shards=shards)
    static = simulate(num_samples, seed, [(total, 1)], 0, False, gb, bitwise_shards=shards)
    assert elastic == static
    check_exactly_once(num_samples, elastic)


@given(total=st.integers(0, 500), parts=st.integers(1, 64))
def test_even_split_is_a_contiguous_near_equal_partition(total, parts):
    ranges = even_split(total, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


@given(shards=st.integers(1, 64), workers=st.integers(1, 64))
def test_every_virtual_shard_has_exactly_one_worker(shards, workers):
    owned = Counter(k for r in range(workers) for k in shards_of_worker(shards, workers, r))
    assert owned == Counter(range(shards))


def test_epoch_order_depends_only_on_seed_and_epoch():
    a = epoch_permutation(3, 5, 100)
    epoch_permutation.cache_clear()
    assert torch.equal(a, epoch_permutation(3, 5, 100))
    assert not torch.equal(a, epoch_permutation(3, 6, 100))
    assert not torch.equal(a, epoch_permutation(4, 5, 100))


def test_a_batch_spanning_an_epoch_boundary_takes_the_next_epochs_head():
    batch = stream_slice(1, 10, 8, 5)
    head = epoch_permutation(1, 1, 10)[:3].tolist()
    assert batch.tolist() == epoch_permutation(1, 0, 10)[8:].tolist() + head
