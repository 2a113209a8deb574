"""``ElasticPoolSensor``: wait (deferred, holding no worker slot) until the pool can give
``min_workers`` — for DAGs that gate other work on training capacity."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, Context

from elastic_ops.errors import SpecError, WaitFailedError
from elastic_ops.hooks.elastic_ops import DEFAULT_CONN_ID, ElasticOpsHook
from elastic_ops.spec import check_host_selector, check_int
from elastic_ops.triggers.events import CapacityEvent, TriggerFailure, parse_event
from elastic_ops.triggers.pool import PoolCapacityTrigger, free_slots
from elastic_ops.utils.jobs import check_conn_ids, check_seconds, coerce_rendered, is_template
from elastic_ops.utils.retry import ElasticRetryPolicy, default_to


class ElasticPoolSensor(BaseSensorOperator):
    """Succeeds when the pool has at least ``min_workers`` free slots (on hosts carrying every
    label of ``host_selector``, as a job with that selector needs).

    Deferrable by default: the waiting happens in the triggerer (``PoolCapacityTrigger``).
    With ``deferrable=False`` it pokes like a classic sensor.
    """

    template_fields: Sequence[str] = ("min_workers",)

    def __init__(
        self,
        *,
        min_workers: int | str = 1,
        elastic_ops_conn_id: str = DEFAULT_CONN_ID,
        deferrable: bool = True,
        poll_interval: float = 2.0,
        host_selector: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        if not is_template(min_workers) and (
            isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1
        ):
            raise SpecError("min_workers", min_workers, "must be an integer >= 1")
        check_seconds("poll_interval", poll_interval)
        check_conn_ids(elastic_ops_conn_id)
        kwargs.setdefault("poke_interval", poll_interval)
        # as the elastic operators: a bad rendered min_workers or a trigger failure that retrying
        # cannot fix fails at once, without burning the retries default_args give
        default_to(kwargs, retry_policy=ElasticRetryPolicy())
        super().__init__(**kwargs)
        self.min_workers = min_workers
        self.elastic_ops_conn_id = elastic_ops_conn_id
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.host_selector = check_host_selector("host_selector", host_selector)

    def _wanted(self) -> int:
        value = coerce_rendered({"min_workers": self.min_workers})["min_workers"]
        if isinstance(value, bool) or not isinstance(value, int):  # named as the task was given it
            raise SpecError("min_workers", self.min_workers, "must be an integer >= 1")
        return check_int("min_workers", value, 1)

    def poke(self, context: Context) -> bool:
        free = free_slots(ElasticOpsHook(self.elastic_ops_conn_id).pool().status(), self.host_selector)
        where = f" on hosts with {self.host_selector}" if self.host_selector else ""
        self.log.info("pool has %d free slots%s; waiting for %d", free, where, self._wanted())
        return free >= self._wanted()

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        if self.poke(context):
            return None
        timeout = timedelta(seconds=self.timeout) if self.timeout else None
        self.defer(
            trigger=PoolCapacityTrigger(
                ledger_url=ElasticOpsHook(self.elastic_ops_conn_id).ledger_url(),
                min_workers=self._wanted(), poll_interval=self.poll_interval,
                host_selector=self.host_selector,
            ),
            method_name="execute_complete",
            timeout=timeout,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_event(event)
        if isinstance(parsed, TriggerFailure):
            raise WaitFailedError(f"watching the pool failed: {parsed.error_type}: {parsed.error}",
                                  retryable=parsed.retryable)
        assert isinstance(parsed, CapacityEvent)  # noqa: S101 - parse_event's contract
        self.log.info("pool has %d free slots (>= %d) after %.1fs", parsed.free, parsed.min_workers,
                      parsed.waited_s)
        return parsed.to_payload()
