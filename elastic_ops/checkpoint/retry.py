"""Which storage errors are worth retrying, and the bounded retry loop around S3 calls.

Transient (retried with exponential backoff and full jitter, then
:class:`StorageTransientError`, which is retryable at the task level): HTTP 5xx, throttling
(``SlowDown``, 429, ``Throttling…``), ``RequestTimeout``, a conditional write racing another
(409 ``ConditionalRequestConflict``), dropped connections and read/connect timeouts.
Permanent (raised at once as :class:`StoragePermanentError` with a hint saying what to fix):
bad credentials, access denied, missing bucket, and every other 4xx. Expired session
credentials are raised at once too, as the retryable :class:`StorageCredentialsExpiredError`:
retrying in the process cannot help, the task's next try gets fresh credentials.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import TypeVar

import tenacity
from botocore import exceptions as bce

from elastic_ops.errors import StorageCredentialsExpiredError, StoragePermanentError, StorageTransientError

T = TypeVar("T")

TRANSIENT_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottled", "RequestThrottledException", "TooManyRequestsException",
    "RequestLimitExceeded", "ProvisionedThroughputExceededException", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
    "ConditionalRequestConflict", "OperationAborted", "EC2ThrottledException",
})

# the session credentials ran out: a new task try (fresh credentials from its connection) helps
EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "RequestExpired"})

# code -> what the user should fix. Anything else 4xx is permanent with a generic hint.
PERMANENT_HINTS = {
    "AccessDenied": "grant the credentials s3:GetObject, s3:PutObject, s3:DeleteObject and "
                    "s3:ListBucket on the bucket and prefix",
    "AllAccessDisabled": "access to this bucket is disabled; use another bucket",
    "NoSuchBucket": "create the bucket or fix the bucket name in the checkpoint URI",
    "InvalidBucketName": "fix the bucket name in the checkpoint URI",
    "InvalidAccessKeyId": "the access key id is unknown to this endpoint; fix the aws connection / "
                          "AWS_ACCESS_KEY_ID (or the endpoint_url)",
    "SignatureDoesNotMatch": "the secret access key does not match the access key id; fix the credentials",
    "InvalidToken": "the session token is invalid; fix the credentials",
    "AuthorizationHeaderMalformed": "the region does not match the bucket's; set region_name",
    "PermanentRedirect": "the bucket is in another region; set region_name or the endpoint_url",
    "AccountProblem": "the account has a problem; contact the storage provider",
}


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter. ``sleep`` and ``rng`` are injectable."""

    attempts: int = 6
    initial_s: float = 0.2
    max_s: float = 10.0
    sleep: Callable[[float], None] = time.sleep
    rng: Callable[[], float] = random.random

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): uniform in [0, cap]."""
        cap = min(self.max_s, self.initial_s * 2 ** (attempt - 1))
        return cap * self.rng()


def error_code(exc: BaseException) -> tuple[str, int | None]:
    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {}) or {}
        status = (exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
        return str(err.get("Code", "")), status
    return type(exc).__name__, None


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, bce.ClientError):
        code, status = error_code(exc)
        return code in TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429))
    # connection refused/reset/closed, timeouts, a body cut short while streaming
    return isinstance(
        exc,
        bce.HTTPClientError | bce.ConnectionError | bce.ResponseStreamingError | bce.IncompleteReadError
        | ConnectionError | TimeoutError,
    )


def permanent_error(exc: BaseException, what: str) -> StoragePermanentError | StorageCredentialsExpiredError:
    """The store's error for a storage failure retrying in this process cannot fix."""
    code, status = error_code(exc)
    if code in EXPIRED_CODES or isinstance(exc, bce.CredentialRetrievalError):
        return StorageCredentialsExpiredError(
            f"{what} failed: the session credentials expired ({code or type(exc).__name__})",
            hint="the task will be retried with fresh credentials; use longer-lived sessions for long chunks",
        )
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return StoragePermanentError(
            f"{what}: no usable AWS credentials ({type(exc).__name__})",
            hint="set an aws connection (Airflow), AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "or an instance role",
        )
    hint = PERMANENT_HINTS.get(code, "check the checkpoint URI, credentials and endpoint_url")
    return StoragePermanentError(f"{what} failed: {code or type(exc).__name__} (HTTP {status})", hint=hint)


def call_with_retry(fn: Callable[[], T], what: str, policy: RetryPolicy) -> T:
    """Run ``fn``; retry transient errors per ``policy``; map errors onto the store's errors.

    ``what`` names the operation and object for messages (never credentials).
    """
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.attempts),
        wait=lambda rs: policy.wait(rs.attempt_number),
        retry=tenacity.retry_if_exception(is_transient),
        sleep=policy.sleep,
        reraise=True,
    )
    try:
        return retrying(fn)
    except (StoragePermanentError, StorageTransientError, StorageCredentialsExpiredError):
        raise
    except Exception as exc:
        if is_transient(exc):
            code, status = error_code(exc)
            raise StorageTransientError(
                f"{what} still failing after {policy.attempts} attempts: {code}"
                + (f" (HTTP {status})" if status else ""),
                hint="the storage endpoint is overloaded or unreachable; the task will be retried",
            ) from exc
        if isinstance(exc, bce.BotoCoreError | bce.ClientError):
            raise permanent_error(exc, what) from exc
        raise

