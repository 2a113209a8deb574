"""A ``torch.save`` file read front to back in one pass, each storage straight into its own memory.

A ``torch.save`` file is a zip archive of uncompressed records: ``data.pkl`` (the pickled tree),
a few small metadata records, and one record ``data/<key>`` per tensor storage.
``torch.load(path, weights_only=True)`` copies each storage record from the file into memory of
its own: one copy of every byte. Reading the file into one buffer to verify its checksum and
decoding from that buffer, as the store did, costs a second copy of every byte (a quarter of a
load).

:func:`read_archive` keeps to one copy and still verifies every byte before anything is decoded:
it reads the file once, in order, feeding every byte to the checksum, and reads each storage
record straight into a new tensor of its own (the small records are kept as bytes). Where the
records lie comes from the zip directory at the end of the file, read first; the ordered pass
reads that directory again, and the plan is used only when both reads agree, so it is the
directory of the bytes the checksum verified. Local headers come from the ordered pass itself.

:func:`decode_archive` then unpickles ``data.pkl`` with PyTorch's restricted (``weights_only``)
unpickler through ``torch.serialization._load``, the function ``torch.load`` itself calls, handing
it the storages already read. That function is private, so :func:`archive_decoding_works` checks
once per process, by a round trip, that it still behaves as this module expects; where it does
not (another PyTorch release), the store reads and decodes the whole file as before. Memory ends
up as with ``torch.load``: one allocation per storage, each freed on its own.
"""

from __future__ import annotations

import base64
import functools
import io
import logging
import os
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from elastic_ops.checkpoint.checksum import Checksum, Hasher
from elastic_ops.checkpoint.codec import decode_errors

log = logging.getLogger("elastic_ops.checkpoint")

_TAIL = (64 << 10) + 22  # the end record and a directory of ~1,000 records in the first read
_PIECE = 1 << 20  # hashed right after it is read, while it is still in the CPU cache
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes; the last two: name and extra lengths
_LOCAL_SIGNATURE = 0x04034B50
_STORAGE_PREFIX = "data/"


@dataclass(frozen=True)
class _Record:
    name: str  # as PyTorch's reader names it: without the archive's top directory
    header_offset: int
    size: int


class Archive:
    """The records of a ``torch.save`` file read by :func:`read_archive`.

    ``storages`` maps ``data/<key>`` to a ``uint8`` tensor holding that storage's bytes;
    ``records`` maps every other record to its bytes; ``len()`` is the number of bytes read.
    """

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}
        self.storages: dict[str, torch.Tensor] = {}
        self.size = 0

    def __len__(self) -> int:
        return self.size


def read_archive(f: BinaryIO, size: int, algorithm: Checksum) -> tuple[Archive, str] | None:
    """Read the ``size`` bytes of ``f`` once, in order: (archive, digest).

    ``f`` is a file opened for binary reading (read with ``pread``: its position is not used).
    The digest, under ``algorithm``, covers every byte read, in file order, exactly as a plain
    read would. A file shorter than ``size`` ends the read early (``len(archive) < size``).
    ``None`` when the file cannot be read this way (not a zip archive of uncompressed records,
    records out of order, or a directory that changed between its two reads): read it whole.
    """
    reader = _HashingReader(f.fileno(), algorithm.hasher())
    planned = _plan(reader, size)
    if planned is None:
        return None
    records, directory_start, directory = planned
    archive = Archive()
    for rec in records:
        if not reader.pos <= rec.header_offset < directory_start:
            return None  # overlapping records, or one inside the directory: not torch.save's layout
        # what lies before the header (the previous record's data descriptor), and the header
        header = reader.read(rec.header_offset + _LOCAL_HEADER.size - reader.pos)[-_LOCAL_HEADER.size :]
        if reader.pos < rec.header_offset + _LOCAL_HEADER.size:
            return _short(archive, reader)
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_SIGNATURE:
            return None
        name_and_extra = fields[-2] + fields[-1]
        if len(reader.read(name_and_extra)) < name_and_extra:
            return _short(archive, reader)
        if reader.pos + rec.size > directory_start:
            return None  # a size the file cannot hold: never allocate what the directory claims
        if rec.name.startswith(_STORAGE_PREFIX):
            storage = torch.empty(rec.size, dtype=torch.uint8)
            archive.storages[rec.name] = storage
            complete = reader.read_into(memoryview(storage.numpy())) == rec.size
        else:
            archive.records[rec.name] = data = reader.read(rec.size)
            complete = len(data) == rec.size
        if not complete:
            return _short(archive, reader)
    reader.read(directory_start - reader.pos)
    if reader.read(size - directory_start) != directory:
        return None if reader.pos == size else _short(archive, reader)
    archive.size = reader.pos
    return archive, reader.hasher.hexdigest()


