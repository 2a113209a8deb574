"""``file://`` backend: a directory tree, written crash-safely.

Writes go to a hidden temporary file in the target directory, are fsync'd, then published with
``os.replace`` (overwrite) or ``os.link`` (create-if-absent: the kernel refuses a second link
with ``EEXIST``, so of two processes racing for one key exactly one wins, also on NFS). The
directory is fsync'd after publishing so the new name survives a power cut.

While a file is written, the kernel is asked every few MiB to start writing what it has to disk
(Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, as databases do): the disk works while the
state is still being encoded, and the fsync at the end, which is what makes the file durable,
has only the tail left to wait for.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import stat
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from elastic_ops.checkpoint.backend import Backend, ObjectInfo
from elastic_ops.checkpoint.checksum import Hasher, hash_stream
from elastic_ops.errors import StoragePermanentError, StorageTransientError

_TMP_PREFIX = ".tmp-"
log = logging.getLogger("elastic_ops.checkpoint")
_LOCK_NAME = ".commit-lock"  # at the root: serialises delete_if (never listed: not an it-… key)
_PIECE = 1 << 20  # bytes per write() of a buffer we hold: one huge write is slower than pieces
_WRITEBACK_EVERY = 4 << 20
_WRITEBACK_ALIGN = (64 << 10) - 1
_READ_CHUNK = 1 << 20  # hashed right after it is read, while it is still in the CPU cache
T = TypeVar("T")


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait


class _EarlyWriteback:
    """A write-only file that asks the kernel to start writeback every ``_WRITEBACK_EVERY`` bytes.

    Only a hint: durability still comes from the fsync after the last write; where the call is
    missing or fails (another OS, a file system without it), nothing changes but the timing.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._written = 0
        self._started = 0

    def write(self, data: bytes | memoryview) -> int:
        n = self._f.write(data)
        self._written += n
        # Only whole 64 KiB blocks behind the write position: a range ending inside the page
        # the next write() fills puts that page under writeback while it is still being written
        # (measured: 240 MB saves then took up to 2.5x longer, and 20 % longer at the median).
        end = self._written & ~_WRITEBACK_ALIGN
        if _SYNC_FILE_RANGE is not None and end - self._started >= _WRITEBACK_EVERY:
            self._f.flush()
            _SYNC_FILE_RANGE(self._f.fileno(), self._started, end - self._started, _SYNC_FILE_RANGE_WRITE)
            self._started = end
        return n

    def write_all(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), _PIECE):
            self.write(view[start : start + _PIECE])


