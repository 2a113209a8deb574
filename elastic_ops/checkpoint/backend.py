"""The small object-store interface the checkpoint store is built on.

Keys are relative, ``/``-separated paths under the store's root (``it-00000040/manifest.json``).
Every backend guarantees: ``put`` replaces atomically (a reader sees the old or the new bytes,
never a mix); ``put_if_absent`` creates atomically and at most once across all processes and
hosts (the commit primitive); ``get`` returns ``None`` for a missing key.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    #: when the object was written, by the backend's clock (S3: LastModified, a multipart upload's
    #: start; local: mtime); None where a backend cannot tell
    mtime: float | None = None


class Backend(Protocol):
    #: human-readable location of the root, used in messages (``file:///…``, ``s3://…``)
    uri: str
    #: requests pay a network round trip, so overlapping them pays off (a local disk's do not:
    #: there, handing a read to another thread costs more than it overlaps)
    remote: bool

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing it atomically."""

    # Optional: ``put_stream(key, write: Callable[[BinaryIO], T]) -> T`` publishes atomically what
    # ``write(file)`` writes (LocalBackend has it: the state is encoded straight into the file).
    # Optional: ``read_hashing(key, hasher) -> memoryview | None`` reads ``key`` feeding each chunk
    # to ``hasher`` as it arrives (LocalBackend has it: one pass instead of read, then hash).
    # Optional: ``read_stream(key, read: Callable[[BinaryIO, int], T]) -> T | None`` calls
    # ``read(file, size)`` on an open file (LocalBackend has it: the state file is read record by
    # record, each tensor straight into its own memory; see archive.py).
    # Optional: ``place(key, dest, hasher) -> int | None`` puts the object at the local path
    # ``dest`` (LocalBackend: a hard link, else a copy), hashing it; ``CheckpointStore.export``.
    # Optional: ``adopt(key, src, hasher) -> int`` publishes the local file ``src`` at ``key``
    # durably (LocalBackend: a hard link, else a copy), hashing it; ``CheckpointStore.save_file``.
    # Optional: ``list_dirs() -> list[str]``: the names of the directories at the root
    # (LocalBackend: one scandir). ``latest()`` then lists one checkpoint at a time,
    # newest first, instead of every retained one (an S3 listing returns up to 1,000 keys per
    # request, so there one listing is cheaper than two).
    # Optional: ``single_put_limit: int``: ``put`` of fewer bytes is one request (S3Backend: the
    # multipart threshold). The store then lists alongside such an upload instead of after it.

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists. True if this call created it."""

    def get(self, key: str, *, size_hint: int | None = None) -> bytes | None:
        """The bytes at ``key``, or ``None`` when there is no such key.

        ``size_hint`` (the expected size, when known) lets a backend pick a parallel download.
        """

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (any order)."""

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys``; missing keys are ignored."""

    def delete_if(self, key: str, data: bytes) -> bool:
        """Delete ``key`` only if it still holds exactly ``data``, atomically with respect to
        other writers (a damaged manifest that another writer replaced meanwhile must not take
        that writer's commit with it). False if ``key`` holds something else now; True if it
        was deleted or is gone."""
