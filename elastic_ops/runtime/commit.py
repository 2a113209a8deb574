"""Committing the states a chunk's workers stage, in order, off the training path."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elastic_ops.runtime.state import load_state, param_sha256

log = logging.getLogger("elastic_ops.runtime")


class Committer:
    """Commits staged states to the store, in order, off the training path.

    When the store is slower than the checkpoint interval, a staged state that a newer one has
    overtaken in the queue is dropped instead of committed (its file removed): the queue, and
    the staged files on disk, stay bounded, and the newest state still goes first to the
    store. States retention keeps for good (``keep_every``) are always committed.
    """

    def __init__(self, store: Any, epoch: int, spec_hash: str, keep_every: int | None = None) -> None:
        self.store, self.epoch, self.spec_hash, self.keep_every = store, epoch, spec_hash, keep_every
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="elastic-ops-commit")
        self.futures: list[Future] = []
        self.last_ref: Any = None
        self.newest = -1  # the newest iteration submitted
        self.dropped: list[int] = []

    def submit(self, iteration: int, path: str, metrics: dict[str, Any], *, remove: bool) -> Future:
        self.newest = max(self.newest, iteration)
        fut = self.pool.submit(self._commit, iteration, path, metrics, remove)
        self.futures.append(fut)
        return fut

    def _overtaken(self, iteration: int, remove: bool) -> bool:
        """A staged state (``remove``: a file of its own) that a newer submission supersedes."""
        kept = self.keep_every is not None and iteration % self.keep_every == 0
        return remove and not kept and iteration < self.newest

    def _commit(self, iteration: int, path: str, metrics: dict[str, Any], remove: bool) -> Any:
        if self._overtaken(iteration, remove):
            Path(path).unlink(missing_ok=True)
            if not self.dropped:
                log.warning(
                    "the checkpoint store is slower than checkpoint_interval: the state staged at "
                    "iteration %d is dropped for the newer one at %d (only the newest waiting state "
                    "is committed)", iteration, self.newest,
                )
            self.dropped.append(iteration)
            return None
        # the staged file is committed as it is (save_atomic wrote the bytes the store would);
        # mapped, not read, to hash the model's parameters
        model = load_state(path, mmap=True)["model"]
        metrics = {**metrics, "param_sha256": param_sha256(model)}
        del model  # the mapping goes with it
        ref = self.store.save_file(
            iteration, path, epoch=self.epoch, spec_hash=self.spec_hash, metrics=metrics
        )
        self.last_ref = ref
        if remove:
            Path(path).unlink(missing_ok=True)
        log.info("committed checkpoint at iteration %d: %s", iteration, ref.uri)
        return ref

    def check(self) -> None:
        """Raise the first commit failure (e.g. a stale fencing epoch) now."""
        for fut in self.futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def drain(self) -> None:
        for fut in self.futures:
            fut.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
