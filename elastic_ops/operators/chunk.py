"""``ElasticChunkOperator``: one Airflow task trains one iteration range of an elastic job.

A try is a loop: request a grant (defer to :class:`GrantTrigger` while the pool says wait) →
train it through the hook's :class:`~elastic_ops.executors.ChunkExecutor` with a heartbeating
lease → commit → release (a chunk with a next one hands its slots over to it) → typed XCom result.
A full preemption checkpoints, releases and asks again (never a failure, never a retry).
A lost worker reports the failed host to the pool and raises, so Airflow retries with backoff
on a grant that avoids that host, resuming from the latest committed checkpoint.

Where the chunk trains (the task process, this host's agent, a cluster's node agents) is the
executor's business, chosen once from the environment (:mod:`elastic_ops.executors`). Either way
the runner gets the slots the grant (then every heartbeat) names, so CUDA workers run on those
GPUs, not on the host's first ones; a move to other slots at the same count (a drained host)
relaunches them at the next boundary, and the lease then reports the slots they run on, so the
pool frees the old ones at once. What the try has done travels through deferrals as a
:class:`~elastic_ops.operators.results.ChunkTry`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import TaskDeferred

from elastic_ops.errors import (
    ElasticOpsError,
    LeaseExpiredError,
    LedgerBusyError,
    LedgerUnavailableError,
    SpecError,
    UnknownJobError,
    WaitFailedError,
    WorkerLostError,
)
from elastic_ops.executors.api import ChunkExecutor, ChunkRequest
from elastic_ops.hooks.elastic_ops import DEFAULT_CONN_ID, ElasticOpsHook, default_checkpoint_root
from elastic_ops.links.pool import PoolPageLink
from elastic_ops.operators.lease import LeaseKeeper
from elastic_ops.operators.results import ChunkTaskResult, ChunkTry
from elastic_ops.pool.client import Grant, Wait
from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus
from elastic_ops.spec import JobSpec, check_checkpoint_uri, check_number, stop_metric_missing, stop_reached
from elastic_ops.tracking.api import NO_RUN, JobRun, TrackedJob, Tracking, open_run
from elastic_ops.triggers.events import GrantEvent, TriggerFailure, parse_event
from elastic_ops.triggers.pool import GrantTrigger
from elastic_ops.utils.jobs import (
    check_conn_ids,
    check_seconds,
    chunk_range,
    job_id,
    register,
    runtime_spec,
    safe_name,
)
from elastic_ops.utils.retry import ElasticRetryPolicy, default_to

if TYPE_CHECKING:
    from airflow.sdk import Asset

    from elastic_ops.metrics import Metrics
    from elastic_ops.pool.client import PoolClient

WARM_START_PREVIOUS = "previous"

# the in-task wait for a grant (tests replace them)
_monotonic = time.monotonic
_sleep = time.sleep
# the trigger's first request waits this long after the deferral (GrantTrigger's not_before)
DEFER_SETTLE_S = 5.0


def failed_hosts(client: PoolClient, job: str) -> list[str]:
    """Hosts on which ``job`` failed since it was last registered (``submit``: a rerun of the
    DAG run starts over), from the pool's event log: what a retry must avoid."""
    hosts: set[str] = set()
    for event in client.events(job=job):
        if event.get("kind") == "submit":
            hosts.clear()
        elif event.get("kind") == "failure" and event.get("host"):
            hosts.add(str(event["host"]))
    return sorted(hosts)


def _check_previous_model(uri: object, asset: Asset) -> None:
    """The previous model an Asset event names must be one this group wrote: a checkpoint URI
    under the Asset's own URI. Whoever may post Asset events must not be able to point the job
    at another bucket or directory (read with this job's credentials) to train on from there."""
    root = str(getattr(asset, "uri", "") or "").rstrip("/")
    check_checkpoint_uri("warm_start", uri)  # no '.' or '..' segment: nothing climbs out of the root
    if not root or not str(uri).startswith(root + "/"):
        raise SpecError(
            "warm_start", uri, f"the previous model must lie under the model Asset's URI {root!r}",
            hint="give elastic_training(model_asset=Asset(uri=<the checkpoint root>)) when the "
            "checkpoint URI is a template",
        )


