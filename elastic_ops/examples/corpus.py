"""A character corpus that ships with Python: the source of a fixed list of stdlib modules.

Read as bytes from the interpreter's standard library (no download), decoded as UTF-8 and
concatenated in the listed order. The modules are small, pure-Python and have barely changed
across 3.11 releases; the corpus is identical on every machine with the same Python version.
``corpus_sha256()`` identifies it (pin it with the ``corpus_sha256`` parameter of
:class:`~elastic_ops.examples.chartransformer.CharTransformer` for multi-host jobs).

Encoding: a fixed 97-symbol vocabulary independent of the text: 0 = any other character,
1 = newline, 2..96 = printable ASCII 32..126.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

import numpy as np

MODULES: tuple[str, ...] = (
    "colorsys", "bisect", "heapq", "textwrap", "fnmatch", "graphlib", "difflib",
    "string", "queue", "sched", "calendar", "fractions",
)
VOCAB_SIZE = 97
UNKNOWN, NEWLINE = 0, 1


def _module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise FileNotFoundError(f"stdlib module {name!r} has no .py source in this interpreter")
    return Path(spec.origin).read_bytes().decode("utf-8")


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """The concatenated module sources, each introduced by a ``# ==== module <name>`` line."""
    return "".join(f"# ==== module {name}\n{_module_source(name)}\n" for name in MODULES)


def corpus_sha256() -> str:
    return hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()


def encode(text: str) -> np.ndarray:
    """Characters to token ids (uint8) in the fixed vocabulary."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(codes.shape, UNKNOWN, dtype=np.uint8)
    printable = (codes >= 32) & (codes <= 126)
    ids[printable] = (codes[printable] - 30).astype(np.uint8)
    ids[codes == 10] = NEWLINE
    return ids


def decode(ids: np.ndarray) -> str:
    """Token ids back to text (unknown characters become ``'?'``)."""
    chars = {UNKNOWN: "?", NEWLINE: "\n"}
    return "".join(chars.get(int(i), chr(int(i) + 30)) for i in ids)


@functools.lru_cache(maxsize=1)
def corpus_ids() -> np.ndarray:
    """The encoded corpus (read-only uint8 array)."""
    ids = encode(corpus_text())
    ids.setflags(write=False)
    return ids
