"""``file://`` backend: a directory tree, written crash-safely.

Writes go to a hidden temporary file in the target directory, are fsync'd, then published with
``os.replace`` (overwrite) or ``os.link`` (create-if-absent: the kernel refuses a second link
with ``EEXIST``, so of two processes racing for one key exactly one wins, also on NFS). The
directory is fsync'd after publishing so the new name survives a power cut.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from elastic_ops.checkpoint.backend import ObjectInfo
from elastic_ops.errors import StoragePermanentError, StorageTransientError

_TMP_PREFIX = ".tmp-"
T = TypeVar("T")


class LocalBackend:
    remote = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if not self.root.is_absolute():
            raise StoragePermanentError(
                f"checkpoint directory {str(root)!r} is not absolute", hint="use file:///absolute/path"
            )
        self.uri = f"file://{self.root}"
        with _os_errors(self.uri):
            self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid key {key!r}")
        return self.root.joinpath(*parts)

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with _os_errors(self.uri, key):
            tmp = self._write_tmp(path, data)
            os.replace(tmp, path)
            _fsync_dir(path.parent)

    def put_stream(self, key: str, write: Callable[[BinaryIO], T]) -> T:
        """Atomically publish what ``write(file)`` writes at ``key``; returns its result."""
        path = self._path(key)
        with _os_errors(self.uri, key):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    result = write(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(path.parent)
            return result

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with _os_errors(self.uri, key):
            tmp = self._write_tmp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(path.parent)
            return True

    def get(self, key: str, *, size_hint: int | None = None) -> bytes | None:
        with _os_errors(self.uri, key):
            try:
                return self._path(key).read_bytes()
            except FileNotFoundError:
                return None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        base = self.root.joinpath(*prefix.split("/")[:-1])  # walk only below the prefix's directory
        if not base.is_dir():
            return out
        with _os_errors(self.uri, prefix):
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if not d.startswith(_TMP_PREFIX)]
                rel = os.path.relpath(dirpath, self.root)
                for name in filenames:
                    if name.startswith(_TMP_PREFIX):
                        continue
                    key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                    if key.startswith(prefix):
                        try:
                            size = os.stat(os.path.join(dirpath, name)).st_size
                        except FileNotFoundError:  # deleted while we walked
                            continue
                        out.append(ObjectInfo(key, size))
        return out

    def delete(self, keys: list[str]) -> None:
        parents = set()
        with _os_errors(self.uri):
            for key in keys:
                path = self._path(key)
                path.unlink(missing_ok=True)
                parents.add(path.parent)
            # remove directories left empty, deepest first, never the root
            for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
                while parent != self.root and self.root in parent.parents:
                    try:
                        parent.rmdir()
                    except OSError:
                        break
                    parent = parent.parent


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _os_errors:
    """Map OS errors to the store's errors: permissions and missing mounts are permanent."""

    def __init__(self, uri: str, key: str = "") -> None:
        self.where = f"{uri}/{key}" if key else uri

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        if exc is None or not isinstance(exc, OSError) or isinstance(exc, FileExistsError):
            return False
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise StoragePermanentError(
                f"no permission to write {self.where} ({exc.strerror})",
                hint="make the checkpoint directory writable by the user running the job",
            ) from None
        if exc.errno == errno.ENOSPC:
            raise StoragePermanentError(
                f"disk full writing {self.where}", hint="free space or lower keep_last"
            ) from None
        if exc.errno in (errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN):
            raise StorageTransientError(f"I/O error on {self.where}: {exc.strerror}") from None
        raise StoragePermanentError(f"cannot access {self.where}: {exc.strerror or exc}") from None
