"""The small object-store interface the checkpoint store is built on.

Keys are relative, ``/``-separated paths under the store's root (``it-00000040/manifest.json``).
Every backend guarantees: ``put`` replaces atomically (a reader sees the old or the new bytes,
never a mix); ``put_if_absent`` creates atomically and at most once across all processes and
hosts (the commit primitive); ``get`` returns ``None`` for a missing key.
"""

from __future__ import annotations

import abc
import dataclasses
import io
import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from elastic_ops.checkpoint.checksum import Hasher

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    #: when the object was written, by the backend's clock (S3: LastModified, a multipart upload's
    #: start; local: mtime); None where a backend cannot tell
    mtime: float | None = None


def write_file(dest: str | os.PathLike[str], data: bytes | memoryview) -> None:
    """Write ``data`` at the local path ``dest`` atomically: all of it or, on any error, nothing."""
    tmp = Path(dest).with_name(f".{Path(dest).name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class Backend(abc.ABC):
    """An object store under one root. Subclasses implement the six required operations; the
    optional ones have generic implementations here, built on those, which a backend overrides
    where it can do better (:class:`~elastic_ops.checkpoint.local.LocalBackend` streams files,
    links them and scans directories). The store picks its strategy by :attr:`remote` alone."""

    #: human-readable location of the root, used in messages (``file:///…``, ``s3://…``)
    uri: str
    #: requests pay a network round trip, so overlapping them pays off (a local disk's do not:
    #: there, handing a read to another thread costs more than it overlaps, and the store uses
    #: the file operations below instead of whole-object reads and writes)
    remote: bool = True
    #: ``put`` of fewer bytes is one request (S3: the multipart threshold); the store then lists
    #: alongside such an upload instead of after it. None: no such limit is known
    single_put_limit: int | None = None

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing it atomically."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists. True if this call created it."""

    @abc.abstractmethod
    def get(self, key: str, *, size_hint: int | None = None) -> bytes | None:
        """The bytes at ``key``, or ``None`` when there is no such key.

        ``size_hint`` (the expected size, when known) lets a backend pick a parallel download.
        """

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (any order)."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete ``keys``; missing keys are ignored."""

    @abc.abstractmethod
    def delete_if(self, key: str, data: bytes) -> bool:
        """Delete ``key`` only if it still holds exactly ``data``, atomically with respect to
        other writers (a damaged manifest that another writer replaced meanwhile must not take
        that writer's commit with it). False if ``key`` holds something else now; True if it
        was deleted or is gone."""

    # --- optional: generic here, faster where a backend overrides them ------------------------

    def put_stream(self, key: str, write: Callable[[BinaryIO], T]) -> T:
        """Publish atomically at ``key`` what ``write(file)`` writes; its return value."""
        buf = io.BytesIO()
        out = write(buf)
        self.put(key, buf.getvalue())
        return out

    def read_stream(self, key: str, read: Callable[[BinaryIO, int], T]) -> T | None:
        """``read(file, size)`` on the object at ``key``, an open file with a descriptor (the
        state file's records are read with ``pread``); None: no such key."""
        data = self.get(key)
        if data is None:
            return None
        with tempfile.TemporaryFile() as f:
            f.write(data)
            f.flush()
            f.seek(0)
            return read(f, len(data))

    def read_hashing(self, key: str, hasher: Hasher) -> memoryview | None:
        """The bytes at ``key``, each chunk fed to ``hasher`` (None: no such key)."""
        data = self.get(key)
        if data is None:
            return None
        hasher.update(data)
        return memoryview(data)

    def place(self, key: str, dest: str | os.PathLike[str], hasher: Hasher) -> int | None:
        """Put the object at the local path ``dest`` (atomically), hashing it; its size (None:
        no such key)."""
        data = self.read_hashing(key, hasher)
        if data is None:
            return None
        write_file(dest, data)
        return len(data)

    def adopt(self, key: str, src: str | os.PathLike[str], hasher: Hasher) -> int:
        """Publish the local file ``src`` at ``key`` durably, hashing it; its size."""
        data = Path(src).read_bytes()
        hasher.update(data)
        self.put(key, data)
        return len(data)

    def list_dirs(self) -> list[str]:
        """The names of the directories at the root."""
        return sorted({o.key.split("/", 1)[0] for o in self.list() if "/" in o.key})

    def sweep_temp(self, dirs: list[str], *, older_than_s: float = 600.0) -> int:
        """Remove temporary files that killed writers left in ``dirs``; how many. Object stores
        publish atomically and leave none."""
        return 0