def _stop_text(stop_when: Mapping[str, Any]) -> str:
    bound = "at_least" if "at_least" in stop_when else "at_most"
    return f"stop_when {stop_when['metric']} {'>=' if bound == 'at_least' else '<='} {stop_when[bound]}"


def _metric_text(stop_when: Mapping[str, Any], metrics: Mapping[str, Any]) -> str:
    return f"{stop_when['metric']}={metrics.get(stop_when['metric'])}"


def _try_number(context: Context) -> int | None:
    ti = context.get("ti") if hasattr(context, "get") else None
    number = getattr(ti, "try_number", None)
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def _final_failure(context: Context, exc: BaseException) -> bool:
    """Whether this try's failure ends the task for good: a non-retryable error (the retry
    policy fails it at once) or the last try Airflow allows."""
    if isinstance(exc, ElasticOpsError) and not exc.retryable:
        return True
    ti = context.get("ti") if hasattr(context, "get") else None
    try_number, max_tries = getattr(ti, "try_number", None), getattr(ti, "max_tries", None)
    return isinstance(try_number, int) and isinstance(max_tries, int) and try_number > max_tries


def check_tracking(tracking: object, entrypoint: object = None) -> None:
    if tracking is not None and not isinstance(tracking, Tracking):
        raise SpecError("tracking", tracking, "must be a tracking such as "
                        "elastic_ops.tracking.MlflowTracking(...), or None")
    if tracking is not None and isinstance(entrypoint, str):
        tracking.check_entrypoint(entrypoint)


class ElasticOperatorMixin:
    """Fields and helpers every elastic operator shares (job identity, hook, tracking)."""

    elastic_ops_conn_id: str
    aws_conn_id: str | None
    group_id: str
    spec_fields: dict[str, Any]
    num_chunks: int | None
    tracking: Tracking | None = None
    task_id: str
    log: Any

    def _hook(self) -> ElasticOpsHook:
        return ElasticOpsHook(self.elastic_ops_conn_id, aws_conn_id=self.aws_conn_id)

    def _open_run(self, context: Context, spec: JobSpec) -> JobRun:
        """The job's experiment run for this task (resumed; :data:`NO_RUN` without tracking)."""
        if self.tracking is None:
            return NO_RUN
        job = TrackedJob(spec=spec, dag_id=context["dag"].dag_id, run_id=context["run_id"],
                         group_id=self.group_id, task_id=self.task_id, try_number=_try_number(context))
        return open_run(self.tracking, job, self.log)

    def _spec(self, context: Context) -> JobSpec:
        dag_id = context["dag"].dag_id
        run_id = context["run_id"]
        root = f"{default_checkpoint_root()}/{safe_name(dag_id)}/{safe_name(self.group_id)}"
        return runtime_spec(
            self.spec_fields, name=job_id(dag_id, self.group_id, run_id), checkpoint_root=root,
            run_id=run_id, num_chunks=self.num_chunks,
        )


