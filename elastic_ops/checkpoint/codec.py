"""Safe encoding of training state.

A state is a tree of dicts (any ``dict``, including ``OrderedDict`` from ``state_dict()``),
lists and tuples whose leaves are tensors, numbers, strings, bytes, bools, ``None``,
``torch.Size``, ``torch.dtype`` and ``torch.device``: exactly what a model, optimizer and LR
scheduler ``state_dict()`` holds, and what ``torch.load(..., weights_only=True)`` accepts.

Encoding uses ``torch.save``; decoding uses ONLY ``torch.load(..., weights_only=True,
map_location="cpu")``, PyTorch's restricted unpickler, which refuses any global it does not
know instead of calling it. A refusal becomes :class:`UnsafeCheckpointError`; nothing from the
file is executed. ``encode_state`` checks the tree first, so a state that could not be loaded
back is refused at save time (naming the offending path), not discovered at resume time.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import zipfile
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch

from elastic_ops.checkpoint.checksum import Checksum
from elastic_ops.errors import CheckpointCorruptError, InvalidStateError, UnsafeCheckpointError

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

_LEAF_TYPES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)
_LEAF_SET = frozenset(_LEAF_TYPES)
_KEY_TYPES = (str, int, float, bool, type(None))
_ALLOWED = (
    "dict, list, tuple, torch.Tensor, int, float, bool, str, bytes, None, torch.Size, "
    "torch.dtype, torch.device"
)


def check_state(state: object, path: str = "") -> None:
    """Raise :class:`InvalidStateError` naming the first value ``torch.load`` would refuse."""
    bad = _first_invalid(state)
    if bad is not None:
        where, value = bad
        raise InvalidStateError(path + where, value, _ALLOWED)


def _first_invalid(value: object) -> tuple[str, object] | None:
    """(path, value) of the first value the safe loader would refuse, or ``None``.

    Runs on every save over every node of the state (a Python RNG state alone is 625 ints), so
    the common case is one type lookup per node and the path text is built only on failure.
    """
    t = type(value)
    if t in _LEAF_SET:  # exact type: a str/int subclass (an Enum) would pickle as its class
        return None
    if isinstance(value, torch.Tensor):
        return None
    if t is dict or isinstance(value, Mapping):
        if not isinstance(value, dict):
            return "", value
        for key, item in value.items():
            if not isinstance(key, _KEY_TYPES):
                return f"[key {key!r}]", key
            bad = _first_invalid(item)
            if bad is not None:
                return f"[{key!r}]{bad[0]}", bad[1]
        return None
    if t in (list, tuple, torch.Size) and isinstance(value, list | tuple):  # the same test, narrowed
        for i, item in enumerate(value):
            bad = _first_invalid(item)
            if bad is not None:
                return f"[{i}]{bad[0]}", bad[1]
        return None
    return "", value  # a foreign object, or a list/tuple subclass (a namedtuple)


def encode_state(state: object) -> bytes:
    """Serialise ``state`` (checked first) with ``torch.save``."""
    check_state(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it.

    Large writes (``torch.save`` hands over whole tensors) are passed on in pieces of
    ``_PIECE`` bytes, each hashed right before it is copied out, so it is read from the CPU cache
    the second time; one multi-MB write would hash from memory and then copy from memory.
    """

    def __init__(self, out: BinaryIO, algorithm: Checksum) -> None:
        self.out = out
        self.hasher = algorithm.hasher()
        self.size = 0
        self.error: OSError | None = None  # the first write that failed (disk full, I/O error)

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        for start in range(0, n, _PIECE):
            piece = view[start : start + _PIECE]
            self.hasher.update(piece)
            try:
                self.out.write(piece)
            except OSError as exc:
                self.error = self.error or exc
                raise
        self.size += n
        return n


# 1 MiB: within a core's L2 cache, and large writes let the page cache hold the file in large
# folios, which later reads copy out faster (64 KiB pieces: saves ~20 % and loads ~10 % slower)
_PIECE = 1 << 20


def encode_state_into(state: object, out: BinaryIO, algorithm: Checksum) -> tuple[str, int]:
    """Serialise ``state`` into ``out``; returns its (``algorithm`` digest, size).

    The caller has run :func:`check_state` (before creating anything to write into). The digest
    is computed on the way, while the bytes are in the CPU cache: no second pass.
    """
    writer = _HashingWriter(out, algorithm)
    try:
        torch.save(state, writer)
    except Exception:
        # torch's zip writer, closing after a failed write, raises its own RuntimeError
        # ("unexpected pos ...") over the OSError: the write's error is the one that says what
        # happened (a full disk), and the backend maps it to the store's errors
        if writer.error is not None:
            raise writer.error from None
        raise
    return writer.hasher.hexdigest(), writer.size


