"""``ElasticRegisterOperator`` (submit the job to the pool), ``ElasticFinalizeOperator`` (finish
the job in the pool, emit the trained model as an Asset event with its metrics) and
``ElasticEndJobOperator`` (the teardown that ends the job in the pool however the run ended)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context

from elastic_ops.errors import ElasticOpsError, UnknownJobError
from elastic_ops.hooks.elastic_ops import DEFAULT_CONN_ID
from elastic_ops.operators.chunk import ElasticOperatorMixin, check_tracking
from elastic_ops.operators.results import ChunkTaskResult
from elastic_ops.spec import stop_reached
from elastic_ops.utils.jobs import check_conn_ids, check_seconds, register
from elastic_ops.utils.retry import ElasticRetryPolicy, default_to

if TYPE_CHECKING:
    from torch import nn

    from elastic_ops.checkpoint.store import CheckpointStore
    from elastic_ops.hooks.elastic_ops import ElasticOpsHook
    from elastic_ops.pool import PoolClient
    from elastic_ops.spec import JobSpec
    from elastic_ops.tracking import Tracking

MISSED_HEARTBEATS = 3  # a lease not renewed for this many heartbeat intervals has no live holder
_sleep = time.sleep
_monotonic = time.monotonic


class JobTaskOperator(ElasticOperatorMixin, BaseOperator):
    """What register, finalize and end_job share: the job's fields (templated), its identity and
    hook. A bad rendered value fails them at once, whatever retries ``default_args`` give."""

    template_fields: Sequence[str] = ("spec_fields",)

    def __init__(
        self,
        *,
        spec_fields: dict[str, Any],
        group_id: str,
        num_chunks: int | None = None,
        elastic_ops_conn_id: str = DEFAULT_CONN_ID,
        aws_conn_id: str | None = "aws_default",
        tracking: Tracking | None = None,
        **kwargs: Any,
    ) -> None:
        check_conn_ids(elastic_ops_conn_id, aws_conn_id)
        check_tracking(tracking, spec_fields.get("entrypoint") if isinstance(spec_fields, dict) else None)
        # the pool's database may be briefly unreachable (a retryable error): without retries a
        # blip at register failed the whole run
        default_to(kwargs, retry_policy=ElasticRetryPolicy(), retries=3, retry_delay=timedelta(seconds=5))
        super().__init__(**kwargs)
        self.spec_fields = spec_fields
        self.group_id = group_id
        self.num_chunks = num_chunks
        self.elastic_ops_conn_id = elastic_ops_conn_id
        self.aws_conn_id = aws_conn_id
        self.tracking = tracking


class ElasticRegisterOperator(JobTaskOperator):
    """Register (idempotently) the run's job with the pool: ``min..max`` workers, priority."""

    ui_color = "#e8f4d9"

    def execute(self, context: Context) -> dict[str, Any]:
        refuse_unknown_conf_keys(context)
        spec = self._spec(context)
        register(self._hook().pool(), spec, context["dag"].dag_id)
        self.log.info(
            "registered job %s: %d..%d workers, priority %d, %d chunks of %d iterations, checkpoints %s%s",
            spec.name, spec.min_workers, spec.max_workers, spec.priority, spec.num_chunks,
            spec.chunk_iterations, spec.checkpoint_uri(),
            (f", on hosts labelled {spec.host_selector}" if spec.host_selector else "")
            + (f", tenant {spec.tenant}" if spec.tenant != "default" else ""),
        )
        self._open_run(context, spec).close()  # the job's run starts here, with its params and spec
        return {"job": spec.name, "spec": spec.to_dict(), "checkpoint": spec.checkpoint_uri()}


def unknown_conf_keys(context: Context) -> list[str]:
    """The keys of the run's conf that are not among the DAG's params (Airflow accepts them
    silently, so ``max_worker`` for ``max_workers`` would train with the default), when the DAG
    declares params at all (without, conf is the DAG author's own business)."""
    params = getattr(context.get("dag"), "params", None) or {}
    conf = getattr(context.get("dag_run"), "conf", None) or {}
    return sorted(str(k) for k in conf if k not in params) if params else []