class ElasticChunkOperator(ElasticOperatorMixin, BaseOperator):
    """Train chunk ``chunk_index`` of the job described by ``spec_fields`` (templated)."""

    template_fields: Sequence[str] = ("spec_fields", "warm_start")
    ui_color = "#c9e4ff"
    operator_extra_links = (PoolPageLink(),)

    def __init__(
        self,
        *,
        spec_fields: dict[str, Any],
        chunk_index: int,
        group_id: str,
        num_chunks: int | None = None,
        warm_start: str | None = None,
        elastic_ops_conn_id: str = DEFAULT_CONN_ID,
        aws_conn_id: str | None = "aws_default",
        poll_interval: float = 1.0,
        heartbeat_interval: float = 2.0,
        defer_after: float = 10.0,
        tracking: Tracking | None = None,
        **kwargs: Any,
    ) -> None:
        check_conn_ids(elastic_ops_conn_id, aws_conn_id)
        check_tracking(tracking, spec_fields.get("entrypoint") if isinstance(spec_fields, dict) else None)
        check_seconds("poll_interval", poll_interval)
        check_seconds("heartbeat_interval", heartbeat_interval)
        check_number("defer_after", defer_after, minimum=0, unit=" of seconds")
        if isinstance(chunk_index, bool) or not isinstance(chunk_index, int) or chunk_index < 0:
            raise SpecError("chunk_index", chunk_index, "must be an integer >= 0")
        default_to(kwargs, retries=3, retry_delay=timedelta(seconds=5), retry_exponential_backoff=2.0,
                   max_retry_delay=timedelta(minutes=10), retry_policy=ElasticRetryPolicy())
        super().__init__(**kwargs)
        self.spec_fields = spec_fields
        self.chunk_index = chunk_index
        self.group_id = group_id
        self.num_chunks = num_chunks
        self.warm_start = warm_start
        self.elastic_ops_conn_id = elastic_ops_conn_id
        self.aws_conn_id = aws_conn_id
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self.defer_after = defer_after
        self.tracking = tracking
        # this process's, for on_kill and the loop: nothing here outlives a deferral
        self._run: JobRun = NO_RUN
        self._executor: ChunkExecutor | None = None
        self._killed = False
        self._running: _Running | None = None
        self._gave_back: frozenset[str] = frozenset()  # hosts whose grant went back for want of a node

    # --- entries -------------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        return self._ending_job_if_final(context, self._first_entry, context)

    def execute_granted(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the :class:`GrantTrigger` fired; all state comes from the event."""
        return self._ending_job_if_final(context, self._resumed, context, event)

    def _ending_job_if_final(self, context: Context, step: Callable[..., dict[str, Any]],
                             *args: object) -> dict[str, Any]:
        """Run ``step``; a failure outside any grant (while deferred, or before asking) that ends
        the task for good ends the job in the pool too, so its demand stops holding slots back."""
        try:
            return step(*args)
        except TaskDeferred:
            raise
        except BaseException as exc:
            if not self._killed and _final_failure(context, exc):
                self._quietly("end the job in the pool", self._end_job, context)
            raise

    def _end_job(self, context: Context) -> None:
        try:
            name = self._spec(context).name
        except ElasticOpsError:  # no valid spec: no job was registered
            return
        self._hook().pool().finish(name)

    def _first_entry(self, context: Context) -> dict[str, Any]:
        spec = self._spec(context)
        start, end = chunk_range(spec, self.chunk_index)
        hook = self._hook()
        chunk = ChunkTry(spec=spec.to_dict(), chunk_index=self.chunk_index, start=start, end=end,
                         started_at=time.time(), warm_start=self._warm_start(context) if start == 0 else None)
        latest = self._executor_of(hook).latest(spec) if start < end else None
        if start >= end or (latest is not None and latest.iteration >= end):
            self.log.info("chunk [%d, %d) of %s already done; nothing to train", start, end, spec.name)
            return chunk.result(status="already_done", checkpoint_uri=latest and latest.uri,
                                now=time.time()).to_dict()
        if latest is not None and latest.iteration <= start and stop_reached(spec.stop_when, latest.metrics):
            self.log.info("job %s stopped at iteration %d (%s met: %s); nothing to train", spec.name,
                          latest.iteration, _stop_text(spec.stop_when),
                          _metric_text(spec.stop_when, latest.metrics))
            return chunk.result(status="stopped", checkpoint_uri=latest.uri, now=time.time()).to_dict()
        self.log.info("%s", self._try_line(context, chunk, latest, hook))
        return self._train_to_the_end(context, chunk, hook)

    def _try_line(self, context: Context, chunk: ChunkTry, latest: Any, hook: ElasticOpsHook) -> str:
        """What the task log (the UI) says as a try starts: where it resumes from and, on a
        retry, why it runs (the previous try's failure as the pool recorded it, and the hosts
        the retry avoids). The agent's and the workers' logs are not where users look."""
        try_number = _try_number(context)
        head = (f"job {chunk.job}: chunk {self.chunk_index + 1} [{chunk.start}, {chunk.end}), "
                f"try {try_number or '?'}")
        if latest is not None:
            frm = f"resumes from the checkpoint at iteration {latest.iteration} ({latest.uri})"
        elif chunk.warm_start:
            frm = f"starts at iteration 0 from the weights of {chunk.warm_start}"
        else:
            frm = "starts from scratch (no checkpoint yet)"
        if not try_number or try_number < 2:
            return f"{head}: {frm}"
        why = "a retry: the previous try failed without blaming a host (its log says why)"
        try:
            ours = f"chunk {self.chunk_index + 1} try {try_number - 1}: "
            failures = hook.pool().events(chunk.job, kinds=["failure"], last=50)
            mine = [e for e in failures if ours in (e.get("reason") or "")]
            if mine:
                cause = mine[-1]["reason"].split(ours, 1)[1]
                avoid = failed_hosts(hook.pool(), chunk.job)
                why = (f"a retry after {cause} on {mine[-1]['host']}; the grant avoids "
                       f"{', '.join(avoid) or mine[-1]['host']}")
        except ElasticOpsError as exc:  # the log line must not fail the try
            why = f"a retry (the pool's record of the previous try is unavailable: {exc})"
        return f"{head}, {why}: {frm}"

    def _resumed(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_event(event)
        if isinstance(parsed, TriggerFailure):
            raise WaitFailedError(f"waiting for a grant failed: {parsed.error_type}: {parsed.error}",
                                  retryable=parsed.retryable)
        assert isinstance(parsed, GrantEvent)  # noqa: S101 - parse_event's contract, not input
        chunk, asked_for = ChunkTry.from_dict(parsed.state).resumed(time.time(), parsed.waited_s)
        hook = self._hook()
        hook.metrics().timing("chunk.wait", asked_for, tags=self._tags(context, parsed.job))
        return self._train_to_the_end(context, chunk, hook, parsed)

    def _train_to_the_end(self, context: Context, chunk: ChunkTry, hook: ElasticOpsHook,
                          grant: GrantEvent | None = None) -> dict[str, Any]:
        """Acquire → train → ask again (preempted, or a grant given back or expired) until the
        chunk is done; a wait the pool cannot end soon defers the task (``TaskDeferred``).
        Every request after this try's first asks ``again``: the job ended in the pool meanwhile
        (its run marked failed, its teardown ran) is not revived."""
        again = grant is not None
        self._run = self._open_run(context, JobSpec.from_dict(chunk.spec))
        failed = True
        try:
            while True:
                if grant is None:
                    grant = self._acquire(context, chunk, hook, again=again)
                step = self._run_granted(context, chunk, grant, hook)
                if isinstance(step, ChunkTaskResult):
                    failed = False
                    return step.to_dict()
                chunk, grant, again = step, None, True
        except TaskDeferred:
            failed = False
            raise
        finally:
            # the task ends or defers (a new process resumes): send what is buffered now
            run, self._run = self._run, NO_RUN
            try:
                run.close()
            except ElasticOpsError:  # a strict tracking's; never in place of the try's own error
                if not failed:
                    raise

    def _executor_of(self, hook: ElasticOpsHook) -> ChunkExecutor:
        """Where this process's grants train: chosen once, from the environment."""
        if self._executor is None:
            self._executor = hook.executor(self.log)
        return self._executor

    def _tags(self, context: Context, job: str) -> dict[str, str]:
        """What a chunk's metrics are tagged with."""
        return {"job": job, "dag_id": context["dag"].dag_id, "task_id": self.task_id}

    # --- steps -----------------------------------------------------------------------------

    def _warm_start(self, context: Context) -> str | None:
        if self.warm_start != WARM_START_PREVIOUS:
            return self.warm_start or None
        for asset in self.inlets:
            events = context["inlet_events"][asset]
            if hasattr(events, "ascending"):  # Airflow's accessor: fetch the newest event only
                events = events.ascending(False).limit(1)
                newest = events[0] if len(events) else None
            else:  # a plain sequence, oldest first
                newest = events[-1] if len(events) else None
            if newest is not None:
                uri = (newest.extra or {}).get("checkpoint_root")
                _check_previous_model(uri, asset)
                self.log.info("warm start from the previous model %s", uri)
                return uri
        self.log.info("no previous model yet; cold start")
        return None

    def _acquire(self, context: Context, chunk: ChunkTry, hook: ElasticOpsHook, *, again: bool) -> GrantEvent:
        """Ask the pool for workers: the grant, after a wait in the task if it comes soon; else
        defer (raises ``TaskDeferred``) until the :class:`GrantTrigger` sees it granted."""
        job = chunk.job
        asked = time.time()
        client = hook.pool()
        avoid = failed_hosts(client, job)
        if avoid:
            self.log.info("job %s avoids hosts that failed it: %s", job, ", ".join(avoid))
        down = self._executor_of(hook).avoid_hosts()
        if down:  # e.g. a chunk can only train where a node agent runs
            self.log.info("job %s avoids hosts with no live node agent: %s", job, ", ".join(down))
            avoid = sorted(set(avoid) | set(down))
        # new_attempt: a lease the job still holds is an earlier try's; it is re-issued under a
        # new epoch, which run_chunk fences the store with, so that try can no longer commit
        try:
            outcome = client.request(job, avoid_hosts=tuple(avoid), new_attempt=not again)
        except UnknownJobError:  # register was skipped or the ledger was reset: register again
            register(client, JobSpec.from_dict(chunk.spec), context["dag"].dag_id)
            outcome = client.request(job, avoid_hosts=tuple(avoid), new_attempt=not again)
        outcome = self._wait_in_task(client, job, avoid, outcome)
        if isinstance(outcome, Grant):
            hook.metrics().timing("chunk.wait", time.time() - asked, tags=self._tags(context, job))
            return GrantEvent.from_grant(outcome, chunk.to_dict())
        if self._killed:
            # on_kill came while this try asked (nothing ran for it to release): end the job as it
            # does for a running chunk, rather than defer a try that is being killed
            self._quietly("end the job in the pool", client.finish, job)
            raise LeaseExpiredError(f"job {job}: its task is being killed while it waited for workers")
        bound = (f"for at most execution_timeout ({self.execution_timeout}) in all" if self.execution_timeout
                 else "with no bound (the task sets no execution_timeout)")
        self.log.info("job %s waits for workers (%s); deferring, %s", job, outcome.reason, bound)
        deferred = dataclasses.replace(chunk, deferred_at=time.time(), asked_at=asked)
        raise TaskDeferred(
            trigger=GrantTrigger(job=job, ledger_url=hook.ledger_url(), state=deferred.to_dict(),
                                 avoid_hosts=avoid, poll_interval=self.poll_interval,
                                 not_before=deferred.deferred_at + DEFER_SETTLE_S),
            method_name="execute_granted",
            # a demand the pool cannot meet (min_workers above what its hosts hold) would wait
            # forever: the task's execution_timeout bounds the wait too (None: no bound)
            timeout=self.execution_timeout,
        )

    def _wait_in_task(
        self, client: PoolClient, job: str, avoid: list[str], outcome: Grant | Wait
    ) -> Grant | Wait:
        """Keep asking, every ``poll_interval``, for up to ``defer_after`` seconds before deferring.

        Most waits end at another job's next iteration boundary, a heartbeat or two away. A
        deferral costs a new task process on resume and, in Airflow 3.3, a grant that comes
        within seconds of the deferral can meet apache/airflow#72716: the scheduler reads the
        deferring process's stale exit as the resumed try's and fails it (a retry burnt)."""
        deadline = _monotonic() + self.defer_after
        while (not isinstance(outcome, Grant) and not self._killed
               and _monotonic() + self.poll_interval <= deadline):
            _sleep(self.poll_interval)
            try:
                outcome = client.request(job, avoid_hosts=tuple(avoid))
            except (LedgerBusyError, LedgerUnavailableError) as exc:  # as the trigger does: wait on
                self.log.info("job %s: the pool is busy or unreachable (%s); still waiting", job, exc)
        return outcome

    def _run_granted(
        self, context: Context, chunk: ChunkTry, grant: GrantEvent, hook: ElasticOpsHook
    ) -> ChunkTry | ChunkTaskResult:
        """Train on ``grant``: the task's result, or the try to ask again with (preempted, or the
        grant given back or expired before it trained)."""
        spec = JobSpec.from_dict(chunk.spec)
        client = hook.pool()
        executor = self._executor_of(hook)
        host = executor.host_of(grant.placements)
        if self._killed:
            # on_kill came before this grant was trained on (while the try asked, or resumed): it
            # found nothing running to release, so give the grant back here and end the job,
            # rather than train on slots until the process is killed and hold them until the TTL
            self.log.warning("job %s: the task is being killed; giving the grant of epoch %d back untrained",
                             spec.name, grant.epoch)
            self._quietly("release the lease", self._release, client, spec.name, grant.epoch, finished=True)
            raise LeaseExpiredError(f"job {spec.name}: its task is being killed; the grant of epoch "
                                    f"{grant.epoch} was given back untrained")
        if host not in self._gave_back and not executor.can_train_on(host):
            # its node went away while this task waited (the avoid list was taken when it asked):
            # not the host's failure and not a try's; give the grant back and ask again, avoiding
            # it. Once per host: granted it again (no other host can hold the job), the chunk is
            # sent there and fails as a host without a node does (NodeUnavailableError)
            self.log.warning("job %s: host %s has no live node agent any more; asking again", spec.name, host)
            self._gave_back = self._gave_back | {host}
            self._release(client, spec.name, grant.epoch)
            return chunk
        self.log.info("job %s: chunk [%d, %d) on %d workers on %s (epoch %d)", spec.name,
                      chunk.start, chunk.end, grant.workers, ", ".join(grant.hosts), grant.epoch)
        metrics, tags = hook.metrics(), self._tags(context, spec.name)
        keeper = LeaseKeeper(client, spec.name, grant.epoch, grant.workers,
                             interval_s=min(self.heartbeat_interval, grant.ttl_s / 3), ttl_s=grant.ttl_s,
                             placements=grant.placements, host=host, metrics=metrics, tags=tags,
                             tracker=self._run)
        keeper.beat()  # renew now: a grant the task resumed too late for (past its TTL) is gone
        if keeper.lost:
            self.log.warning("job %s: the grant of epoch %d expired before this task resumed; asking again",
                             spec.name, grant.epoch)
            return chunk
        keeper.start()
        self._run.granted(grant.epoch, grant.workers, tuple(grant.hosts))
        metrics.gauge("chunk.workers", grant.workers, tags=tags)
        request = ChunkRequest(spec, chunk.start, chunk.end, grant.epoch, host, chunk.warm_start)
        self._running = _Running(keeper, client, spec.name, grant.epoch)  # for on_kill (this try only)
        try:
            if self._killed:  # on_kill came while the grant was renewed above
                raise LeaseExpiredError(f"job {spec.name}: its task is being killed; the grant of epoch "
                                        f"{grant.epoch} was given back untrained")
            result = executor.run(request, keeper)
        except BaseException as exc:
            keeper.stop()
            self._failed(context, exc, request, client, metrics, tags)
            raise
        finally:
            self._running = None
        keeper.stop()
        where = executor.trained_on(host, keeper)
        before, chunk = chunk, chunk.after(grant.epoch, grant.hosts, where, result)
        metrics.gauge("chunk.workers", 0, tags=tags)
        metrics.incr("chunk.iterations", chunk.trained - before.trained, tags=tags)
        metrics.gauge("chunk.samples_per_s", float(result.samples_per_sec or 0.0), tags=tags)
        self._run.chunk_ended(self.chunk_index, result)
        if result.status == ChunkStatus.PREEMPTED:
            return self._preempted(chunk, result, client, grant.epoch, metrics, tags)
        return self._done(spec, chunk, result, client, grant.epoch)

    def _failed(self, context: Context, exc: BaseException, request: ChunkRequest, client: PoolClient,
                metrics: Metrics, tags: dict[str, str]) -> None:
        """Clean-up after a grant's training raised ``exc``: a lost worker's host is reported (so
        the retry's grant avoids it); the lease goes back, ending the job if this failure is final."""
        job, epoch = request.spec.name, request.epoch
        final = not self._killed and _final_failure(context, exc)
        lost = isinstance(exc, WorkerLostError) and not self._killed
        self._run.failed(exc, host=(exc.host or request.host) if lost else None, final=final)
        # workers killed with the task are not the host's failure
        if lost:
            failed = exc.host or request.host
            self.log.error("job %s: host %s failed the chunk: %s", job, failed, exc)
            # 1-based, as the task ids number chunks (chunk_02_of_05)
            number, said = _try_number(context) or "?", getattr(exc, "message", exc)  # without the hint
            cause = f"chunk {self.chunk_index + 1} try {number}: {type(exc).__name__}: {said}"
            self._quietly("report the failed host", client.report_failure, job, failed, cause)
            metrics.incr("chunk.host_failures", tags={**tags, "host": failed})
        metrics.gauge("chunk.workers", 0, tags=tags)
        if final:
            self.log.info("job %s: this failure is final; ending the job in the pool", job)
        # killed: on_kill ended the job already (this release finds the lease gone)
        self._quietly("release the lease", self._release, client, job, epoch, finished=final or self._killed)

    def _preempted(self, chunk: ChunkTry, result: ChunkResult, client: PoolClient, epoch: int,
                   metrics: Metrics, tags: dict[str, str]) -> ChunkTry:
        """A full preemption: the state at ``result.iteration`` is committed; give the lease back
        and ask again (the checkpoint it just wrote is where it resumes)."""
        metrics.incr("chunk.preemptions", tags=tags)
        self._run.preempted(result.iteration)
        self._release(client, chunk.job, epoch)
        if self._killed:  # on_kill took the lease: the task is ending
            # retryable: Airflow also kills a try on a worker's graceful shutdown or lost
            # heartbeats, and a retry resumes from the checkpoint this stop committed
            raise LeaseExpiredError(f"job {chunk.job}: chunk stopped at iteration {result.iteration}: "
                                    "its task is being killed and gave its lease back")
        self.log.info("job %s preempted at iteration %d; waiting for workers again", chunk.job,
                      result.iteration)
        return dataclasses.replace(chunk, preemptions=chunk.preemptions + 1, warm_start=None)

    def _done(self, spec: JobSpec, chunk: ChunkTry, result: ChunkResult, client: PoolClient,
              epoch: int) -> ChunkTaskResult:
        """Trained to the end (or stopped by ``stop_when``): hand the slots over or end the job."""
        last = chunk.end >= spec.total_iterations
        ends = {"loss": result.loss, **dict(result.metrics or {})}
        stopping = not last and stop_reached(spec.stop_when, ends)
        if result.status == ChunkStatus.COMPLETED and (missing := stop_metric_missing(spec.stop_when, ends)):
            self.log.warning("job %s: %s", spec.name, missing)
        if stopping:
            self.log.info("job %s: %s met at iteration %d (%s): the job stops here, the following chunks "
                          "train nothing", spec.name, _stop_text(spec.stop_when), result.iteration,
                          _metric_text(spec.stop_when, ends))
        # not the last chunk: the slots wait, parked, for the next chunk task, which runs on them
        # again (the pool may still take them meanwhile); released, a new grant may land elsewhere.
        # The last chunk, or one that met stop_when, ends the job: its slots go back at once
        done = last or stopping
        self._release(client, spec.name, epoch, finished=done, handover=not done)
        out = chunk.result(status=result.status.value, checkpoint_uri=result.checkpoint_uri, now=time.time(),
                           result=result)
        self.log.info("job %s: chunk [%d, %d) done: loss=%s %.0f samples/s, checkpoint %s",
                      spec.name, out.start, out.end, out.loss, out.samples_per_sec, out.checkpoint_uri)
        return out

    def on_kill(self) -> None:
        """Airflow is killing this try (mark failed, clear, timeout): give the slots back now
        rather than when the lease's TTL runs out, and end the job in the pool, so that its
        demand does not hold slots back from other jobs (a run marked failed never asks again;
        a cleared or retried chunk's next request makes the job wait again). The workers stop
        at once where an agent runs them (it sees the task's connection close), else with the
        task's process; a worker lost that way is not the host's fault, and a chunk that stops
        at a boundary because its lease went does not ask for workers again."""
        self._killed = True
        # the agent (per-host or node) kills the workers now: they stopped only with the task's
        # process, seconds later, training on slots the pool had already given to another job
        if self._executor is not None:
            self._executor.abort()
        running = self._running
        if running is None:
            return
        running.keeper.stop()
        self._quietly("release the lease", self._release, running.client, running.job, running.epoch,
                      finished=True)

    def _quietly(self, what: str, fn: Callable[..., Any], *args: object, **kwargs: object) -> None:
        """Clean-up that must not replace the error being raised (the pool's own safety net,
        the lease TTL, still returns the slots)."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("could not %s (%s: %s); the lease TTL returns the slots", what,
                             type(exc).__name__, exc)

    def _release(
        self, client: PoolClient, job: str, epoch: int, finished: bool = False, handover: bool = False
    ) -> None:
        try:
            client.release(job, epoch, finished=finished, handover=handover)
        except LeaseExpiredError:
            self.log.info("job %s: lease of epoch %d already gone", job, epoch)


@dataclasses.dataclass(frozen=True)
class _Running:
    """The lease a grant trains under, for ``on_kill`` (same process, same try)."""

    keeper: LeaseKeeper
    client: PoolClient
    job: str
    epoch: int