class _BufferReader(io.RawIOBase):
    """A read-only, seekable file over a buffer, without copying it (``io.BytesIO`` copies
    anything that is not ``bytes``). Wrapped in ``io.BufferedReader``, so the unpickler's many
    small reads are served in C; tensor data is copied once, straight into its storage."""

    def __init__(self, data: Buffer) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Buffer) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def _reader(data: bytes | memoryview) -> BinaryIO:
    if isinstance(data, bytes):
        return io.BytesIO(data)  # shares the bytes object, no copy
    return io.BufferedReader(_BufferReader(data), 1 << 16)


def decode_state(data: bytes | memoryview, *, name: str = "state.pt") -> Any:
    """Load bytes written by :func:`encode_state` without executing anything from them.

    Raises :class:`UnsafeCheckpointError` when the payload asks for a global the restricted
    unpickler does not allow (code execution attempt, or a foreign object), and
    :class:`CheckpointCorruptError` when it is not a readable torch file.
    """
    reader = _reader(data)
    check_layout(reader, name)
    with decode_errors(name):
        return torch.load(reader, weights_only=True, map_location="cpu")


def check_decodable(path: str | os.PathLike[str], *, name: str = "state.pt") -> None:
    """Raise what :func:`decode_state` would raise for the file at ``path``, reading only its
    pickle: tensors are built on the ``meta`` device, without their data (~2 ms whatever the size)."""
    check_layout(path, name)
    with decode_errors(name):
        torch.load(path, weights_only=True, map_location="meta")


def check_layout(source: str | os.PathLike[str] | BinaryIO, name: str = "state.pt") -> None:
    """Refuse a torch archive unlike any ``torch.save`` writes, before ``torch.load`` reads it:
    a compressed record (its zip reader inflates it: a 1 MB file became 1 GB in memory) or a
    record name given twice (two readers would decode two different states from one verified
    file). Only the zip directory is read; a stream is left where it was. Not a zip at all: left
    to ``torch.load`` to refuse."""
    start = source.tell() if hasattr(source, "tell") else None
    try:
        with zipfile.ZipFile(source) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError):
        return
    finally:
        if start is not None:
            source.seek(start)
    seen: set[str] = set()
    for zi in infos:
        if zi.compress_type != zipfile.ZIP_STORED or zi.compress_size != zi.file_size:
            raise CheckpointCorruptError(
                f"cannot decode {name}: record {zi.filename[:200]!r} is compressed "
                f"({zi.compress_size} bytes for {zi.file_size}); torch.save stores every record as is",
                hint="the file was not written by torch.save or was tampered with; nothing was inflated",
            )
        if zi.filename in seen:
            raise CheckpointCorruptError(
                f"cannot decode {name}: record {zi.filename[:200]!r} appears twice",
                hint="the file was not written by torch.save or was tampered with",
            )
        seen.add(zi.filename)


class decode_errors:
    """Turn what the safe loader raises while decoding ``name`` into the store's errors."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
    ) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        if isinstance(exc, pickle.UnpicklingError):
            # the restricted unpickler refused the stream: a global it does not allow (an attempt
            # to call or build something) or an opcode it does not support; either way not ours
            reason = str(exc.__context__ or exc)
            raise UnsafeCheckpointError(
                f"the safe loader refused {self.name} ({_first_line(reason)})",
                hint="the checkpoint was not written by elastic_ops or was tampered with; "
                "nothing in it was executed",
            ) from None
        # a truncated zip, a bad magic number, a record of the wrong size, ...
        raise CheckpointCorruptError(
            f"cannot decode {self.name}: {type(exc).__name__}: {str(exc)[:300]}",
            hint="the file is damaged; an older checkpoint is used by latest()",
        ) from None


def _first_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "unknown reason")[:300]


# --- RNG state ---------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """The torch (CPU and CUDA), numpy and python RNG states as safely loadable values."""
    np_state = np.random.get_state(legacy=False)
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "state": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (CUDA only when present on both sides)."""
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    npst = state["numpy"]
    key = npst["state"].numpy() if isinstance(npst["state"], torch.Tensor) else np.asarray(npst["state"])
    np.random.set_state(
        (
            npst["bit_generator"],
            key.astype(np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["gauss"]),
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"]), py["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to(torch.uint8).cpu() for s in cuda][: torch.cuda.device_count()])