def refuse_unknown_conf_keys(context: Context) -> None:
    """Fail the run (its first task, before any worker is asked for) on a conf key that is not
    among the DAG's params: Airflow would run on with the param's default, so a trigger with
    ``max_worker: 8`` would train on the default count without a word in the UI."""
    unknown = unknown_conf_keys(context)
    if not unknown:
        return
    import difflib

    from elastic_ops.errors import SpecError

    params = sorted(str(p) for p in context["dag"].params)
    close = difflib.get_close_matches(unknown[0], params, n=1)
    raise SpecError(
        f"conf.{unknown[0]}", context["dag_run"].conf[unknown[0]],
        f"not a param of DAG {context['dag'].dag_id}, so nothing would read it (the run would train "
        f"with the defaults); unknown keys: {', '.join(unknown)}; its params: {', '.join(params)}",
        hint=(f"did you mean {close[0]!r}? " if close else "")
        + "trigger the DAG again with the keys spelt as its params (or declare the key as a Param)",
    )


class ElasticFinalizeOperator(JobTaskOperator):
    """Finish the job: sum up the chunks' results, emit the model Asset event (URI + metrics)."""

    ui_color = "#ffe7b3"

    def __init__(self, *, chunk_task_ids: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.chunk_task_ids = list(chunk_task_ids)

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self._spec(context)
        ti = context["ti"]
        pulled = {tid: ti.xcom_pull(task_ids=tid) for tid in self.chunk_task_ids}
        # a chunk a user marked success (or skipped) pushed no result: the final checkpoint below
        # still decides whether the model is complete; only the figures lack that chunk's part
        missing = [tid for tid, data in pulled.items() if not isinstance(data, dict)]
        if missing:
            self.log.warning("job %s: no result from %s (marked success or skipped?); the summary "
                             "leaves them out", spec.name, ", ".join(missing))
        chunks = [ChunkTaskResult.from_dict(data) for data in pulled.values() if isinstance(data, dict)]
        hook = self._hook()
        store = hook.store(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)
        ref = store.latest(spec_hash=spec.spec_hash(), decode=False)
        # a job that met stop_when at a chunk end has its final model there
        stopped = ref is not None and ref.iteration < spec.total_iterations and stop_reached(
            spec.stop_when, ref.metrics)
        if ref is None or (ref.iteration < spec.total_iterations and not stopped):
            from elastic_ops.errors import CheckpointNotFoundError

            got = None if ref is None else ref.iteration
            raise CheckpointNotFoundError(
                f"job {spec.name} has no final checkpoint at iteration {spec.total_iterations} "
                f"(latest: {got}) under {spec.checkpoint_uri()}"
            )
        trained = [c for c in chunks if c.status != "already_done"]
        # the model's figures come from the final checkpoint itself (its manifest), not from the
        # chunk results: a rerun whose chunks were all already done trained nothing this time
        final = dict(ref.metrics)
        summary = {
            "job": spec.name, "checkpoint_uri": ref.uri, "checkpoint_root": spec.checkpoint_uri(),
            "entrypoint": spec.entrypoint, "params": dict(spec.params), "iteration": ref.iteration,
            "loss": final.get("loss"),
            "metrics": {k: v for k, v in final.items() if k not in ("loss", "param_sha256")},
            "param_sha256": final.get("param_sha256"),
            "chunks": len(self.chunk_task_ids), "chunks_without_result": missing,
            "preemptions": sum(c.preemptions for c in chunks),
            "waited_s": round(sum(c.waited_s for c in chunks), 3),
            "train_s": round(sum(c.duration_s - c.waited_s for c in trained), 3),
            "max_workers_used": max((int(w) for c in chunks for _, w, _ in c.workers_timeline), default=0),
            "dag_id": context["dag"].dag_id, "run_id": context["run_id"],
            "stopped_early": stopped, "stop_when": spec.stop_when,
        }
        self._finish_in_pool(hook, spec.name)
        # what training the model held, from the pool's event log (slots parked between chunks count)
        used = hook.pool().usage(job=spec.name)["jobs"]
        summary["slot_hours"] = next((j["slot_hours"] for j in used if j["job"] == spec.name), 0.0)
        run = self._open_run(context, spec)
        loader = None if spec.is_script() else lambda: final_model(spec, store, ref)
        weights = (lambda: store.load(ref)["model"]) if spec.is_script() else None
        summary |= run.finalized(summary, loader, weights)  # mlflow_run_id, mlflow_model_uri, …
        run.close()
        for asset in self.outlets:
            context["outlet_events"][asset].extra = summary
        self.log.info("job %s finished: model %s, metrics %s", spec.name, ref.uri, summary["metrics"])
        return summary

    def _finish_in_pool(self, hook: ElasticOpsHook, job: str) -> None:
        """The last chunk released with ``finished=True``; this covers a last chunk that had no
        work (already done) and so held no lease."""
        hook.pool().finish(job)


class ElasticEndJobOperator(JobTaskOperator):
    """The group's teardown: end the run's job in the pool however the chunks ended.

    finalize ends the job when the model is complete, and a chunk whose failure is final ends it
    on the way out; neither runs when a chunk's process was killed on its last try (SIGKILL, the
    OOM killer, a lost worker node) or when finalize itself fails. Without this task such a job
    stayed in the plan, holding slots back from other jobs, until the pool's ``job_idle_s``.
    Airflow runs a teardown once everything upstream is done, in any state, and leaves it out of
    the DAG run's state. Idempotent: a job already finished (or never registered) is left as is.
    """

    ui_color = "#eeeeee"

    def __init__(self, *, heartbeat_interval: float = 2.0, **kwargs: Any) -> None:
        check_seconds("heartbeat_interval", heartbeat_interval)
        super().__init__(**kwargs)
        self.heartbeat_interval = heartbeat_interval  # the chunks' (their lease keepers renew at it)

    def execute(self, context: Context) -> dict[str, Any]:
        try:
            job = self._spec(context).name
        except ElasticOpsError as exc:  # register failed on the same spec: no job was registered
            self.log.info("no job to end: the spec does not render (%s)", exc)
            return {"job": None, "ended": False}
        client = self._hook().pool()
        try:
            self._wait_for_a_quiet_lease(client, job)
            ended = client.finish(job)
        except UnknownJobError:
            self.log.info("job %s is not in the pool; nothing to end", job)
            return {"job": job, "ended": False}
        if ended:
            self.log.warning("job %s was still in the pool's plan after the group's tasks ended (a chunk "
                             "killed on its last try, finalize failed, the run marked failed, or a chunk "
                             "cleared without the tasks after it): ended it", job)
        return {"job": job, "ended": ended}

    def _wait_for_a_quiet_lease(self, client: PoolClient, job: str) -> None:
        """Airflow runs this once the chunk tasks are *marked* done: for a run marked failed,
        before the chunk's process has stopped (its workers train on until its on_kill or its
        death). Ending the job then would give the slots to another job while those workers
        still use them (two jobs on one GPU). So wait while the lease is still being renewed:
        one nobody renewed for ``MISSED_HEARTBEATS`` of the chunks' heartbeat intervals has no
        live holder. At most one lease TTL: by then a lease nobody renews has expired."""
        deadline = None
        while True:
            status = client.status()
            row = next((j for j in status["jobs"] if j["name"] == job), None)
            left = None if row is None else row.get("lease_expires_in")
            if left is None:
                return
            ttl = float(status["settings"]["lease_ttl_s"])
            deadline = deadline or _monotonic() + ttl
            # the keeper renews every min(heartbeat_interval, ttl / 3)
            quiet = MISSED_HEARTBEATS * min(self.heartbeat_interval, ttl / 3)
            renewed_ago = ttl - float(left)
            if renewed_ago >= quiet or _monotonic() >= deadline:
                return
            self.log.info("job %s: a chunk still renews its lease (%.1fs ago); waiting until it stops",
                          job, renewed_ago)
            _sleep(min(quiet - renewed_ago, 2.0))


def final_model(spec: JobSpec, store: CheckpointStore, ref: Any) -> nn.Module:
    """The Trainable's model with the weights of checkpoint ``ref`` (for a tracker to log)."""
    from elastic_ops.runtime import load_trainable

    model = load_trainable(spec.entrypoint, spec.params).build_model()
    model.load_state_dict(store.load(ref)["model"])
    return model.eval()
