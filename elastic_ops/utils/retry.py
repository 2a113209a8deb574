"""Retry classification through Airflow 3.3's native ``retry_policy``.

A lost worker or host, a busy ledger or a transient storage error is retried by Airflow with its
usual backoff; a bad spec, an exception in user code or a non-finite loss fails the task at once
without burning the remaining retries (the error hierarchy's ``retryable`` flag decides).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import RetryDecision, RetryPolicy

from elastic_ops.errors import ElasticOpsError


class ElasticRetryPolicy(RetryPolicy):
    """Retry ``retryable`` elastic_ops errors, fail the others now; anything else: default."""

    def evaluate(self, exception: BaseException, try_number: int, max_tries: int, context=None):
        if isinstance(exception, ElasticOpsError):
            name = type(exception).__name__
            if exception.retryable:
                return RetryDecision.retry(reason=f"{name} is retryable: {exception}")
            return RetryDecision.fail(reason=f"{name} is not retryable: {exception}")
        return RetryDecision.default()

    def serialize(self) -> dict[str, Any]:
        return {"__type": "ElasticRetryPolicy"}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> ElasticRetryPolicy:
        return cls()


def default_to(kwargs: dict[str, Any], **defaults: object) -> None:
    """Set each of ``defaults`` in an operator's ``kwargs`` unless the DAG author gave it, in the
    call or in ``default_args`` (Airflow hands those to ``__init__`` as ``default_args`` and
    applies them only to arguments the call lacks: a plain ``setdefault`` overrode them)."""
    given = kwargs.get("default_args") or {}
    for key, value in defaults.items():
        if key not in kwargs and key not in given:
            kwargs[key] = value