def _short(archive: Archive, reader: _HashingReader) -> tuple[Archive, str]:
    """The file ended early: what was read, for the caller's size check to report."""
    archive.size = reader.pos
    return archive, reader.hasher.hexdigest()


class _HashingReader:
    """Reads a file forward from its start (``pos``), feeding every byte read to ``hasher``.

    Positioned reads (``pread``) on the descriptor: no buffering layer between the file and the
    storages, and planning reads (``pread_unhashed``) do not disturb the ordered pass.
    """

    def __init__(self, fd: int, hasher: Hasher) -> None:
        self.fd, self.hasher, self.pos = fd, hasher, 0

    def read(self, n: int) -> bytes:
        data = os.pread(self.fd, n, self.pos) if n > 0 else b""
        self.hasher.update(data)
        self.pos += len(data)
        return data

    def read_into(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done : done + _PIECE]], self.pos)
            if not n:
                break
            self.hasher.update(view[done : done + n])
            done += n
            self.pos += n
        return done

    def pread_unhashed(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)


# --- where the records lie ---------------------------------------------------------------


def _plan(reader: _HashingReader, size: int) -> tuple[list[_Record], int, bytes] | None:
    """The records in file order, the directory's offset and the directory's bytes (to the end).

    The directory is parsed by :mod:`zipfile` from the file's last bytes; when it starts before
    them, the tail is read once more from where it starts.
    """
    start = max(0, size - _TAIL)
    for _ in range(2):
        tail = reader.pread_unhashed(size - start, start)
        if len(tail) != size - start:
            return None
        try:
            with zipfile.ZipFile(_TailFile(start, tail)) as zf:
                infos, directory_start = zf.infolist(), zf.start_dir
        except _NeedsEarlierBytes as more:
            start = more.offset
            continue
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, struct.error):
            return None
        records = _records(infos)
        if records is None or not start <= directory_start <= size:
            return None
        return records, directory_start, tail[directory_start - start :]
    return None


def _records(infos: list[zipfile.ZipInfo]) -> list[_Record] | None:
    if not infos:
        return None
    top = infos[0].filename.split("/", 1)[0] + "/"
    if len({zi.filename for zi in infos}) != len(infos):
        return None  # a name twice: decode_state refuses the file (check_layout)
    out = []
    for zi in sorted(infos, key=lambda z: z.header_offset):
        if (
            zi.compress_type != zipfile.ZIP_STORED
            or zi.compress_size != zi.file_size
            or not zi.filename.startswith(top)
        ):
            return None
        out.append(_Record(zi.filename[len(top) :], zi.header_offset, zi.compress_size))
    return out


class _NeedsEarlierBytes(Exception):
    def __init__(self, offset: int) -> None:
        self.offset = offset


class _TailFile(io.BytesIO):
    """The last bytes (from ``start``) of a file, at their offsets in the file, for :mod:`zipfile`
    to parse the directory from; seeking before ``start`` raises :class:`_NeedsEarlierBytes`."""

    def __init__(self, start: int, data: bytes) -> None:
        super().__init__(data)
        self._start = start

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            if offset < self._start:
                raise _NeedsEarlierBytes(offset)
            offset -= self._start
        elif whence == io.SEEK_END and offset < -len(self.getbuffer()):
            raise _NeedsEarlierBytes(self._start + len(self.getbuffer()) + offset)
        return super().seek(offset, whence) + self._start

    def tell(self) -> int:
        return super().tell() + self._start


# --- decoding ----------------------------------------------------------------------------


