"""``ElasticChunkOperator``: one Airflow task trains one iteration range of an elastic job.

A try: request a grant (defer to :class:`GrantTrigger` while the pool says wait) → run the
chunk through the runtime with a heartbeating lease → commit → release (a chunk with a next one
hands its slots over to it) → typed XCom result.
A full preemption checkpoints, releases and defers again (never a failure, never a retry).
A lost worker reports the failed host to the pool and raises, so Airflow retries with backoff
on a grant that avoids that host, resuming from the latest committed checkpoint.

Where the chunk trains: in a cluster (``ELASTIC_OPS_NODE_REDIS_URL`` set), on the node agent of
the host the pool granted (:mod:`elastic_ops.agent.node`), whichever machine runs this task;
hosts without a live node agent are avoided when the task asks, and a granted host whose node
does not take the chunk is reported like a host whose workers died, so the retry's grant avoids
it. A grant across hosts trains one process group over them when the leading node advertises an
address (``elastic-ops node --advertise-addr``; :mod:`elastic_ops.agent.span`). Otherwise,
with ``ELASTIC_OPS_AGENT_SOCKET`` set (the per-host agent, :mod:`elastic_ops.agent`), the task
sends the chunk to the agent, forwards the lease's target to it and logs its progress; the
agent's error comes back as the same ``elastic_ops.errors`` class, so retry classification is
unchanged. Without it, or when no agent answers there, the chunk runs
in the task process (the log says which). The agent path never imports torch in the task.
Either way the runner gets the slots the grant (then every heartbeat) names on this task's host,
so CUDA workers run on those GPUs, not on the host's first ones; a move to other slots at the same
count (a drained host) relaunches them at the next boundary, and the lease then reports the slots
they run on, so the pool frees the old ones at once.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import TaskDeferred

from elastic_ops.agent.cluster import node_config_from_env
from elastic_ops.agent.protocol import AGENT_SOCKET_ENV, AgentUnavailableError
from elastic_ops.agent.protocol import agent_socket_from_env as agent_socket
from elastic_ops.errors import (
    AgentLostError,
    ElasticOpsError,
    LeaseExpiredError,
    LedgerBusyError,
    LedgerUnavailableError,
    NodeUnavailableError,
    SpecError,
    UnknownJobError,
    WaitFailedError,
    WorkerLostError,
)
from elastic_ops.hooks.elastic_ops import DEFAULT_CONN_ID, ElasticOpsHook, default_checkpoint_root
from elastic_ops.operators.jobs import (
    check_conn_ids,
    check_seconds,
    chunk_range,
    job_id,
    register,
    runtime_spec,
    safe_name,
)
from elastic_ops.operators.lease import LeaseKeeper
from elastic_ops.operators.links import PoolPageLink
from elastic_ops.operators.progress import progress_logger
from elastic_ops.operators.results import ChunkTaskResult
from elastic_ops.operators.retry import ElasticRetryPolicy, default_to
from elastic_ops.runtime.outcome import ChunkStatus
from elastic_ops.spec import JobSpec, check_checkpoint_uri, check_number, stop_metric_missing, stop_reached
from elastic_ops.triggers.events import GrantEvent, TriggerFailure, parse_event
from elastic_ops.triggers.pool import GrantTrigger

WARM_START_PREVIOUS = "previous"

# the in-task wait for a grant (tests replace them)
_monotonic = time.monotonic
_sleep = time.sleep
# the trigger's first request waits this long after the deferral (GrantTrigger's not_before)
DEFER_SETTLE_S = 5.0


_UNASKED = object()  # no node agent answered the "already done?" question


def busiest_host(placements: Sequence[tuple[str, int]]) -> str:
    """The host holding most of ``placements`` (the first of those tied, in grant order)."""
    counts: dict[str, int] = {}
    for host, _ in placements:
        counts[host] = counts.get(host, 0) + 1
    return max(counts, key=counts.__getitem__)  # dicts keep insertion order: ties go to the first


def node_target(keeper: Any, min_workers: int, span: bool = False) -> int:
    """The pool's target as a node agent can follow it. A node that leads segments spanning
    hosts (``span``: started with ``--advertise-addr``) follows all of it while it holds at least
    one slot of it on its own host (rank 0 runs there; the other hosts' nodes run the rest). A
    node that does not starts workers on its own host only: at most the job's slots there. Fewer
    there than ``min_workers``, or none (the pool moved the job off this host, e.g. a drain) → 0:
    the chunk commits at its next boundary, gives the lease back and asks again, and its new
    grant trains on the other host's node."""
    wanted = keeper.wanted()
    here = len(keeper.slots())  # the slots of the very target wanted() returned
    if wanted <= here or (span and here >= 1):
        return wanted
    return here if here >= min_workers else 0


def hosts_without_node(client: Any, nodes: Any) -> list[str]:
    """The pool's hosts that no node agent of the cluster announces (not started, stopped, dead
    for 10 s, or of another protocol version): a grant there could not train."""
    from elastic_ops.agent.node_client import NodeClient

    names = [h["name"] for h in client.status()["hosts"]]
    live = NodeClient(nodes).live_hosts(names)
    return [n for n in names if n not in live]


def failed_hosts(client: Any, job: str) -> list[str]:
    """Hosts on which ``job`` failed since it was last registered (``submit``: a rerun of the
    DAG run starts over), from the pool's event log: what a retry must avoid."""
    hosts: set[str] = set()
    for event in client.events(job=job):
        if event.get("kind") == "submit":
            hosts.clear()
        elif event.get("kind") == "failure" and event.get("host"):
            hosts.add(str(event["host"]))
    return sorted(hosts)


def _check_previous_model(uri: Any, asset: Any) -> None:
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


def _stop_text(stop_when: Any) -> str:
    bound = "at_least" if "at_least" in stop_when else "at_most"
    return f"stop_when {stop_when['metric']} {'>=' if bound == 'at_least' else '<='} {stop_when[bound]}"


def _metric_text(stop_when: Any, metrics: Any) -> str:
    return f"{stop_when['metric']}={metrics.get(stop_when['metric'])}"


def _final_failure(context: Any, exc: BaseException) -> bool:
    """Whether this try's failure ends the task for good: a non-retryable error (the retry
    policy fails it at once) or the last try Airflow allows."""
    if isinstance(exc, ElasticOpsError) and not exc.retryable:
        return True
    ti = context.get("ti") if hasattr(context, "get") else None
    try_number, max_tries = getattr(ti, "try_number", None), getattr(ti, "max_tries", None)
    return isinstance(try_number, int) and isinstance(max_tries, int) and try_number > max_tries


class ElasticOperatorMixin:
    """Fields and helpers every elastic operator shares (job identity, hook)."""

    elastic_ops_conn_id: str
    aws_conn_id: str | None
    group_id: str
    spec_fields: dict[str, Any]
    num_chunks: int | None

    def _hook(self) -> ElasticOpsHook:
        return ElasticOpsHook(self.elastic_ops_conn_id, aws_conn_id=self.aws_conn_id)

    def _spec(self, context: Any) -> JobSpec:
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
        **kwargs: Any,
    ) -> None:
        check_conn_ids(elastic_ops_conn_id, aws_conn_id)
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

    # --- first entry -----------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        return self._ending_job_if_final(context, self._first_entry, context)

    def _ending_job_if_final(self, context: Any, step: Any, *args: Any) -> dict[str, Any]:
        """Run ``step``; a failure outside any grant (while deferred, or before asking) that ends
        the task for good ends the job in the pool too, so its demand stops holding slots back."""
        try:
            return step(*args)
        except TaskDeferred:
            raise
        except BaseException as exc:
            if not getattr(self, "_killed", False) and _final_failure(context, exc):
                self._quietly("end the job in the pool", self._end_job, context)
            raise

    def _end_job(self, context: Any) -> None:
        try:
            name = self._spec(context).name
        except ElasticOpsError:  # no valid spec: no job was registered
            return
        self._hook().pool().finish(name)

    def _first_entry(self, context: Any) -> dict[str, Any]:
        spec = self._spec(context)
        start, end = chunk_range(spec, self.chunk_index)
        hook = self._hook()
        state = {
            "spec": spec.to_dict(), "chunk_index": self.chunk_index, "start": start, "end": end,
            "warm_start": self._warm_start(context) if start == 0 else None,
            "preemptions": 0, "timeline": [], "epochs": [],
            "hosts": [], "trained": 0, "waited_s": 0.0, "started_at": time.time(),
        }
        latest = self._latest(hook, spec) if start < end else None
        if start >= end or (latest is not None and latest[0] >= end):
            self.log.info("chunk [%d, %d) of %s already done; nothing to train", start, end, spec.name)
            return self._result(state, status="already_done", checkpoint_uri=latest and latest[1]).to_dict()
        if latest is not None and latest[0] <= start and stop_reached(spec.stop_when, latest[2]):
            self.log.info("job %s stopped at iteration %d (%s met: %s); nothing to train", spec.name,
                          latest[0], _stop_text(spec.stop_when), _metric_text(spec.stop_when, latest[2]))
            return self._result(state, status="stopped", checkpoint_uri=latest[1]).to_dict()
        return self._acquire(context, state, hook)

    def execute_granted(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the :class:`GrantTrigger` fired; all state comes from the event."""
        return self._ending_job_if_final(context, self._resumed, context, event)

    def _resumed(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_event(event)
        if isinstance(parsed, TriggerFailure):
            raise WaitFailedError(f"waiting for a grant failed: {parsed.error_type}: {parsed.error}",
                                  retryable=parsed.retryable)
        assert isinstance(parsed, GrantEvent)  # noqa: S101 - parse_event's contract, not input
        state = dict(parsed.state)
        # From the deferral (not the trigger's start, which the triggerer may pick up late) to now.
        deferred_at = state.pop("deferred_at", None)
        asked_at = state.pop("asked_at", deferred_at)
        waited = time.time() - float(deferred_at) if deferred_at is not None else parsed.waited_s
        state["waited_s"] = float(state.get("waited_s", 0.0)) + max(0.0, waited)
        hook = self._hook()
        asked_for = time.time() - float(asked_at) if asked_at is not None else waited
        hook.metrics().timing("chunk.wait", max(0.0, asked_for), tags=self._tags(context, parsed.job))
        return self._run_granted(context, state, parsed, hook)

    def _tags(self, context: Any, job: str) -> dict[str, str]:
        """What a chunk's metrics are tagged with."""
        return {"job": job, "dag_id": context["dag"].dag_id, "task_id": self.task_id}

    # --- steps -----------------------------------------------------------------------------

    def _warm_start(self, context: Any) -> str | None:
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

    def _latest(self, hook: ElasticOpsHook, spec: JobSpec) -> tuple[int, str, dict[str, Any]] | None:
        """The latest committed checkpoint of the job: ``(iteration, uri, metrics)``, or None."""
        nodes = node_config_from_env()
        if nodes is not None:  # ask a node agent: opening a store here would import torch
            latest = self._latest_on_a_node(hook, spec, nodes)
            if latest is not _UNASKED:
                return latest
        path = agent_socket()
        if path is not None:  # ask the agent: opening a store here would import torch
            from elastic_ops.agent.client import AgentClient

            try:
                store = hook.store_config(spec.checkpoint_uri(), keep_last=spec.keep_last,
                                          keep_every=spec.keep_every)
                return AgentClient(path).latest(store, spec.spec_hash())
            except AgentUnavailableError as exc:
                self.log.warning("%s; reading the checkpoint store in this task process", exc)
        store = hook.store(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)
        ref = store.latest(spec_hash=spec.spec_hash(), decode=False)
        return None if ref is None else (ref.iteration, ref.uri, dict(ref.metrics))

    def _latest_on_a_node(self, hook: ElasticOpsHook, spec: JobSpec, nodes: Any) -> Any:
        """The latest checkpoint ``(iteration, uri, metrics)`` or ``None``, as a live node agent reads the
        store (the store is shared: every node sees the same checkpoints); ``_UNASKED`` when no
        node could answer (the task then reads the store itself)."""
        from elastic_ops.agent.node_client import NodeClient

        try:
            client = NodeClient(nodes)
            live = sorted(client.live_hosts([h["name"] for h in hook.pool().status()["hosts"]]))
            if live:
                store = hook.store_config(spec.checkpoint_uri(), keep_last=spec.keep_last,
                                          keep_every=spec.keep_every)
                return client.latest(live[0], store, spec.spec_hash())
            self.log.warning("no node agent is live; reading the checkpoint store in this task process")
        except (NodeUnavailableError, AgentLostError) as exc:
            self.log.warning("%s; reading the checkpoint store in this task process", exc)
        return _UNASKED

    def _acquire(
        self, context: Any, state: dict[str, Any], hook: ElasticOpsHook, *, again: bool = False
    ) -> dict[str, Any]:
        """Ask the pool for workers: train if granted, else wait (in the task, then deferred).
        ``again``: this try asks once more (preempted, a grant given back or expired): a job
        ended in the pool meanwhile (its run marked failed, its teardown ran) is not revived."""
        job = state["spec"]["name"]
        asked = time.time()
        client = hook.pool()
        avoid = failed_hosts(client, job)
        if avoid:
            self.log.info("job %s avoids hosts that failed it: %s", job, ", ".join(avoid))
        nodes = node_config_from_env()
        if nodes is not None:  # a chunk can only train where a node agent runs
            down = hosts_without_node(client, nodes)
            if down:
                self.log.info("job %s avoids hosts with no live node agent: %s", job, ", ".join(down))
                avoid = sorted(set(avoid) | set(down))
        # new_attempt: a lease the job still holds is an earlier try's; it is re-issued under a
        # new epoch, which run_chunk fences the store with, so that try can no longer commit
        try:
            outcome = client.request(job, avoid_hosts=tuple(avoid), new_attempt=not again)
        except UnknownJobError:  # register was skipped or the ledger was reset: register again
            register(client, JobSpec.from_dict(state["spec"]))
            outcome = client.request(job, avoid_hosts=tuple(avoid), new_attempt=not again)
        outcome = self._wait_in_task(client, job, avoid, outcome)
        if getattr(self, "_killed", False) and not hasattr(outcome, "epoch"):
            # on_kill came while this try asked (nothing ran for it to release): end the job as it
            # does for a running chunk, rather than defer a try that is being killed
            self._quietly("end the job in the pool", client.finish, job)
            raise LeaseExpiredError(f"job {job}: its task is being killed while it waited for workers")
        if hasattr(outcome, "epoch"):
            hook.metrics().timing("chunk.wait", time.time() - asked, tags=self._tags(context, job))
            return self._run_granted(context, state, GrantEvent.from_grant(outcome, state), hook)
        bound = (f"for at most execution_timeout ({self.execution_timeout}) in all" if self.execution_timeout
                 else "with no bound (the task sets no execution_timeout)")
        self.log.info("job %s waits for workers (%s); deferring, %s", job, getattr(outcome, "reason", ""),
                      bound)
        state = {**state, "deferred_at": time.time(), "asked_at": asked}
        self.defer(
            trigger=GrantTrigger(job=job, ledger_url=hook.ledger_url(), state=state,
                                 avoid_hosts=avoid, poll_interval=self.poll_interval,
                                 not_before=state["deferred_at"] + DEFER_SETTLE_S),
            method_name="execute_granted",
            # a demand the pool cannot meet (min_workers above what its hosts hold) would wait
            # forever: the task's execution_timeout bounds the wait too (None: no bound)
            timeout=self.execution_timeout,
        )

    def _wait_in_task(self, client: Any, job: str, avoid: list[str], outcome: Any) -> Any:
        """Keep asking, every ``poll_interval``, for up to ``defer_after`` seconds before deferring.

        Most waits end at another job's next iteration boundary, a heartbeat or two away. A
        deferral costs a new task process on resume and, in Airflow 3.3, a grant that comes
        within seconds of the deferral can meet apache/airflow#72716: the scheduler reads the
        deferring process's stale exit as the resumed try's and fails it (a retry burnt)."""
        deadline = _monotonic() + self.defer_after
        while (not hasattr(outcome, "epoch") and not getattr(self, "_killed", False)
               and _monotonic() + self.poll_interval <= deadline):
            _sleep(self.poll_interval)
            try:
                outcome = client.request(job, avoid_hosts=tuple(avoid))
            except (LedgerBusyError, LedgerUnavailableError) as exc:  # as the trigger does: wait on
                self.log.info("job %s: the pool is busy or unreachable (%s); still waiting", job, exc)
        return outcome

    def _run_granted(
        self, context: Any, state: dict[str, Any], grant: GrantEvent, hook: ElasticOpsHook
    ) -> dict[str, Any]:
        spec = JobSpec.from_dict(state["spec"])
        client = hook.pool()
        nodes = node_config_from_env()
        # it trains on (spanning hosts: is led by) the node of the host holding most of the grant
        host = busiest_host(grant.placements) if nodes else grant.placements[0][0]
        if getattr(self, "_killed", False):
            # on_kill came before this grant was trained on (while the try asked, or resumed): it
            # found nothing running to release, so give the grant back here and end the job,
            # rather than train on slots until the process is killed and hold them until the TTL
            self.log.warning("job %s: the task is being killed; giving the grant of epoch %d back untrained",
                             spec.name, grant.epoch)
            self._quietly("release the lease", self._release, client, spec.name, grant.epoch, finished=True)
            raise LeaseExpiredError(f"job {spec.name}: its task is being killed; the grant of epoch "
                                    f"{grant.epoch} was given back untrained")
        gave_back = getattr(self, "_gave_back", set())  # this process's: nothing here outlives a deferral
        if nodes is not None and host not in gave_back and not self._node_is_live(nodes, host):
            # its node went away while this task waited (the avoid list was taken when it asked):
            # not the host's failure and not a try's; give the grant back and ask again, avoiding
            # it. Once per host: granted it again (no other host can hold the job), the chunk is
            # sent there and fails as a host without a node does (NodeUnavailableError)
            self.log.warning("job %s: host %s has no live node agent any more; asking again", spec.name, host)
            self._gave_back = gave_back | {host}
            self._release(client, spec.name, grant.epoch)
            return self._acquire(context, state, hook, again=True)
        self.log.info("job %s: chunk [%d, %d) on %d workers on %s (epoch %d)", spec.name,
                      state["start"], state["end"], grant.workers, ", ".join(grant.hosts), grant.epoch)
        metrics, tags = hook.metrics(), self._tags(context, spec.name)
        keeper = LeaseKeeper(client, spec.name, grant.epoch, grant.workers,
                             interval_s=min(self.heartbeat_interval, grant.ttl_s / 3), ttl_s=grant.ttl_s,
                             placements=grant.placements, host=host, metrics=metrics, tags=tags)
        keeper.beat()  # renew now: a grant the task resumed too late for (past its TTL) is gone
        if keeper.lost:
            self.log.warning("job %s: the grant of epoch %d expired before this task resumed; asking again",
                             spec.name, grant.epoch)
            return self._acquire(context, state, hook, again=True)
        keeper.start()
        metrics.gauge("chunk.workers", grant.workers, tags=tags)
        # for on_kill only (same process, same try): nothing here outlives a deferral
        self._running = (keeper, client, spec.name, grant.epoch)
        try:
            if getattr(self, "_killed", False):  # on_kill came while the grant was renewed above
                raise LeaseExpiredError(f"job {spec.name}: its task is being killed; the grant of epoch "
                                        f"{grant.epoch} was given back untrained")
            result = self._train(spec, state, grant.epoch, host, keeper, hook)
        except BaseException as exc:
            keeper.stop()
            killed = getattr(self, "_killed", False)
            if isinstance(exc, WorkerLostError) and not killed:  # workers killed with the task: not the host
                failed = exc.host or host
                self.log.error("job %s: host %s failed the chunk: %s", spec.name, failed, exc)
                self._quietly("report the failed host", client.report_failure, spec.name, failed)
                metrics.incr("chunk.host_failures", tags={**tags, "host": failed})
            metrics.gauge("chunk.workers", 0, tags=tags)
            final = not killed and _final_failure(context, exc)
            if final:
                self.log.info("job %s: this failure is final; ending the job in the pool", spec.name)
            # killed: on_kill ended the job already (this release finds the lease gone)
            self._quietly("release the lease", self._release, client, spec.name, grant.epoch,
                          finished=final or killed)
            raise
        finally:
            self._running = None
        keeper.stop()
        trained_before = int(state["trained"])
        state = self._account(state, grant, result)
        where = {host} | keeper.hosts_used if nodes is not None else {socket.gethostname()}
        state["trained_on"] = sorted(set(state.get("trained_on", [])) | where)
        metrics.gauge("chunk.workers", 0, tags=tags)
        metrics.incr("chunk.iterations", int(state["trained"]) - trained_before, tags=tags)
        metrics.gauge("chunk.samples_per_s", float(result.samples_per_sec or 0.0), tags=tags)
        if result.status == ChunkStatus.PREEMPTED:
            metrics.incr("chunk.preemptions", tags=tags)
            self._release(client, spec.name, grant.epoch)
            state["preemptions"] += 1
            state["warm_start"] = None  # the checkpoint it just wrote is where it resumes
            if getattr(self, "_killed", False):  # on_kill took the lease: the task is ending
                # retryable: Airflow also kills a try on a worker's graceful shutdown or lost
                # heartbeats, and a retry resumes from the checkpoint this stop committed
                raise LeaseExpiredError(f"job {spec.name}: chunk stopped at iteration {result.iteration}: "
                                        "its task is being killed and gave its lease back")
            self.log.info("job %s preempted at iteration %d; waiting for workers again",
                          spec.name, result.iteration)
            return self._acquire(context, state, hook, again=True)
        last = state["end"] >= spec.total_iterations
        ends = {"loss": getattr(result, "loss", None), **dict(getattr(result, "metrics", None) or {})}
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
        self._release(client, spec.name, grant.epoch, finished=done, handover=not done)
        out = self._result(state, status=result.status.value,
                           checkpoint_uri=result.checkpoint_uri, result=result)
        self.log.info("job %s: chunk [%d, %d) done: loss=%s %.0f samples/s, checkpoint %s",
                      spec.name, out.start, out.end, out.loss, out.samples_per_sec, out.checkpoint_uri)
        return out.to_dict()

    @staticmethod
    def _node_is_live(nodes: Any, host: str) -> bool:
        from elastic_ops.agent.node_client import NodeClient

        return host in NodeClient(nodes).live_hosts([host])

    def _train(self, spec: JobSpec, state: dict[str, Any], epoch: int, host: str, keeper: LeaseKeeper,
               hook: ElasticOpsHook) -> Any:
        """Run the chunk on this host's agent if one is configured and answers, else here."""
        logged = progress_logger(self.log, spec.name)

        def on_progress(p: Any) -> None:  # logged, and timed for the pool's heartbeats
            logged(p)
            keeper.progressed(p)

        warm_start = state.get("warm_start")
        nodes = node_config_from_env()
        if nodes is not None:  # a cluster: the chunk trains on the granted host, wherever this task is
            from elastic_ops.agent.node_client import NodeClient

            self.log.info("sending the chunk to the node agent of host %s (%r)", host, nodes)
            store = hook.store_config(spec.checkpoint_uri(), keep_last=spec.keep_last,
                                      keep_every=spec.keep_every)
            if store.s3 is not None and (store.s3.access_key_id or store.s3.session_token):
                self.log.info("the aws connection's keys are not sent to node agents: the node opens %s "
                              "with its own host's credentials (endpoint and region are sent)", store.uri)
            self._node_client = NodeClient(nodes)
            # a node with an address the others reach leads one process group across the grant's hosts
            span = bool((self._node_client.alive(host) or {}).get("addr"))
            if span:
                self.log.info("the node agent of host %s leads process groups that span hosts: the chunk "
                              "follows the pool's whole target", host)
            try:
                return self._node_client.run_chunk(
                    spec.to_dict(), state["start"], state["end"], epoch=epoch, host=host, store=store,
                    warm_start=hook.store_config(warm_start) if warm_start else None,
                    wanted=lambda: node_target(keeper, spec.min_workers, span), slots=keeper.slots,
                    spans=keeper.spans if span else None,
                    on_applied=keeper.applied,
                    on_progress=on_progress,
                )
            finally:
                self._node_client = None
        path = agent_socket()
        if path is None:
            self.log.info("%s is not set: training in this task process", AGENT_SOCKET_ENV)
        else:
            from elastic_ops.agent.client import AgentClient

            self.log.info("sending the chunk to the elastic-ops agent at %s", path)
            self._agent_client = AgentClient(path)  # for on_kill (same process, same try)
            try:
                return self._agent_client.run_chunk(
                    spec.to_dict(), state["start"], state["end"], epoch=epoch, host=host,
                    store=hook.store_config(spec.checkpoint_uri(), keep_last=spec.keep_last,
                                            keep_every=spec.keep_every),
                    warm_start=hook.store_config(warm_start) if warm_start else None,
                    wanted=keeper.wanted, slots=keeper.slots, on_applied=keeper.applied,
                    on_progress=on_progress,
                )
            except AgentUnavailableError as exc:
                self.log.warning("%s; training in this task process instead", exc)
            finally:
                self._agent_client = None
        from elastic_ops.runtime import run_chunk

        store = hook.store(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)
        # the warm-start model is read with the same Airflow connection (credentials, endpoint)
        warm_store = hook.store(warm_start) if warm_start else None
        return run_chunk(
            spec, state["start"], state["end"], target=keeper.target, store=store, epoch=epoch,
            on_progress=on_progress, host=host, warm_start=warm_start, warm_start_store=warm_store,
            slots=keeper.slots,  # workers on the GPUs granted on this host (a move relaunches them)
            on_segment=keeper.applied,  # report a shrink or move once the old workers have exited
        )

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
        for client in (getattr(self, "_node_client", None), getattr(self, "_agent_client", None)):
            if client is not None:
                client.abort()
        running = getattr(self, "_running", None)
        if running is None:
            return
        keeper, client, job, epoch = running
        keeper.stop()
        self._quietly("release the lease", self._release, client, job, epoch, finished=True)

    def _quietly(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Clean-up that must not replace the error being raised (the pool's own safety net,
        the lease TTL, still returns the slots)."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("could not %s (%s: %s); the lease TTL returns the slots", what,
                             type(exc).__name__, exc)

    def _release(
        self, client: Any, job: str, epoch: int, finished: bool = False, handover: bool = False
    ) -> None:
        try:
            client.release(job, epoch, finished=finished, handover=handover)
        except LeaseExpiredError:
            self.log.info("job %s: lease of epoch %d already gone", job, epoch)

    @staticmethod
    def _account(state: dict[str, Any], grant: GrantEvent, result: Any) -> dict[str, Any]:
        state = dict(state)
        state["timeline"] = list(state["timeline"]) + [list(t) for t in result.workers_timeline]
        state["epochs"] = list(state["epochs"]) + [grant.epoch]
        state["hosts"] = sorted(set(state["hosts"]) | set(grant.hosts))
        # from where this run resumed (its first segment's start), not the chunk's start: after a
        # preemption the same try resumes mid-chunk, and those iterations were counted already
        begun = result.workers_timeline[0][0] if result.workers_timeline else result.start
        state["trained"] = int(state["trained"]) + max(0, result.iteration - int(begun))
        state["last"] = {"samples_per_sec": result.samples_per_sec, "duration_s": result.duration_s}
        return state

    def _result(self, state: dict[str, Any], *, status: str, checkpoint_uri: str | None,
                result: Any = None) -> ChunkTaskResult:
        return ChunkTaskResult(
            job=state["spec"]["name"], chunk_index=state["chunk_index"], start=state["start"],
            end=state["end"], status=status, iterations=int(state["trained"]),
            workers_timeline=state["timeline"],
            samples_per_sec=float(getattr(result, "samples_per_sec", 0.0) or 0.0),
            loss=getattr(result, "loss", None), metrics=dict(getattr(result, "metrics", None) or {}),
            checkpoint_uri=checkpoint_uri, param_sha256=getattr(result, "param_sha256", None),
            epochs=state["epochs"], hosts=state["hosts"], preemptions=int(state["preemptions"]),
            waited_s=float(state["waited_s"]), duration_s=time.time() - float(state["started_at"]),
            train_samples_per_sec=float(getattr(result, "train_samples_per_sec", 0.0) or 0.0),
            trained_on=list(state.get("trained_on", [])),
        )
