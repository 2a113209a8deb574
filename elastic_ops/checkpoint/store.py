"""The checkpoint store: commit protocol, fencing, verification, retention.

Layout under the store's root (a directory or an S3 prefix)::

    it-00000040/manifest.json                 written LAST, create-if-absent: the commit point
    it-00000040/d-<writer-unique>/state.pt    data, in a directory only its writer uses
    _fence/epoch-00000000000000000007         one marker per fencing epoch seen; fence = max
    _spec/<spec hash>.json                    the job definition behind a hash (record_spec)

Save: upload the data (hashing it meanwhile), list the root once (fence check + retention
plan; on a remote store during a one-request upload), create the manifest if absent, delete
what retention drops. A checkpoint exists only
when its manifest exists, so a save interrupted before the manifest is invisible. Data
directories are writer-unique, so two writers racing for one iteration never overwrite each
other's bytes; the loser (or an identical retry) deletes its own copy. The fence only grows:
markers are created, never changed, and only markers below one the caller made sure exists
are pruned, so the maximum is never lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

from elastic_ops.checkpoint.archive import Archive, archive_decoding_works, decode_archive, read_archive
from elastic_ops.checkpoint.backend import Backend, ObjectInfo, write_file
from elastic_ops.checkpoint.checksum import DEFAULT_CHECKSUM, Checksum, hash_stream, parse_checksum
from elastic_ops.checkpoint.codec import (
    check_decodable,
    check_state,
    decode_state,
    encode_state,
    encode_state_into,
)
from elastic_ops.checkpoint.manifest import (
    MANIFEST_NAME,
    STATE_NAME,
    FileEntry,
    Manifest,
    check_metrics,
    parse_manifest,
)
from elastic_ops.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitConflictError,
    SpecError,
    StaleEpochError,
    short_repr,
)
from elastic_ops.metrics import NO_METRICS, Metrics

log = logging.getLogger("elastic_ops.checkpoint")

_IT_RE = re.compile(r"^it-(\d+)$")
ORPHAN_AGE_S = 3600.0  # data without a manifest this much older than the store's newest object is an orphan
_FENCE_DIR = "_fence"
_SPEC_DIR = "_spec"  # {spec_hash}.json: the job definition each spec hash stands for
_SPEC_HASH_RE = re.compile(r"[0-9a-f]{1,64}")  # a key's name: nothing but a digest
_FENCE_RE = re.compile(r"^_fence/epoch-(\d+)$")


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """Threads for reading data next to its manifest, and hashing next to an upload."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="elastic-ops-hash")
        return _POOL


def _forget_pool_after_fork() -> None:
    # a forked child has none of the parent's threads but would inherit an executor that
    # believes it has idle ones, and wait forever for them
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _is_state(name: str) -> bool:
    return name.rsplit("/", 1)[-1] == STATE_NAME