class _ArchiveRecords:
    """What ``torch.serialization._load`` asks of PyTorch's zip reader, answered from an archive."""

    def __init__(self, archive: Archive) -> None:
        self._records: Mapping[str, bytes] = archive.records
        self._storages: Mapping[str, torch.Tensor] = archive.storages

    def has_record(self, name: str) -> bool:
        return name in self._records or name in self._storages

    def get_record(self, name: str) -> bytes:
        try:
            return self._records[name]
        except KeyError:
            raise RuntimeError(f"the archive has no record {name!r}") from None

    def get_storage_from_record(self, name: str, nbytes: int, _storage_type: object) -> torch.Tensor:
        storage = self._storages.get(name)
        if storage is None or storage.numel() != nbytes:
            found = "none" if storage is None else f"{storage.numel()} bytes"
            raise RuntimeError(f"storage record {name!r} should hold {nbytes} bytes, found {found}")
        return storage

    def get_all_records(self) -> list[str]:
        return [*self._records, *self._storages]

    def serialization_id(self) -> str:
        return self._records.get(".data/serialization_id", b"").decode("ascii", "replace")


def decode_archive(archive: Archive, *, name: str = "state.pt") -> Any:
    """The state in a verified archive, decoded like ``torch.load(weights_only=True)``.

    Raises what :func:`~elastic_ops.checkpoint.codec.decode_state` raises, for the same reasons.
    """
    with decode_errors(name):
        return torch.serialization._load(  # type: ignore[attr-defined]
            _ArchiveRecords(archive),
            "cpu",
            torch.serialization._weights_only_unpickler,  # type: ignore[attr-defined]
            encoding="utf-8",  # what torch.load passes
        )


# A probe for archive_decoding_works(): the records torch.save writes for
# {"a": t[:4].view(2, 2), "b": t[2:], "empty": torch.zeros(0), "n": [1, "x", None]} with
# t = torch.arange(6.0): data.pkl (pickle protocol 2, as torch.save writes it) and two storages.
# Kept as data so the check costs no torch.save (whose first call in a process takes ~1.5 ms);
# tests/checkpoint/test_ckpt_archive.py checks that torch.load reads these records as that state.
PROBE_RECORDS = {
    "data.pkl": base64.b64decode(
        "gAJ9cQAoWAEAAABhcQFjdG9yY2guX3V0aWxzCl9yZWJ1aWxkX3RlbnNvcl92MgpxAigoWAcAAABzdG9yYWdlcQNjdG9yY2gK"
        "RmxvYXRTdG9yYWdlCnEEWAEAAAAwcQVYAwAAAGNwdXEGSwZ0cQdRSwBLAksChnEISwJLAYZxCYljY29sbGVjdGlvbnMKT3Jk"
        "ZXJlZERpY3QKcQopUnELdHEMUnENWAEAAABicQ5oAigoaANoBGgFaAZLBnRxD1FLAksEhXEQSwGFcRGJaAopUnESdHETUnEU"
        "WAUAAABlbXB0eXEVaAIoKGgDaARYAQAAADFxFmgGSwB0cRdRSwBLAIVxGEsBhXEZiWgKKVJxGnRxG1JxHFgBAAAAbnEdXXEe"
        "KEsBWAEAAAB4cR9OZXUu"
    ),
    ".format_version": b"1",
    ".storage_alignment": b"64",
    "byteorder": b"little",
    "version": b"3\n",
    "data/0": struct.pack("<6f", *range(6)),
    "data/1": b"",
}


def probe_archive() -> Archive:
    """The probe's records as :func:`read_archive` returns them: storages as ``uint8`` tensors."""
    archive = Archive()
    for name, data in PROBE_RECORDS.items():
        if name.startswith(_STORAGE_PREFIX):
            archive.storages[name] = torch.tensor(list(data), dtype=torch.uint8)
        else:
            archive.records[name] = data
    return archive


@functools.cache
def archive_decoding_works() -> bool:
    """Whether this PyTorch decodes an :class:`Archive` as ``torch.load`` decodes the file
    (checked once per process, on the probe: views sharing one storage, an empty storage)."""
    if os.environ.get("TORCH_SERIALIZATION_DEBUG") == "1":
        return False  # its debug checks ask the zip reader for file offsets
    try:
        got = decode_archive(probe_archive(), name="probe")
        same = (
            got["n"] == [1, "x", None]
            and torch.equal(got["a"], torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
            and torch.equal(got["b"], torch.tensor([2.0, 3.0, 4.0, 5.0]))
            and got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()
            and got["empty"].shape == (0,)
        )
    except Exception as exc:  # another PyTorch: its private loader works differently
        log.info("decoding checkpoints from whole-file reads (%s: %s)", type(exc).__name__, exc)
        return False
    if not same:
        log.info("decoding checkpoints from whole-file reads (this PyTorch decodes archives differently)")
    return same