class LocalBackend(Backend):
    remote = False

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root)
        if not self.root.is_absolute():
            raise StoragePermanentError(
                f"checkpoint directory {str(root)!r} is not absolute", hint="use file:///absolute/path"
            )
        self.uri = f"file://{self.root}"
        if not create:
            return  # read only: a missing directory holds no checkpoint
        try:
            with _os_errors(self.uri):
                self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # exist_ok covers directories only
            raise StoragePermanentError(
                f"checkpoint directory {self.uri} is a file", hint="give a directory's path (or a new one)"
            ) from None

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid key {key!r}")
        return self.root.joinpath(*parts)

    def _check_dirs(self, path: Path) -> None:
        """Refuse to write at ``path`` when a directory on its way from the root (``it-…``,
        ``d-…``, ``_fence``) is a symbolic link (or no directory): a link planted there is no
        directory of the store's (listings skip it), and writing through it put a commit outside
        the store, invisible to ``latest()``, or, for a link to another iteration's directory,
        replaced that checkpoint's manifest and data with this one's."""
        where = self.root
        for part in path.parent.relative_to(self.root).parts:
            where = where / part
            try:
                mode = os.lstat(where).st_mode
            except FileNotFoundError:
                return  # the rest is created by _make_dirs
            if not stat.S_ISDIR(mode):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
                raise StoragePermanentError(
                    f"cannot write {self.uri}/{path.relative_to(self.root)}: "
                    f"{self.uri}/{where.relative_to(self.root)} is {kind}",
                    hint="the store follows no links: remove what was put there, or point the "
                    "store at the real directory",
                )

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        self._check_dirs(path)
        _make_dirs(path.parent)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            _EarlyWriteback(f).write_all(data)
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
        """Atomically publish what ``write(file)`` writes at ``key``; returns its result.

        ``file`` is write-only: ``write`` calls ``file.write(...)`` and nothing else.
        """

        def fill(tmp: Path) -> T:
            with open(tmp, "wb") as f:
                return write(_EarlyWriteback(f))  # type: ignore[arg-type]  # write-only file

        path = self._path(key)
        self._check_dirs(path)
        with _os_errors(self.uri, key):
            return _publish(path, fill)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with _os_errors(self.uri, key):
            tmp = self._write_tmp(path, data)
            try:
                for _ in range(2):
                    try:
                        os.link(tmp, path)
                        break
                    except FileExistsError:
                        if not self._clear_non_object(key, path):
                            return False  # a stored object is there: the conditional write lost
                else:
                    return False
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(path.parent)
            return True

    def _clear_non_object(self, key: str, path: Path) -> bool:
        """Remove what stands at ``path`` if it is no stored object (a symbolic link, a FIFO, a
        device, a folder: what ``get`` reads as missing), so a create there can succeed rather
        than fail for good; a folder is moved aside (``<name>.not-an-object-<id>``), not deleted.
        False when a regular file (a stored object) is there. Under the store's lock, as
        ``delete_if``: two writers clearing one key do not remove each other's object."""
        with open(self.root / _LOCK_NAME, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return True
            if stat.S_ISREG(mode):
                return False
            if stat.S_ISDIR(mode):
                os.rename(path, path.with_name(f"{path.name}.not-an-object-{uuid.uuid4().hex[:8]}"))
            else:
                os.unlink(path)
        log.warning("%s/%s was no stored object (%s): removed, so it can be written",
                    self.uri, key, _kind(mode))
        return True

    def get(self, key: str, *, size_hint: int | None = None) -> bytes | None:
        return self.read_stream(key, lambda f, size: f.read())

    def read_stream(self, key: str, read: Callable[[BinaryIO, int], T]) -> T | None:
        """``read(file, size)`` on the file at ``key`` (``None`` when it is missing).

        ``file`` is open for reading (binary, unbuffered); OS errors are reported like those of
        every other call.
        """
        with _os_errors(self.uri, key):
            f = _open_regular(self._path(key))
            if f is None:
                return None
            with f:
                return read(f, os.fstat(f.fileno()).st_size)

    def adopt(self, key: str, src: str | os.PathLike[str], hasher: Hasher) -> int:
        """Publish the local file ``src`` at ``key``, durably, feeding every byte to ``hasher``;
        its size. The reverse of :meth:`place`: a hard link when both lie on one file system
        (``src`` must not be changed in place afterwards; renaming or deleting it is fine), else
        a copy; either way fsync'd, then renamed into place and the directory fsync'd.
        """
        path = self._path(key)
        self._check_dirs(path)
        with _os_errors(self.uri, key):
            return _publish(path, lambda tmp: _link_or_copy(Path(src), tmp, hasher))

    def place(self, key: str, dest: str | os.PathLike[str], hasher: Hasher) -> int | None:
        """Put the file at ``key`` at the path ``dest``, feeding every byte ``dest`` holds to
        ``hasher``; its size, or ``None`` when ``key`` is missing (``dest`` is then not created).

        A hard link when both lie on one file system (stored files are never changed in place,
        so the link holds exactly the committed bytes; they are read once to hash them), else a
        copy. ``dest`` appears atomically; on any error it is not left behind.
        """
        src, dest = self._path(key), Path(dest)
        tmp = dest.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        with _os_errors(self.uri, key):
            try:  # only a regular file of its own is a stored object (see _open_regular)
                if not stat.S_ISREG(os.lstat(src).st_mode):
                    return None
            except (FileNotFoundError, NotADirectoryError):
                return None
            try:
                size = _link_or_copy(src, tmp, hasher)
                os.replace(tmp, dest)
            except BaseException as exc:
                tmp.unlink(missing_ok=True)
                if isinstance(exc, FileNotFoundError) and not src.exists():
                    return None
                raise
            return size

    def read_hashing(self, key: str, hasher: Hasher) -> memoryview | None:
        """The bytes at ``key`` (``None`` when missing), each chunk fed to ``hasher`` as it is read.

        One pass: a chunk is hashed while it is still in the CPU cache, instead of reading the
        whole file and then hashing it from memory again. The buffer is allocated uninitialised
        (NumPy) since every byte of it is overwritten.
        """

        def read(f: BinaryIO, size: int) -> memoryview:
            view = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
            pos = 0
            while pos < size:
                n = f.readinto(view[pos : pos + _READ_CHUNK])  # type: ignore[attr-defined]
                if not n:  # truncated since fstat: the caller's size check fails
                    break
                hasher.update(view[pos : pos + n])
                pos += n
            return view[:pos]

        return self.read_stream(key, read)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        below = prefix.rsplit("/", 1)[0] if "/" in prefix else ""  # walk only below it
        parts = below.split("/") if below else []
        # a walk from a linked directory (``_fence`` -> elsewhere) would follow the link
        if any(os.path.islink(self.root.joinpath(*parts[: i + 1])) for i in range(len(parts))):
            return out
        with _os_errors(self.uri, prefix):
            self._walk(
                str(self.root.joinpath(*below.split("/"))) if below else str(self.root), below, prefix, out
            )
        return out

    def list_dirs(self) -> list[str]:
        """The names of the directories at the root: one ``scandir``, so the store can list one
        checkpoint at a time."""
        with _os_errors(self.uri):
            try:
                with os.scandir(self.root) as entries:
                    return [
                        e.name
                        for e in entries
                        if not e.name.startswith(_TMP_PREFIX) and e.is_dir() and not e.is_symlink()
                    ]
            except (FileNotFoundError, NotADirectoryError):
                return []

    def _walk(self, path: str, rel: str, prefix: str, out: list[ObjectInfo]) -> None:
        """Append the files under ``path`` (key ``rel``) whose keys start with ``prefix``; only
        directories that can hold such keys are entered (``it-…`` leaves ``_fence`` alone)."""
        try:
            entries = os.scandir(path)
        except (FileNotFoundError, NotADirectoryError):  # deleted while we walked, or no root
            return
        with entries:
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):
                    continue
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir():
                    inside = key + "/"
                    if not entry.is_symlink() and (inside.startswith(prefix) or prefix.startswith(inside)):
                        self._walk(entry.path, key, prefix, out)
                elif key.startswith(prefix) and entry.is_file(follow_symlinks=False):
                    try:  # a planted link or FIFO is no object: reading it could hang or read /dev/zero
                        st = entry.stat()
                        out.append(ObjectInfo(key, st.st_size, st.st_mtime))
                    except FileNotFoundError:  # deleted while we walked
                        continue

    def sweep_temp(self, dirs: list[str], *, older_than_s: float = 600.0) -> int:
        """Remove the hidden temporary files a killed writer left under ``dirs`` (top-level
        directory names; listings never show temporary files, so retention cannot see them),
        when older than ``older_than_s``, and directories left empty. Returns how many went."""
        removed, cutoff, parents = 0, time.time() - older_than_s, set()
        with _os_errors(self.uri):
            for name in dirs:
                for tmp in self._path(name).rglob(f"{_TMP_PREFIX}*"):
                    try:
                        if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                            tmp.unlink()
                            removed += 1
                            parents.add(tmp.parent)
                    except FileNotFoundError:
                        continue
            self._prune(parents)
        return removed

    def delete(self, keys: list[str]) -> None:
        parents = set()
        with _os_errors(self.uri):
            for key in keys:
                path = self._path(key)
                path.unlink(missing_ok=True)
                parents.add(path.parent)
            self._prune(parents)

    def delete_if(self, key: str, data: bytes) -> bool:
        # Creates need the key absent (os.link), so only another delete_if could swap the bytes
        # between the read and the unlink: an exclusive lock on the store makes the pair atomic.
        path = self._path(key)
        with _os_errors(self.uri, key):
            with open(self.root / _LOCK_NAME, "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    current = path.read_bytes()
                except FileNotFoundError:
                    return True
                if current != data:
                    return False
                path.unlink()
            _fsync_dir(path.parent)
            return True

    def _prune(self, parents: set[Path]) -> None:
        """Remove directories left empty, deepest first, never the root."""
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent


def _publish(path: Path, fill: Callable[[Path], T]) -> T:
    """Create ``path`` atomically and durably: ``fill(tmp)`` creates a temporary file beside it
    (its result is returned), which is fsync'd, renamed into place, and the directory fsync'd.
    On any error the temporary file is removed and nothing appears at ``path``."""
    _make_dirs(path.parent)
    tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    try:
        result = fill(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return result


def _kind(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a folder" if stat.S_ISDIR(mode) else "a device or socket")


def _open_regular(path: Path) -> BinaryIO | None:
    """``path`` open for reading (binary, unbuffered), or ``None`` when it is missing or not a
    regular file of its own: a symbolic link (to /dev/zero, to a file outside the store) or a
    FIFO someone planted in the store is no stored object. O_NONBLOCK: opening a FIFO must not
    wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return open(fd, "rb", buffering=0)  # noqa: SIM115 (the caller closes it)


def _link_or_copy(src: Path, dest: Path, hasher: Hasher) -> int:
    """Create ``dest`` as a hard link to ``src`` (on another file system, or one without hard
    links: a copy), feeding every byte ``dest`` holds to ``hasher``; their count. Raises
    ``FileNotFoundError`` when ``src`` is missing."""
    try:
        os.link(src, dest)
    except FileNotFoundError:
        raise
    except OSError:
        return _copy_hashing(src, dest, hasher)
    return _hash_file(dest, hasher)


def _hash_file(path: Path, hasher: Hasher) -> int:
    """Feed the bytes of ``path`` to ``hasher``; their count."""
    with open(path, "rb", buffering=0) as f:
        return hash_stream(hasher, _READ_CHUNK)(f)


def _copy_hashing(src: Path, dest: Path, hasher: Hasher) -> int:
    """Copy ``src`` to a new file ``dest``, feeding every byte to ``hasher``; their count."""
    buf = memoryview(bytearray(_READ_CHUNK))
    size = 0
    with open(src, "rb", buffering=0) as fin, open(dest, "xb") as fout:  # buffered: writes all
        while n := fin.readinto(buf):
            hasher.update(buf[:n])
            fout.write(buf[:n])
            size += n
    return size


def _make_dirs(path: Path, attempts: int = 100) -> None:
    """``mkdir -p path``, durably: the parent of each directory created is fsync'd, so a new
    ``it-…/d-…`` survives a power cut together with the files published in it (their own
    directory is fsync'd after publishing). Another writer's clean-up removes directories it
    left empty (``_prune``): one that vanishes between the check and the ``mkdir`` inside it is
    made again, rather than failing a live save with "No such file or directory"."""
    for attempt in range(attempts):
        try:
            _make_dirs_once(path)
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


def _make_dirs_once(path: Path) -> None:
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # another writer made it meanwhile: it fsyncs the parent itself
            continue
        _fsync_dir(d.parent)


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
                f"permission denied on {self.where} ({exc.strerror})",
                hint="make the checkpoint directory readable and writable by the user running the job",
            ) from None
        if exc.errno == errno.ENOSPC:
            raise StoragePermanentError(
                f"disk full writing {self.where}", hint="free space or lower keep_last"
            ) from None
        if exc.errno in (errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN):
            raise StorageTransientError(f"I/O error on {self.where}: {exc.strerror}") from None
        raise StoragePermanentError(f"cannot access {self.where}: {exc.strerror or exc}") from None
