"""Checkpoint store: ``file://`` and ``s3://`` backends, manifests, fencing, safe codec.

Never imports Airflow. See docs/checkpoint.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Unpack
from urllib.parse import unquote, urlparse

from elastic_ops.checkpoint.backend import Backend, ObjectInfo
from elastic_ops.checkpoint.checksum import DEFAULT_CHECKSUM, Checksum
from elastic_ops.checkpoint.codec import (
    InvalidStateError,
    capture_rng,
    decode_state,
    encode_state,
    restore_rng,
)
from elastic_ops.checkpoint.local import LocalBackend
from elastic_ops.checkpoint.manifest import FORMAT_VERSION, FileEntry
from elastic_ops.checkpoint.store import CheckpointRef, CheckpointStore
from elastic_ops.errors import SpecError
from elastic_ops.metrics import NO_METRICS, Metrics
from elastic_ops.spec import bucket_problem, dot_segment

if TYPE_CHECKING:
    from botocore.client import BaseClient

    from elastic_ops.checkpoint.s3 import S3Options

__all__ = [
    "FORMAT_VERSION",
    "Backend",
    "CheckpointRef",
    "CheckpointStore",
    "Checksum",
    "FileEntry",
    "InvalidStateError",
    "LocalBackend",
    "ObjectInfo",
    "capture_rng",
    "decode_state",
    "encode_state",
    "open_store",
    "restore_rng",
]

_ALLOWED_URI = "must be 'file:///absolute/path' or 's3://bucket/prefix'"


def open_store(
    uri: str,
    *,
    s3_client: BaseClient | None = None,
    keep_last: int = 3,
    keep_every: int | None = None,
    clock: Callable[[], float] | None = None,
    checksum: Checksum | str = DEFAULT_CHECKSUM,
    create: bool = True,
    metrics: Metrics = NO_METRICS,
    **backend_options: Unpack[S3Options],
) -> CheckpointStore:
    """Open the checkpoint store at ``uri``.

    ``file:///abs/path`` — a local (or shared-filesystem) directory, created if missing (unless
    ``create=False``: a store only read, e.g. to answer "which is the latest checkpoint?").
    ``s3://bucket/prefix`` — S3 or any S3-compatible store. ``s3_client`` is a ready boto3 S3
    client (the Airflow layer builds it from an ``aws`` connection, with its endpoint_url);
    without one, boto3's standard credential chain and ``AWS_ENDPOINT_URL(_S3)`` apply.
    ``backend_options`` go to :class:`~elastic_ops.checkpoint.s3.S3Backend` (``retry``,
    ``transfer_config``, ``endpoint_url``).
    ``metrics`` — where the store counts checkpoints ``latest()`` passes over
    (``checkpoint.passed_over``, tag ``why``: ``damaged`` or ``refused``).
    ``checksum`` — the algorithm new checkpoints record: ``"xxh3-128"`` (default, fast) or
    ``"sha256"`` (cryptographic); checkpoints written with either are verified on load.
    """
    if not isinstance(uri, str):
        raise SpecError("checkpoint", uri, _ALLOWED_URI)
    parsed = urlparse(uri)
    if parsed.query or parsed.fragment or parsed.params or "\0" in unquote(uri) or uri != uri.strip():
        # a query or fragment would silently drop what follows it (the Airflow layer appends
        # '/<run_id>': every run would share one store)
        raise SpecError("checkpoint", uri, _ALLOWED_URI + " (no '?', '#', NUL or surrounding spaces)")
    if why := dot_segment(uri):
        raise SpecError("checkpoint", uri, _ALLOWED_URI, hint=why)
    extra = {} if clock is None else {"clock": clock}
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise SpecError("checkpoint", uri, _ALLOWED_URI, hint="note the three slashes in file:///")
        if backend_options or s3_client is not None:
            raise SpecError("checkpoint", uri, "s3_client and S3 options only apply to s3:// URIs")
        backend: Backend = LocalBackend(unquote(parsed.path).rstrip("/") or "/", create=create)
    elif parsed.scheme == "s3":
        from elastic_ops.checkpoint.s3 import S3Backend  # boto3 only when needed

        if not parsed.netloc:
            raise SpecError("checkpoint", uri, _ALLOWED_URI, hint="the bucket name is missing")
        if why := bucket_problem(parsed.netloc):  # as the spec checks it: here, not at the first call
            raise SpecError("checkpoint", uri, _ALLOWED_URI, hint=why)
        backend = S3Backend(parsed.netloc, parsed.path.strip("/"), client=s3_client, **backend_options)
    else:
        raise SpecError("checkpoint", uri, _ALLOWED_URI)
    return CheckpointStore(backend, keep_last=keep_last, keep_every=keep_every, checksum=checksum,
                           metrics=metrics, **extra)
