"""``s3://`` backend (boto3), for AWS S3 and S3-compatible stores (MinIO, Ceph RGW, moto, …).

- The commit primitive is a conditional PUT: ``put_object(IfNoneMatch="*")`` (AWS S3 since
  2024-08, MinIO, moto >= 5.0.14). The store answers 412 to the second writer of a key.
  A store that silently ignores ``If-None-Match`` gives last-writer-wins; see docs/checkpoint.md.
- Objects larger than ``transfer_config.multipart_threshold`` are uploaded and downloaded in
  parallel parts (boto3's transfer manager).
- Every call goes through :func:`call_with_retry`. A client we build ourselves has botocore's
  own retries turned off so the one retry policy (and its injected sleep) is the only one; a
  client handed in (Airflow's aws connection) keeps its configuration.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore import exceptions as bce
from botocore.config import Config

from elastic_ops.checkpoint.backend import Backend, ObjectInfo
from elastic_ops.checkpoint.retry import RetryPolicy, call_with_retry, error_code
from elastic_ops.errors import CheckpointCorruptError

if TYPE_CHECKING:
    from botocore.client import BaseClient

T = TypeVar("T")

MiB = 1024 * 1024
DEFAULT_TRANSFER = TransferConfig(
    multipart_threshold=64 * MiB, multipart_chunksize=16 * MiB, max_concurrency=8, use_threads=True
)


def client_config(**overrides: object) -> Config:
    """The botocore settings the store relies on, for any S3 client it is handed.

    - botocore's own retries are off: :func:`call_with_retry` is the one retry loop.
    - Downloads are not checked against the object's CRC32 (``response_checksum_validation=
      "when_required"``; boto3's default validates whenever the object has one): every byte the
      store reads is checked against the manifest's digest before use anyway, end to end from the
      writer, and the CRC32 pass was measured at ~17 ms per 22 MB download on loopback, a third
      of the download. Uploads still send a CRC32 that S3 checks before storing the object.
    - Connection pool of 16 (boto3 default 10): a multipart transfer (8 parts at once) plus the
      manifest read and listing the store makes alongside never wait for a connection.

    A client built from an Airflow ``aws`` connection merges these over the connection's own
    botocore config (``config.merge(client_config())``), so its endpoint, addressing style,
    proxies and timeouts stay the user's.
    """
    return Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        response_checksum_validation="when_required",
        max_pool_connections=16,
        **overrides,
    )


def make_client(
    endpoint_url: str | None = None, *, session: boto3.session.Session | None = None, **kwargs: object,
) -> BaseClient:
    """A boto3 S3 client configured for the store (:func:`client_config`), from ``session`` or
    boto3's standard credential chain; path-style addressing when ``endpoint_url`` is given."""
    config = client_config(
        connect_timeout=10,
        read_timeout=60,
        s3={"addressing_style": "path"} if endpoint_url else None,
    )
    return (session or boto3).client("s3", endpoint_url=endpoint_url, config=config, **kwargs)


class S3Options(TypedDict, total=False):
    """The settings :func:`~elastic_ops.checkpoint.open_store` passes on to :class:`S3Backend`."""

    endpoint_url: str | None
    retry: RetryPolicy | None
    transfer_config: TransferConfig | None


class S3Backend(Backend):
    remote = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: BaseClient | None = None,
        endpoint_url: str | None = None,
        retry: RetryPolicy | None = None,
        transfer_config: TransferConfig | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.client = client if client is not None else make_client(endpoint_url)
        self.retry = retry or RetryPolicy()
        self.transfer = transfer_config or DEFAULT_TRANSFER

    @property
    def single_put_limit(self) -> int:
        """Objects smaller than this go up in one request (larger ones in parallel parts)."""
        return self.transfer.multipart_threshold

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, verb: str, key: str, fn: Callable[[], T]) -> T:
        return call_with_retry(fn, f"{verb} {self.uri}/{key}", self.retry)

    def put(self, key: str, data: bytes) -> None:
        full = self._key(key)
        if len(data) >= self.transfer.multipart_threshold:
            self._call(
                "upload",
                key,
                lambda: self.client.upload_fileobj(io.BytesIO(data), self.bucket, full, Config=self.transfer),
            )
        else:
            self._call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=full, Body=data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        full = self._key(key)

        def attempt() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                return True
            except bce.ClientError as exc:
                code, status = error_code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                raise

        return self._call("conditional put", key, attempt)

    def get(self, key: str, *, size_hint: int | None = None) -> bytes | None:
        full = self._key(key)

        def attempt() -> bytes | None:
            try:
                if size_hint is not None and size_hint >= self.transfer.multipart_threshold:
                    buf = io.BytesIO()  # parallel ranged GETs
                    self.client.download_fileobj(self.bucket, full, buf, Config=self.transfer)
                    return buf.getvalue()
                return self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()
            except bce.ClientError as exc:
                code, status = error_code(exc)
                if status == 404 and code in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise
            except bce.FlexibleChecksumError as exc:  # a client that checks downloads (boto3's default)
                raise CheckpointCorruptError(
                    f"{self.uri}/{key} does not match the checksum S3 stored with it ({exc})",
                    hint="the object is damaged; an older checkpoint is used by latest()",
                ) from exc

        try:
            return self._call("get", key, attempt)
        except CheckpointCorruptError:
            # damaged at rest, or on the way: a second read tells the two apart; damage at rest
            # is then a damaged checkpoint like any other (latest() falls back past it)
            return self._call("get", key, attempt)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        full = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0

        def attempt() -> list[ObjectInfo]:
            # pages followed by hand: a paginator is built anew per call and costs ~1 ms of CPU,
            # which is on the critical path of latest()
            out = []
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            while True:
                page = self.client.list_objects_v2(**params)
                out.extend(
                    ObjectInfo(obj["Key"][strip:], int(obj["Size"]), _timestamp(obj.get("LastModified")))
                    for obj in page.get("Contents", [])
                )
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    return out
                params["ContinuationToken"] = token

        return self._call("list", f"{prefix}*", attempt)

    def delete_if(self, key: str, data: bytes) -> bool:
        """By ETag: read the object and its ETag, compare the bytes, then ``DeleteObject`` with
        ``If-Match`` (S3 refuses with 412 when another writer replaced it in between)."""
        full = self._key(key)

        def attempt() -> bool:
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=full)
                current, etag = obj["Body"].read(), obj["ETag"]
            except bce.ClientError as exc:
                if error_code(exc)[0] in ("NoSuchKey", "404", "NotFound"):
                    return True
                raise
            if current != data:
                return False
            try:
                self.client.delete_object(Bucket=self.bucket, Key=full, IfMatch=etag)
            except bce.ClientError as exc:
                code, status = error_code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                if code in ("NoSuchKey", "404", "NotFound"):
                    return True
                raise
            return True

        return self._call("conditional delete", key, attempt)

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]

            def attempt(batch: list[dict[str, str]] = batch) -> None:
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
                errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    err = errors[0]
                    raise bce.ClientError(
                        {
                            "Error": {"Code": err.get("Code", ""), "Message": err.get("Message", "")},
                            "ResponseMetadata": {
                                "HTTPStatusCode": 500 if err.get("Code") == "InternalError" else 403
                            },
                        },
                        "DeleteObjects",
                    )

            self._call("delete", f"{keys[i]} (+{len(batch) - 1} more)", attempt)


def _timestamp(value: object) -> float | None:
    """A listing's ``LastModified`` (a datetime) as seconds since the epoch."""
    return value.timestamp() if hasattr(value, "timestamp") else None