def _verify(ref: CheckpointRef, f: FileEntry, size: int | None, got: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``size`` and digest ``got`` are ``f``'s."""
    if size is None:
        raise CheckpointCorruptError(f"{ref.uri}/{f.name} is missing")
    if size != f.size:
        raise CheckpointCorruptError(
            f"{ref.uri}/{f.name} fails verification: size {size} instead of {f.size}"
        )
    if got != f.digest:
        raise CheckpointCorruptError(
            f"{ref.uri}/{f.name} fails verification: {f.algorithm.value} {got[:12]}… "
            f"instead of {f.digest[:12]}…"
        )


def _verify_or_remove(
    ref: CheckpointRef, f: FileEntry, size: int | None, got: str, path: str | os.PathLike[str],
) -> None:
    try:
        _verify(ref, f, size, got)
    except CheckpointCorruptError:
        Path(path).unlink(missing_ok=True)
        raise


def _check_loadable(ref: CheckpointRef, path: str | os.PathLike[str]) -> None:
    """Raise what decoding would (:class:`UnsafeCheckpointError`, :class:`CheckpointCorruptError`)
    if the safe loader refuses the state file at ``path``, and remove it then. Only the pickle is
    read: tensors land on the ``meta`` device, without their data."""
    try:
        check_decodable(path, name=f"{ref.uri}/{STATE_NAME}")
    except CheckpointCorruptError:
        Path(path).unlink(missing_ok=True)
        raise


def iteration_dir(iteration: int) -> str:
    return f"it-{iteration:08d}"


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint. ``uri`` is its iteration prefix; ``files`` come from its manifest."""

    uri: str
    iteration: int
    epoch: int
    spec_hash: str
    created: float
    files: tuple[FileEntry, ...]
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


class CheckpointStore:
    """Checkpoints of one job in one backend. Thread-safe for one writer plus readers.

    ``keep_last`` newest checkpoints are kept after each commit, plus every checkpoint whose
    iteration is a multiple of ``keep_every`` (when set). ``clock`` stamps manifests.
    ``checksum`` is the algorithm new checkpoints record (any known one is verified on load).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        clock: Callable[[], float] = time.time,
        checksum: Checksum | str = DEFAULT_CHECKSUM,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        if type(keep_last) is not int or keep_last < 1:
            raise SpecError("keep_last", keep_last, "must be an integer >= 1")
        if keep_every is not None and (type(keep_every) is not int or keep_every < 1):
            raise SpecError("keep_every", keep_every, "must be None or an integer >= 1")
        self.backend = backend
        self.uri = backend.uri
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.checksum = parse_checksum(checksum)
        self._clock = clock
        self.metrics = metrics  # counts checkpoints latest() passes over (damaged, refused)
        self._lock = threading.Lock()
        self._loaded: tuple[CheckpointRef, Any] | None = None  # what latest() verified and decoded
        # checkpoints latest() passed over although their checksums verify (content the safe
        # loader refuses): for callers to report; never loaded
        self.refused: list[CheckpointRef] = []
        self._executor: ThreadPoolExecutor | None = None
        self._executor_pid = os.getpid()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"

    # --- the job definitions the checkpoints belong to ----------------------------------------

    def record_spec(self, spec_hash: str, fields: Mapping[str, Any]) -> None:
        """Keep the fields behind ``spec_hash`` (``JobSpec.trajectory()``) beside the checkpoints,
        once per hash: a later run of a changed spec at this location is told what changed."""
        if not (isinstance(spec_hash, str) and _SPEC_HASH_RE.fullmatch(spec_hash)):
            raise SpecError("spec_hash", spec_hash, "must be a hex digest (JobSpec.spec_hash())")
        self.backend.put_if_absent(f"{_SPEC_DIR}/{spec_hash}.json",
                                   json.dumps(dict(fields), sort_keys=True).encode())

    def recorded_spec(self, spec_hash: str) -> dict[str, Any] | None:
        """The fields :meth:`record_spec` kept for ``spec_hash``; None if none (or unreadable)."""
        if not _SPEC_HASH_RE.fullmatch(spec_hash):
            return None
        data = self.backend.get(f"{_SPEC_DIR}/{spec_hash}.json")
        try:
            doc = json.loads(data) if data is not None else None
        except (UnicodeDecodeError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    # --- fencing ---------------------------------------------------------------------------

    def current_epoch(self) -> int:
        """The highest fencing epoch recorded for this store (0 when never fenced)."""
        return max(self._fence_markers(), default=0)

    def _fence_markers(self, objects: list[ObjectInfo] | None = None) -> list[int]:
        out = []
        for obj in self.backend.list(f"{_FENCE_DIR}/") if objects is None else objects:
            m = _FENCE_RE.match(obj.key)
            if m:
                out.append(int(m.group(1)))
        return out

    def fence(self, epoch: int) -> int:
        """Record ``epoch``: later saves with a lower epoch raise :class:`StaleEpochError`.

        Monotonic and idempotent; returns the fence after the call (``max(current, epoch)``).
        """
        if type(epoch) is not int or epoch < 0:
            raise SpecError("epoch", epoch, "must be an integer >= 0")
        markers = self._fence_markers()
        if epoch not in markers and epoch > max(markers, default=-1):
            self.backend.put_if_absent(f"{_FENCE_DIR}/epoch-{epoch:020d}", str(epoch).encode())
            markers.append(epoch)
        # prune markers below one this call made sure exists: the maximum is never deleted
        lower = [e for e in markers if e < epoch]
        if lower:
            self.backend.delete([f"{_FENCE_DIR}/epoch-{e:020d}" for e in lower])
        return max(markers)

    def _check_epoch(self, epoch: int, objects: list[ObjectInfo] | None) -> None:
        current = max(self._fence_markers(objects), default=0)
        if epoch < current:
            raise StaleEpochError(epoch, current)
        if epoch > current:
            # fence() lists again: a higher fence raised since the listing above (a new owner
            # fenced while this save uploaded) is seen there, and must refuse this save too
            current = self.fence(epoch)
            if epoch < current:
                raise StaleEpochError(epoch, current)

    # --- save ------------------------------------------------------------------------------

    def save(
        self,
        iteration: int,
        state: object,
        *,
        epoch: int,
        spec_hash: str,
        metrics: Mapping[str, Any] | None = None,
    ) -> CheckpointRef:
        """Commit ``state`` as the checkpoint of ``iteration``; see the module doc for the protocol.

        Returns once the checkpoint is committed; retention then runs on the background
        thread (:meth:`wait` waits for it).

        Raises :class:`StaleEpochError` when ``epoch`` is below the fence, and
        :class:`CommitConflictError` when another writer committed different bytes for this
        iteration first (an identical retry returns the existing checkpoint).
        """
        self._check_args(iteration, epoch, spec_hash)
        metrics = check_metrics(metrics)  # before any upload: a bad value leaves nothing behind
        list_during_upload = False
        if self.backend.remote:
            payload = {STATE_NAME: encode_state(state)}
            upload = self._bytes_uploader(payload)
            list_during_upload = self._list_during_upload(payload)
        else:  # encode straight into the file, hashing inline: no in-memory copy of the state
            check_state(state)
            algorithm = self.checksum

            def upload(prefix: str) -> tuple[FileEntry, ...]:
                name = f"{prefix}/{STATE_NAME}"
                digest, size = self.backend.put_stream(name, lambda f: encode_state_into(state, f, algorithm))
                return (FileEntry(name.split("/", 1)[1], algorithm, digest, size),)

        return self._commit(
            iteration,
            upload,
            epoch,
            spec_hash,
            metrics,
            in_background=False,
            list_during_upload=list_during_upload,
        )

    def save_file(
        self,
        iteration: int,
        path: str | os.PathLike[str],
        *,
        epoch: int,
        spec_hash: str,
        metrics: Mapping[str, Any] | None = None,
    ) -> CheckpointRef:
        """Commit the ``torch.save`` file at ``path`` as the checkpoint of ``iteration``, as it is:
        nothing is decoded or encoded again. Otherwise like :meth:`save`.

        The file is first checked to be one the safe loader accepts (its pickle only, ~2 ms;
        :class:`UnsafeCheckpointError` / :class:`CheckpointCorruptError` before anything is
        written). A local store then publishes it as a hard link when it lies on the same file
        system (``path`` must not be changed in place afterwards; deleting it is fine), else as a
        hashed copy; S3 uploads its bytes. A file written with ``torch.save`` under the name
        ``archive.pt`` holds the same bytes :meth:`save` would write for that state, so an
        identical retry through either method is recognised as identical.
        """
        self._check_args(iteration, epoch, spec_hash)
        metrics = check_metrics(metrics)
        check_decodable(path, name=str(path))
        if self.backend.remote:
            payload = {STATE_NAME: Path(path).read_bytes()}
            upload = self._bytes_uploader(payload)
            list_during_upload = self._list_during_upload(payload)
        else:
            algorithm, list_during_upload = self.checksum, False

            def upload(prefix: str) -> tuple[FileEntry, ...]:
                name = f"{prefix}/{STATE_NAME}"
                hasher = algorithm.hasher()
                size = self.backend.adopt(name, path, hasher)
                return (FileEntry(name.split("/", 1)[1], algorithm, hasher.hexdigest(), size),)

        return self._commit(
            iteration, upload, epoch, spec_hash, metrics,
            in_background=False, list_during_upload=list_during_upload,
        )

    def save_async(
        self,
        iteration: int,
        state: object,
        *,
        epoch: int,
        spec_hash: str,
        metrics: Mapping[str, Any] | None = None,
    ) -> Future[CheckpointRef]:
        """Like :meth:`save`, but only serialisation blocks the caller.

        The state is encoded (a snapshot: training may change its tensors right after this
        returns) and then written by one background thread; saves are committed in call order.
        The returned future raises whatever :meth:`save` would have raised.
        """
        self._check_args(iteration, epoch, spec_hash)
        files = {STATE_NAME: encode_state(state)}
        metrics = check_metrics(metrics)
        upload = self._bytes_uploader(files)
        return self._submit(
            self._commit,
            iteration,
            upload,
            epoch,
            spec_hash,
            metrics,
            in_background=True,
            list_during_upload=self._list_during_upload(files),
        )

    def _list_during_upload(self, payload: dict[str, bytes]) -> bool:
        """Whether the commit's listing may run while ``payload`` is uploaded (saves a round trip).

        Only where each file goes up in one request (``single_put_limit``: S3 below the multipart
        threshold): the listing then starts when the upload starts, so the window in which a
        newly raised fence can be missed grows by that one request and no more. A multipart
        upload (many requests, possibly minutes) lists after the upload, as a local store does
        (listing a directory costs less than handing it to a thread).
        """
        limit = self.backend.single_put_limit
        return limit is not None and all(len(data) < limit for data in payload.values())

    def _bytes_uploader(self, payload: dict[str, bytes]) -> Callable[[str], tuple[FileEntry, ...]]:
        """Upload encoded files under a prefix, hashing them meanwhile (hashlib frees the GIL)."""

        def upload(prefix: str) -> tuple[FileEntry, ...]:
            rel = prefix.split("/", 1)[1]
            algorithm = self.checksum
            hashing = [
                _pool().submit(FileEntry.of, f"{rel}/{name}", data, algorithm)
                for name, data in payload.items()
            ]
            for name, data in payload.items():
                self.backend.put(f"{prefix}/{name}", data)
            return tuple(h.result() for h in hashing)

        return upload

    def _submit(self, fn: Callable[..., Any], *args: object, **kwargs: object) -> Future[Any]:
        """Run ``fn`` on the store's one background thread (FIFO: work runs in call order)."""
        with self._lock:
            if self._executor is None or self._executor_pid != os.getpid():  # none, or a fork's copy
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="elastic-ops-ckpt")
                self._executor_pid = os.getpid()
            return self._executor.submit(fn, *args, **kwargs)

    def wait(self) -> None:
        """Wait until background work (async saves, retention after sync saves) is done."""
        with self._lock:
            idle = self._executor is None or self._executor_pid != os.getpid()
        if not idle:
            self._submit(lambda: None).result()

    def close(self) -> None:
        """Wait for background work, then stop the background thread (restarted on demand)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None and self._executor_pid == os.getpid():
            executor.shutdown(wait=True)

    @staticmethod
    def _check_args(iteration: int, epoch: int, spec_hash: str) -> None:
        if type(iteration) is not int or iteration < 0:
            raise SpecError("iteration", iteration, "must be an integer >= 0")
        if type(epoch) is not int or epoch < 0:
            raise SpecError("epoch", epoch, "must be an integer >= 0")
        if not isinstance(spec_hash, str):
            raise SpecError("spec_hash", spec_hash, "must be a string (JobSpec.spec_hash())")

    def _commit(
        self,
        iteration: int,
        upload: Callable[[str], tuple[FileEntry, ...]],
        epoch: int,
        spec_hash: str,
        metrics: Mapping[str, Any] | None,
        *,
        in_background: bool,
        list_during_upload: bool = False,
    ) -> CheckpointRef:
        it_dir = iteration_dir(iteration)
        manifest_key = f"{it_dir}/{MANIFEST_NAME}"
        # The fence check lists before the commit point: after the upload (only the fence
        # markers: what it costs does not grow with the checkpoints kept), or for one-request
        # uploads to a remote store during it (the whole store, which also serves the retention
        # plan and saves it a request). Either way the listing is complete before the manifest
        # is written, and only the manifest makes a checkpoint visible, so a stale writer is
        # still refused before anything becomes visible; the window in which a fence raised
        # meanwhile is missed is the manifest write, plus the data write when they overlap.
        listing = _pool().submit(self.backend.list, "") if list_during_upload else None
        try:
            # a writer-unique data directory: racing writers never overwrite each other's bytes
            entries = upload(f"{it_dir}/d-{uuid.uuid4().hex[:16]}")
        except BaseException:
            if listing is not None:  # the save ends with all its requests: none left in flight
                futures_wait([listing])
            raise
        ours = Manifest(
            iteration=iteration,
            epoch=epoch,
            spec_hash=spec_hash,
            created=float(self._clock()),
            files=entries,
            metrics=check_metrics(metrics),
        )
        objects = listing.result() if listing is not None else None  # None: fence markers only
        try:
            self._check_epoch(epoch, objects)
        except StaleEpochError:
            self.backend.delete([f"{it_dir}/{f.name}" for f in entries])  # a zombie leaves nothing
            raise
        body = ours.to_json()
        for _ in range(3):
            if self.backend.put_if_absent(manifest_key, body):
                break
            resolved = self._resolve_existing(ours, body, self.backend.get(manifest_key), manifest_key)
            if resolved is not None:  # committed (ours, its reply lost; or the same content)
                self._retain_after(iteration, objects, in_background)
                return resolved
            # the manifest there was damaged and is gone now (or vanished): commit ours again
        else:
            raise CommitConflictError(
                f"iteration {iteration} at {self.uri} could not be committed: its manifest kept "
                "changing under this writer",
                hint="another writer owns this job; only one chunk try may run at a time",
            )
        ref = self._ref(ours)
        log.info("committed checkpoint %s (epoch %d, %d bytes)", ref.uri, epoch, ref.size)
        self._retain_after(iteration, objects, in_background)
        return ref

    def _retain_after(self, iteration: int, objects: list[ObjectInfo] | None, in_background: bool) -> None:
        if in_background:
            self._retain(committed=iteration, objects=objects)
        else:  # the caller need not wait for deletions: retention runs on the background thread
            self._submit(self._retain, committed=iteration, objects=objects)

    def _resolve_existing(
        self, ours: Manifest, body: bytes, existing: bytes | None, key: str
    ) -> CheckpointRef | None:
        """The conditional manifest write found one there. Returns the checkpoint that stands,
        or ``None`` when there is none any more (a damaged one was removed): write ours again.

        - exactly our manifest: our own write succeeded but its reply was lost (then retried):
          committed, keep everything;
        - a damaged one (unreadable, or a file missing or failing its digest: what ``latest()``
          skips), or one whose content this store's ``latest()`` refused: it blocks the
          iteration for good unless removed, so it is (its data after its manifest, never ours);
        - an intact one: our upload lost (or repeats) the commit: ours is removed (data
          directories are writer-unique); identical content is success, else a conflict.
        """
        where = f"{self.uri}/{key}"
        if existing is None:
            return None  # removed since (retention, or a writer superseding a damaged one)
        if existing == body:
            log.info("checkpoint %s committed (the first reply to its manifest write was lost)", where)
            return self._ref(ours)
        theirs: Manifest | None = None
        try:
            theirs = parse_manifest(existing, where=where)
            if theirs.iteration != ours.iteration:
                raise CheckpointCorruptError(f"manifest {where} says iteration {theirs.iteration}")
            self._hash_verified(self._ref(theirs), {})
            if self._ref(theirs) in self.refused:  # latest() passed over it: unsafe content
                raise CheckpointCorruptError(f"{where}: content the safe loader refuses")
        except CheckpointCorruptError as exc:
            # only if it still is the damaged one: another writer may have replaced it while we
            # verified, and its commit must stand (then ours meets it on the next try)
            if not self.backend.delete_if(key, existing):
                log.info("the damaged checkpoint %s was replaced meanwhile by another writer", where)
                return None
            log.warning("replaced the damaged checkpoint %s: %s", where, exc)
            mine = {f.name for f in ours.files}
            theirs_files = [] if theirs is None else [f.name for f in theirs.files]
            self.backend.delete(
                [f"{iteration_dir(ours.iteration)}/{n}" for n in theirs_files if n not in mine]
            )
            return None
        self.backend.delete([f"{iteration_dir(ours.iteration)}/{f.name}" for f in ours.files])
        if theirs.same_content(ours):
            log.info("checkpoint %s already committed with identical content", where)
            return self._ref(theirs)
        raise CommitConflictError(
            f"iteration {ours.iteration} is already committed at {where} by epoch {theirs.epoch} "
            f"with different content",
            hint="another writer owns this job; only one chunk try may run at a time",
        )

    def _ref(self, m: Manifest) -> CheckpointRef:
        return CheckpointRef(
            uri=f"{self.uri}/{iteration_dir(m.iteration)}",
            iteration=m.iteration,
            epoch=m.epoch,
            spec_hash=m.spec_hash,
            created=m.created,
            files=m.files,
            metrics=m.metrics,
        )

    # --- read ------------------------------------------------------------------------------

    def _scan(self, objects: list[ObjectInfo] | None = None) -> dict[int, dict[str, int]]:
        """Objects grouped by iteration: {iteration: {key-in-iteration: size}}."""
        objects = self.backend.list("it-") if objects is None else objects
        by_it: dict[int, dict[str, int]] = {}
        for obj in objects:
            head, _, rest = obj.key.partition("/")
            m = _IT_RE.match(head)
            if m and rest:
                by_it.setdefault(int(m.group(1)), {})[rest] = obj.size
        return by_it

    def _newest_first(self) -> Iterator[tuple[int, dict[str, int]]]:
        """(iteration, {key-in-iteration: size}), newest first.

        A backend that lists one level at a time (``list_dirs``: local) is listed one iteration
        at a time as the caller asks for it, so :meth:`latest` reads the newest checkpoint's
        directory and not every retained one's (``keep_every`` may keep hundreds). Others are
        listed once, in full.
        """
        if self.backend.remote:
            by_it = self._scan()
            for iteration in sorted(by_it, reverse=True):
                yield iteration, by_it[iteration]
            return
        found = ((int(m.group(1)), name) for name in self.backend.list_dirs() if (m := _IT_RE.match(name)))
        for iteration, name in sorted(found, reverse=True):
            sizes = self._scan(self.backend.list(f"{name}/")).get(iteration)
            if sizes:  # None: removed by retention since the first listing
                yield iteration, sizes

    def newer_than(self, iteration: int) -> list[CheckpointRef]:
        """Committed checkpoints after ``iteration``, oldest first, of any spec hash (as
        :meth:`list`, reading only their manifests)."""
        by_it = self._scan()
        refs = []
        for it in sorted(i for i in by_it if i > iteration):
            m = self._read_manifest(it, by_it[it], quiet=True)
            if m is not None:
                refs.append(self._ref(m))
        return refs

    def list(self) -> list[CheckpointRef]:
        """Committed checkpoints, oldest first: the manifest parses and every listed file is
        present with its recorded size. (Checksums are verified by :meth:`latest` and :meth:`load`.)
        """
        by_it = self._scan()
        refs = []
        for iteration in sorted(by_it):
            m = self._read_manifest(iteration, by_it[iteration], quiet=True)
            if m is not None:
                refs.append(self._ref(m))
        return refs

    def _read_manifest(self, iteration: int, sizes: dict[str, int], *, quiet: bool) -> Manifest | None:
        if MANIFEST_NAME not in sizes:
            return None  # an interrupted or in-flight save: invisible
        where = f"{self.uri}/{iteration_dir(iteration)}/{MANIFEST_NAME}"
        try:
            data = self.backend.get(f"{iteration_dir(iteration)}/{MANIFEST_NAME}")
            if data is None:
                return None  # deleted by retention since the listing
            m = parse_manifest(data, where=where)
            if m.iteration != iteration:
                raise CheckpointCorruptError(f"manifest {where} says iteration {m.iteration}")
            for f in m.files:
                if sizes.get(f.name) != f.size:
                    raise CheckpointCorruptError(
                        f"checkpoint {where}: file {f.name} is missing or has size "
                        f"{sizes.get(f.name)} instead of {f.size}"
                    )
            return m
        except CheckpointCorruptError as exc:
            if not quiet:
                log.warning("skipping damaged checkpoint at iteration %d: %s", iteration, exc)
                self.metrics.incr("checkpoint.passed_over", tags={"why": "damaged"})
            return None

    def latest(
        self,
        spec_hash: str | None = None,
        *,
        into: str | os.PathLike[str] | None = None,
        decode: bool = True,
    ) -> CheckpointRef | None:
        """The newest checkpoint whose manifest and checksums verify (and whose spec hash is
        ``spec_hash`` when given), or ``None``. Damaged or foreign checkpoints are skipped with
        a warning naming the checkpoint and the reason.

        By default the state is decoded and kept for the ``load(ref)`` that follows. With
        ``decode=False`` the files are only hashed (for callers that want to know which
        checkpoint, not its state). With ``into`` (a local path) the state is not decoded either:
        its file is put there as :meth:`export` puts it (from a local store the committed file
        itself, checked against the manifest on the way) for the safe loader; a checkpoint
        whose content the safe loader refuses raises here what :meth:`load` would raise.

        A checkpoint removed while it is read (retention after another writer's newer commit)
        is not damage: the store is listed again (up to three times), so the newer checkpoint
        is found rather than an older one, or none.
        """
        ref = None
        for _ in range(3):
            ref, moved_on = self._latest_once(spec_hash, into=into, decode=decode)
            if not moved_on:
                return ref
            log.info("a checkpoint of %s was removed while read (a newer one was committed); listing again",
                     self.uri)
        return ref

    def _latest_once(
        self, spec_hash: str | None, *, into: str | os.PathLike[str] | None, decode: bool
    ) -> tuple[CheckpointRef | None, bool]:
        """(the checkpoint :meth:`latest` returns, or None; whether one vanished while read)."""
        moved_on = False
        for iteration, sizes in self._newest_first():
            prefetch = self._prefetch(iteration, sizes)
            m = self._read_manifest(iteration, sizes, quiet=False)
            if m is None:
                moved_on = moved_on or (MANIFEST_NAME in sizes and not self._has_manifest(iteration))
                continue
            ref = self._ref(m)
            if spec_hash is not None and m.spec_hash != spec_hash:
                log.warning(
                    "skipping checkpoint %s: spec hash %s differs from this job's %s "
                    "(written by a different job definition)",
                    ref.uri,
                    m.spec_hash,
                    spec_hash,
                )
                continue
            try:
                if into is not None:
                    self._place_verified(ref, into, prefetch)
                elif not decode:
                    self._hash_verified(ref, prefetch)
                else:
                    loaded = self._read_verified(ref, prefetch)
            except CheckpointCorruptError as exc:
                if not self._has_manifest(iteration):
                    moved_on = True  # removed by retention while read: not damage
                    continue
                log.warning("skipping damaged checkpoint %s, using an older one: %s", ref.uri, exc)
                self.metrics.incr("checkpoint.passed_over", tags={"why": "damaged"})
                continue
            try:
                if into is not None:
                    _check_loadable(ref, into)
                elif decode and isinstance(loaded, CheckpointCorruptError):
                    raise loaded
            except CheckpointCorruptError as exc:
                # its checksums verify, so it was written as it is: crafted, or by a writer this
                # loader cannot trust. It must not stop the job resuming from an older one.
                self.refused.append(ref)
                log.error("refusing checkpoint %s (its checksums verify, but %s); using an older one",
                          ref.uri, exc)
                self.metrics.incr("checkpoint.passed_over", tags={"why": "refused"})
                continue
            if into is not None or not decode:
                return ref, moved_on
            with self._lock:
                self._loaded = (ref, loaded)  # load(ref) right after latest() reads nothing again
            return ref, moved_on
        return None, moved_on

    def _prefetch(self, iteration: int, sizes: dict[str, int]) -> dict[str, Future[bytes | None]]:
        """Start reading the data of ``iteration`` while its manifest is read (saves a round trip).

        Only from a remote backend, and only when the iteration holds exactly one data directory
        (the usual case): with leftovers of a lost race, the manifest says which files count.
        """
        data = [k for k in sizes if k != MANIFEST_NAME]
        one_dir = len({k.split("/", 1)[0] for k in data}) == 1
        if not self.backend.remote or MANIFEST_NAME not in sizes or not one_dir:
            return {}
        it_dir = iteration_dir(iteration)
        return {k: _pool().submit(self.backend.get, f"{it_dir}/{k}", size_hint=sizes[k]) for k in data}

    def _read_verified(
        self, ref: CheckpointRef, prefetched: dict[str, Future[bytes | None]] | None = None
    ) -> Any:
        """Read ref's files, verify sizes and checksums, then decode the state.

        Returns the state, or the :class:`CheckpointCorruptError` decoding raised (for load() to
        raise). Raises :class:`CheckpointCorruptError` when a file is missing or fails its
        checksum (a remote read that fails verification is read once more first). Every byte is
        verified before any is handed to the decoder, and the decoder sees exactly the verified
        bytes (a local state file: the records read in the verified pass, see archive.py).
        """
        payload: dict[str, bytes | memoryview | Archive] = {}
        prefetched = prefetched or {}
        for f in ref.files:
            data, got = self._read_file(ref, f, prefetched.get(f.name))
            _verify(ref, f, None if data is None else len(data), got)
            payload[f.name] = data  # type: ignore[assignment]  # not None: verified
        states = [f.name for f in ref.files if _is_state(f.name)]
        try:
            if len(states) != 1:
                raise CheckpointCorruptError(f"{ref.uri} has no single {STATE_NAME}")
            state, name = payload[states[0]], f"{ref.uri}/{states[0]}"
            if isinstance(state, Archive):
                return decode_archive(state, name=name)
            return decode_state(state, name=name)
        except CheckpointCorruptError as exc:
            return exc

    def _read_file(
        self, ref: CheckpointRef, f: FileEntry, pending: Future[bytes | None] | None, *, whole: bool = False
    ) -> tuple[bytes | memoryview | Archive | None, str]:
        """One file of ``ref`` (``None`` when missing) and its digest under ``f.algorithm``;
        a local state file as an :class:`Archive` unless ``whole``."""
        key = f"{iteration_dir(ref.iteration)}/{f.name}"
        if pending is None:
            if _is_state(f.name) and not whole:
                archive, got = self._read_archive(key, f.algorithm)
                if archive is not None:
                    return archive, got
            if not self.backend.remote:
                hasher = f.algorithm.hasher()
                return self.backend.read_hashing(key, hasher), hasher.hexdigest()
        data = pending.result() if pending else self.backend.get(key, size_hint=f.size)
        got = f.algorithm.hexdigest(data) if data is not None else ""
        if data is not None and (len(data) != f.size or got != f.digest):
            # damaged at rest, or on the way (the store's own S3 client leaves checking
            # downloads to this digest): a second read tells the two apart
            log.warning("%s/%s failed verification once; reading it again", ref.uri, f.name)
            data = self.backend.get(key, size_hint=f.size)
            got = f.algorithm.hexdigest(data) if data is not None else ""
        return data, got

    def _read_archive(self, key: str, algorithm: Checksum) -> tuple[Archive | None, str]:
        """The state file at ``key`` read record by record (archive.py), with its digest; (None,
        "") where the backend cannot, this PyTorch does not decode such reads, or the file is
        not laid out as expected (the caller then reads it whole)."""
        if self.backend.remote or not archive_decoding_works():
            return None, ""
        read = self.backend.read_stream(key, lambda f, size: read_archive(f, size, algorithm))
        return read if read is not None else (None, "")

    def load(self, ref: CheckpointRef) -> Any:
        """The state saved in ``ref``, after verifying every checksum. Never executes code.

        Raises :class:`CheckpointCorruptError` (damage) or :class:`UnsafeCheckpointError`
        (content the safe loader refuses); :class:`CheckpointNotFoundError` for ``None`` (what
        :meth:`latest` returns for a store with no committed checkpoint).
        """
        if not isinstance(ref, CheckpointRef):
            raise CheckpointNotFoundError(
                f"load() needs a CheckpointRef (from latest() or list()), not {short_repr(ref, 80)}"
                + (f": no committed checkpoint under {self.uri}" if ref is None else "")
            )
        with self._lock:
            cached, self._loaded = self._loaded, None
        result = cached[1] if cached is not None and cached[0] == ref else self._read_verified(ref)
        if isinstance(result, CheckpointCorruptError):
            raise result
        return result

    def export(self, ref: CheckpointRef, path: str | os.PathLike[str]) -> None:
        """Write the state of ``ref`` to the local file ``path`` for the safe loader
        (``torch.load(path, weights_only=True)``): the committed file itself, verified.

        From a local store a hard link on one file system, else a copy; from S3 the downloaded
        bytes. Nothing is decoded or encoded again; the file is only checked to be one the safe
        loader accepts (its pickle, not its tensor data: ~2 ms). The state :meth:`latest` kept
        for ``load(ref)`` is dropped. Raises :class:`CheckpointCorruptError` when the file is
        missing or fails verification, and what :meth:`load` would raise when the safe loader
        refuses it (``path`` is not left behind in either case).
        """
        with self._lock:
            self._loaded = None
        self._place_verified(ref, path)
        _check_loadable(ref, path)

    def _hash_verified(self, ref: CheckpointRef, prefetched: dict[str, Future[bytes | None]]) -> None:
        """Verify every file of ``ref`` by its size and digest, keeping nothing; raises
        :class:`CheckpointCorruptError` on a missing or damaged file."""
        for f in ref.files:
            if not self.backend.remote and f.name not in prefetched:
                hasher = f.algorithm.hasher()
                key = f"{iteration_dir(ref.iteration)}/{f.name}"
                size = self.backend.read_stream(key, hash_stream(hasher))
                _verify(ref, f, size, hasher.hexdigest())
            else:
                data, got = self._read_file(ref, f, prefetched.get(f.name), whole=True)
                _verify(ref, f, None if data is None else len(data), got)

    def _place_verified(
        self,
        ref: CheckpointRef,
        path: str | os.PathLike[str],
        prefetched: dict[str, Future[bytes | None]] | None = None,
    ) -> None:
        """Put ref's state file at ``path`` and verify every file of ``ref``; raises
        :class:`CheckpointCorruptError` (and leaves no ``path``) on a missing or damaged file."""
        prefetched = prefetched or {}
        states = [f for f in ref.files if _is_state(f.name)]
        if len(states) != 1:
            raise CheckpointCorruptError(f"{ref.uri} has no single {STATE_NAME}")
        for f in ref.files:
            if f is states[0] and not self.backend.remote and f.name not in prefetched:
                hasher = f.algorithm.hasher()
                size = self.backend.place(f"{iteration_dir(ref.iteration)}/{f.name}", path, hasher)
                _verify_or_remove(ref, f, size, hasher.hexdigest(), path)
                continue
            data, got = self._read_file(ref, f, prefetched.get(f.name), whole=True)
            _verify(ref, f, None if data is None else len(data), got)
            if f is states[0]:
                write_file(path, data)  # type: ignore[arg-type]  # verified: not None

    # --- retention -------------------------------------------------------------------------

    def _has_manifest(self, iteration: int) -> bool:
        return self.backend.get(f"{iteration_dir(iteration)}/{MANIFEST_NAME}") is not None

    def _sweep_temp(self, floor: int, keep: set[int]) -> None:
        """Local stores: temporary files of killed writers in the iterations below ``floor`` that
        are not kept (listings hide them, so a directory holding only those is never listed)."""
        if self.backend.remote:
            return
        below = [
            n for n in self.backend.list_dirs()
            if (m := _IT_RE.match(n)) and int(m.group(1)) < floor and int(m.group(1)) not in keep
        ]
        if below and self.backend.sweep_temp(below):
            log.info("retention: removed temporary files of interrupted saves below iteration %d", floor)

    def _retain(self, *, committed: int, objects: list[ObjectInfo] | None) -> None:
        """Delete checkpoints outside the keep set, and orphaned data, older than ``committed``.

        ``objects``: the store as listed during the commit, or ``None`` to list it here (on the
        background thread, off the caller's path).

        Only iterations below the one just committed are candidates, so that checkpoint (whose
        bytes were just verified as written) and anything newer survive; the latest verified
        checkpoint is therefore never deleted. A manifest is deleted before its data, so an
        interrupted cleanup leaves an invisible orphan, never a checkpoint with missing files.

        Data without a manifest may be a save still in flight (``save_async`` followed by
        ``save``, or another writer) whose manifest the listing predates: it is removed only
        below the last ``keep_last`` committed checkpoints, only once its newest file is
        ``ORPHAN_AGE_S`` older than the newest object listed (the backend's own clock: a writer
        commits its manifest seconds after its data, so checking for the manifest and then
        deleting could otherwise remove the data of a save committing in between), and only if
        it still has no manifest when removed. Temporary files a killed local writer left there
        go too.
        """
        try:
            objects = self.backend.list("it-") if objects is None else objects
            by_it = self._scan(objects)
            settled = _settled(objects)
            committed_its = sorted({i for i, keys in by_it.items() if MANIFEST_NAME in keys} | {committed})
            recent = set(committed_its[-self.keep_last :]) | {committed}
            keep = set(recent)
            if self.keep_every:
                keep |= {i for i in committed_its if i % self.keep_every == 0}
            floor = min(recent)
            doomed = [
                i for i in sorted(by_it) if i < committed and i not in keep
                and (MANIFEST_NAME in by_it[i] or (i < floor and i in settled and not self._has_manifest(i)))
            ]
            self._sweep_temp(floor, keep)
            if not doomed:
                return
            manifests = [f"{iteration_dir(i)}/{MANIFEST_NAME}" for i in doomed if MANIFEST_NAME in by_it[i]]
            self.backend.delete(manifests)  # first: each checkpoint disappears at once
            self.backend.delete(
                [f"{iteration_dir(i)}/{k}" for i in doomed for k in by_it[i] if k != MANIFEST_NAME]
            )
            log.info("retention: removed iterations %s from %s", doomed, self.uri)
        except CheckpointError as exc:  # the commit itself succeeded; cleanup is retried next time
            log.warning("retention after committing iteration %d failed: %s", committed, exc)


def _settled(objects: list[ObjectInfo]) -> set[int]:
    """Iterations all of whose objects are ``ORPHAN_AGE_S`` older than the newest object listed
    (times from one clock, the backend's). Objects of unknown age are never settled."""
    times = [o.mtime for o in objects if o.mtime is not None]
    if not times:
        return set()
    cutoff = max(times) - ORPHAN_AGE_S
    young: set[int] = set()
    seen: set[int] = set()
    for obj in objects:
        m = _IT_RE.match(obj.key.partition("/")[0])
        if not m:
            continue
        it = int(m.group(1))
        seen.add(it)
        if obj.mtime is None or obj.mtime > cutoff:
            young.add(it)
    return seen - young
