"""The checkpoint manifest: the one small object whose presence makes a checkpoint exist.

It is written last and only if absent. It lists every data file of the checkpoint with its
size and checksum, so a reader can tell a complete, intact checkpoint from a damaged one.
Parsing is strict: anything unexpected makes the manifest (and so the checkpoint) invalid.

Format versions (both are read; version 2 is written)::

    1  "files": [{"name": "d-…/state.pt", "sha256": "<64 hex>", "size": 123}]
    2  "files": [{"name": "d-…/state.pt", "algorithm": "xxh3-128", "digest": "<32 hex>", "size": 123}]

Version 2 names the checksum algorithm per file (see :mod:`elastic_ops.checkpoint.checksum`).
A release that reads only version 1 skips version-2 checkpoints as invalid (with a warning).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from elastic_ops.checkpoint.checksum import ALLOWED, DEFAULT_CHECKSUM, Checksum
from elastic_ops.errors import CheckpointCorruptError, CheckpointError

FORMAT = "elastic-ops-checkpoint"
FORMAT_VERSION = 2  # written; READ_VERSIONS are read
READ_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.pt"

# a file name inside an iteration prefix: "d-<hex>/<name>", no "..", no absolute paths
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_V1_ENTRY_KEYS = {"name", "sha256", "size"}
_V2_ENTRY_KEYS = {"name", "algorithm", "digest", "size"}


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint, relative to its iteration prefix: size and checksum."""

    name: str
    algorithm: Checksum
    digest: str
    size: int

    @classmethod
    def of(cls, name: str, data: bytes, algorithm: Checksum = DEFAULT_CHECKSUM) -> FileEntry:
        return cls(name, algorithm, algorithm.hexdigest(data), len(data))

    def to_doc(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "algorithm": self.algorithm.value,
            "digest": self.digest,
            "size": self.size,
        }


@dataclasses.dataclass(frozen=True)
class Manifest:
    iteration: int
    epoch: int
    spec_hash: str
    created: float
    files: tuple[FileEntry, ...]
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "iteration": self.iteration,
            "epoch": self.epoch,
            "spec_hash": self.spec_hash,
            "created": self.created,
            "metrics": self.metrics,
            "files": [f.to_doc() for f in self.files],
        }
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    def same_content(self, other: Manifest) -> bool:
        """True when ``other`` commits the same bytes for the same job (an idempotent retry).

        Data directories are writer-unique, so files compare by base name, checksum and size.
        Digests under different algorithms cannot be compared: such a pair counts as different
        (a conflict is raised rather than a possibly different state accepted).
        """

        def content(m: Manifest) -> tuple:
            files = sorted((f.name.rsplit("/", 1)[-1], f.algorithm.value, f.digest, f.size) for f in m.files)
            return m.iteration, m.spec_hash, files

        return content(self) == content(other)


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics must be a JSON mapping (finite or not: a NaN loss is still worth recording)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise CheckpointError(f"invalid metrics={metrics!r}: must be a mapping of name to JSON value")
    try:
        return json.loads(json.dumps(dict(metrics), default=_json_default))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"invalid metrics={metrics!r}: must be JSON-serialisable ({exc})") from None


def _json_default(value: object) -> Any:
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def parse_manifest(data: bytes, *, where: str) -> Manifest:
    """Parse and validate a manifest; :class:`CheckpointCorruptError` says what is wrong."""

    def bad(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"invalid manifest {where}: {why}")

    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f"format must be {FORMAT!r}")
    version = doc.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise bad(f"format_version={version!r}, this version reads {' and '.join(map(str, READ_VERSIONS))}")
    for key in ("iteration", "epoch"):
        if type(doc.get(key)) is not int or doc[key] < 0:
            raise bad(f"{key}={doc.get(key)!r} must be an integer >= 0")
    if not isinstance(doc.get("spec_hash"), str):
        raise bad("spec_hash must be a string")
    created = doc.get("created")
    if type(created) not in (int, float) or not math.isfinite(created):
        raise bad(f"created={created!r} must be a number")
    if not isinstance(doc.get("metrics", {}), dict):
        raise bad("metrics must be an object")
    files = doc.get("files")
    if not isinstance(files, list) or not files:
        raise bad("files must be a non-empty list")
    entries = [_parse_entry(f, version, bad) for f in files]
    names = [e.name for e in entries]
    if len(set(names)) != len(names):  # load() needs exactly one state file
        raise bad(f"file {next(n for n in names if names.count(n) > 1)!r} is listed twice")
    states = [n for n in names if n.rsplit("/", 1)[-1] == STATE_NAME]
    if len(states) != 1:  # what load() decodes: a verified checkpoint without it cannot load
        raise bad(f"lists {len(states)} {STATE_NAME} files, not one")
    return Manifest(
        iteration=doc["iteration"],
        epoch=doc["epoch"],
        spec_hash=doc["spec_hash"],
        created=float(created),
        files=tuple(entries),
        metrics=doc.get("metrics", {}),
    )


def _parse_entry(f: object, version: int, bad: Callable[[str], CheckpointCorruptError]) -> FileEntry:
    keys = _V1_ENTRY_KEYS if version == 1 else _V2_ENTRY_KEYS
    if not isinstance(f, dict) or set(f) != keys:
        raise bad(f"file entry {f!r} must have exactly {', '.join(sorted(keys))}")
    name, size = f["name"], f["size"]
    if not isinstance(name, str) or not _FILE_NAME_RE.match(name) or {".", ".."} & set(name.split("/")):
        raise bad(f"file name {name!r} is not a relative path inside the checkpoint")
    if version == 1:
        algorithm, digest = Checksum.SHA256, f["sha256"]
    else:
        try:
            algorithm = Checksum(f["algorithm"])
        except ValueError:
            raise bad(f"algorithm {f['algorithm']!r} of {name} is not one of {ALLOWED}") from None
        digest = f["digest"]
    if not algorithm.is_digest(digest):
        raise bad(f"{algorithm.value} {digest!r} of {name} is not a hex digest")
    if type(size) is not int or size < 0:
        raise bad(f"size {size!r} of {name} must be an integer >= 0")
    return FileEntry(name, algorithm, digest, size)
