"""MLflow tracking: one MLflow run per elastic job, resumed by every chunk and retry.

Install with ``pip install 'elastic-ops[mlflow]'`` (the MLflow client, ``mlflow-skinny``). The
server comes from the Airflow connection ``conn_id`` (default ``mlflow_default``: its host and
port, or ``extra.tracking_uri``; login and password or ``extra.token`` for an authenticated
server), else from ``MLFLOW_TRACKING_URI``. docs/howto/mlflow.md shows it in use.

- **The run**: tagged ``elastic_ops.job=<job>`` in the experiment (default: the DAG id). Each
  task finds it by that tag; the first creates it and logs the params and the spec. Two tasks
  that create it at once both look again: the later one deletes its own and joins the earlier.
- **Steps**: the iteration. ``loss``: every step at each chunk end (or preemption), from the
  result's loss history (its last 1,000 steps, those of earlier tries included); live progress
  (through an agent at most twice a second) adds it sooner. A step the run has already (a live
  point, or a retry's re-trained iteration) is not sent again: every step holds one value, the
  first sent. Event counters (``rescales``, ``preemptions``, ``failures``) are logged at the
  iteration they happened.
- **Racing tries**: a grant tags the run with its fencing epoch; a try that sees a newer epoch
  there stops sending (a newer try records the job now).
- **Never slows training**: progress goes to a queue that a thread sends in batches; a server
  that is down is a warning in the task log, and what could not be sent by the end of the task
  (within ``timeout_s``) is dropped with a warning. ``strict=True`` fails the task instead.
- **No secrets**: credentials travel in MLflow's environment variables, never in a logged URI.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from elastic_ops.errors import SpecError, TrackingError
from elastic_ops.tracking.api import Log, TrackedJob, Tracking, without_userinfo

if TYPE_CHECKING:
    import torch
    from torch import nn

    from elastic_ops.runtime.outcome import ChunkResult, Progress

DEFAULT_CONN_ID = "mlflow_default"
URI_ENV = "MLFLOW_TRACKING_URI"
JOB_TAG = "elastic_ops.job"
EPOCH_TAG = "elastic_ops.epoch"
MODEL_URI_TAG = "elastic_ops.model_uri"
MODEL_CHECKPOINT_TAG = "elastic_ops.model_checkpoint"
WEIGHTS_PATH = "model_state_dict"  # a script's final weights: an artifact, not an MLflow model
COUNTERS = ("rescales", "preemptions", "failures")
FLUSH_EVERY_S = 1.0  # the sender's batches (MLflow takes at most 1000 metrics in one)
BATCH = 1000
MAX_PENDING = 100_000  # a server down for long: the oldest points go first
MAX_TAG = 5000


def _check_name(field: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > 256):
        raise SpecError(field, value, "must be a non-empty string of at most 256 characters, or None")


@dataclasses.dataclass(frozen=True)
class MlflowTracking(Tracking):
    """Track each elastic job of the group as one MLflow run.

    :param experiment: the MLflow experiment (created if missing); default: the DAG id.
    :param registered_model_name: register the final model under this name (a new version per run);
        a Trainable's only (refused for a script entrypoint, whose model no task can build).
    :param log_model: log the final model as an MLflow model (``mlflow.pytorch``) at finalize; for
        a script entrypoint, its final ``state_dict`` as the artifact ``model_state_dict``.
    :param conn_id: the Airflow connection to the tracking server (else ``MLFLOW_TRACKING_URI``).
    :param strict: a tracking failure fails the task (retryably) instead of a warning.
    :param timeout_s: each request's timeout, and how long a task's end waits to send what is left.
    """

    kind: ClassVar[str] = "mlflow"

    experiment: str | None = None
    registered_model_name: str | None = None
    log_model: bool = True
    conn_id: str = DEFAULT_CONN_ID
    strict: bool = False
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check_name("experiment", self.experiment)
        _check_name("registered_model_name", self.registered_model_name)
        _check_name("conn_id", self.conn_id)
        if self.conn_id is None:
            raise SpecError("conn_id", None, "must name an Airflow connection (default 'mlflow_default')")
        for field in ("log_model", "strict"):
            if not isinstance(getattr(self, field), bool):
                raise SpecError(field, getattr(self, field), "must be True or False")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not 0 < t <= 600:
            raise SpecError("timeout_s", t, "must be a number of seconds in (0, 600]")

    def check_entrypoint(self, entrypoint: str) -> None:
        if self.registered_model_name is not None and str(entrypoint).endswith(".py"):
            raise SpecError(
                "registered_model_name", self.registered_model_name,
                f"must be None for a script entrypoint ({entrypoint}). Only a Trainable's model can "
                "be an MLflow model: a script builds its model inside the script. The script's "
                f"final weights are logged as the run's artifact {WEIGHTS_PATH!r}",
                hint="to register the model, write it as a Trainable (docs/tutorial.md)",
            )

    def open(self, job: TrackedJob, log: Log) -> MlflowRun:
        found = server_from(self.conn_id)
        if found is None:
            raise TrackingError(
                f"no MLflow tracking server configured: no Airflow connection {self.conn_id!r} and "
                f"{URI_ENV} is not set",
                hint=f"create the connection (host and port of the server) or set {URI_ENV} for the workers",
            )
        uri, secrets = found
        try:
            from mlflow import MlflowClient
        except ImportError as exc:
            raise TrackingError(f"the MLflow client is not installed here ({exc})",
                                hint="pip install 'elastic-ops[mlflow]'") from None
        _http_defaults(self.timeout_s)
        os.environ.update(secrets)  # MLflow reads credentials there; never logged, never in a URI
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        experiment = self.experiment or job.dag_id
        exp_id = _experiment_id(client, experiment)
        run, created = _find_or_create(client, exp_id, job)
        tags = dict(run.data.tags)
        if created:
            _log_spec(client, run.info.run_id, job, log)
        elif run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")  # a cleared or retried run goes on
        log.info("job %s: MLflow run %s (%s) in experiment %r at %s", job.spec.name, run.info.run_id,
                 "created" if created else "resumed", experiment, shown_uri(uri))
        return MlflowRun(client, run.info.run_id, exp_id, uri, self, job, log, tags)


def server_from(conn_id: str) -> tuple[str, dict[str, str]] | None:
    """The tracking URI and the credentials (as MLflow's environment variables) of the Airflow
    connection ``conn_id``, else ``MLFLOW_TRACKING_URI``'s; None: neither is there."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        uri = os.environ.get(URI_ENV)
        return (uri, {}) if uri else None
    extra = conn.extra_dejson or {}
    uri = extra.get("tracking_uri")
    if not uri:
        if not conn.host:
            raise SpecError("connection", conn_id, "an MLflow connection needs a host (and port) or "
                            "extra {'tracking_uri': ...}")
        host = conn.host if "://" in conn.host else f"{conn.schema or 'http'}://{conn.host}"
        uri = f"{host.rstrip('/')}:{conn.port}" if conn.port else host.rstrip("/")
    secrets = {}
    if conn.login:
        secrets["MLFLOW_TRACKING_USERNAME"] = conn.login
    if conn.password:
        secrets["MLFLOW_TRACKING_PASSWORD"] = conn.password
    if extra.get("token"):
        secrets["MLFLOW_TRACKING_TOKEN"] = str(extra["token"])
    return str(uri), secrets


def shown_uri(uri: str) -> str:
    """``uri`` without credentials or a query (what a log line may show)."""
    parts = urlsplit(uri)
    if not parts.netloc:
        return uri.split("?", 1)[0]
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _http_defaults(timeout_s: float) -> None:
    """MLflow's own defaults retry a dead server for minutes (7 tries, doubling): a task would
    wait that long at each call. Fewer, shorter tries unless the deployment set its own."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(math.ceil(timeout_s))))


def _experiment_id(client: Any, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # another task created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _job_runs(client: Any, exp_id: str, job: str) -> list[Any]:
    runs = client.search_runs([exp_id], filter_string=f"tags.`{JOB_TAG}` = '{job}'", max_results=50)
    return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))


def _find_or_create(client: Any, exp_id: str, job: TrackedJob) -> tuple[Any, bool]:
    """The job's run (the earliest created, should two exist), and whether this task created it.
    A task that created a run and then finds an earlier one deletes its own: two tasks racing
    end up in one run."""
    name = job.spec.name  # letters, digits, '_', '.', '-' (the spec checks it): safe in the filter
    runs = _job_runs(client, exp_id, name)
    if runs:
        return runs[0], False
    tags = {JOB_TAG: name, "elastic_ops.dag_id": job.dag_id, "elastic_ops.dag_run_id": job.run_id,
            "elastic_ops.group": job.group_id, "elastic_ops.entrypoint": job.spec.entrypoint}
    mine = client.create_run(exp_id, tags=tags, run_name=f"{job.group_id} {job.run_id}"[:250])
    runs = _job_runs(client, exp_id, name) or [mine]
    if runs[0].info.run_id != mine.info.run_id:
        client.delete_run(mine.info.run_id)
        return runs[0], False
    return mine, True


def _log_spec(client: Any, run_id: str, job: TrackedJob, log: Log) -> None:
    """The spec's fields and the Trainable's params as MLflow params, the spec as an artifact."""
    from mlflow.entities import Param

    spec = job.spec.to_dict()
    params = [Param(f"params.{k}"[:250], _text(v)) for k, v in sorted(dict(spec.get("params") or {}).items())]
    params += [Param(k, _text(v)) for k, v in sorted(spec.items()) if k not in ("name", "params")
               and v not in (None, {}, [], ())]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params in one batch
        client.log_batch(run_id, params=params[i:i + 100])
    try:
        client.log_dict(run_id, spec, "elastic_ops/spec.json")
    except Exception as exc:  # noqa: BLE001 - the artifact store may be elsewhere (S3 without credentials)
        log.warning("MLflow: could not store the spec as an artifact of run %s (%s)", run_id,
                    without_userinfo(f"{type(exc).__name__}: {exc}"))


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:6000]


@dataclasses.dataclass(frozen=True)
class _Point:
    """A metric point or a tag for the sender. ``series``: one value per step (a retry's
    re-trained steps are not sent again); counters are events, sent as they come."""

    key: str
    value: float | str
    step: int
    series: bool = True
    at_ms: int = dataclasses.field(default_factory=lambda: int(time.time() * 1000))


class MlflowRun:
    """The job's MLflow run as one task records it (a :class:`~elastic_ops.tracking.api.JobRun`)."""

    def __init__(self, client: Any, run_id: str, experiment_id: str, uri: str, cfg: MlflowTracking,
                 job: TrackedJob, log: Log, tags: Mapping[str, str]) -> None:
        self.client, self.run_id, self.experiment_id, self.uri = client, run_id, experiment_id, uri
        self.cfg, self.job, self.log = cfg, job, log
        self._tags = dict(tags)
        self._counts = {k: _int(tags.get(f"elastic_ops.{k}")) for k in COUNTERS}
        self._lock = threading.Lock()
        self._pending: list[_Point] = []
        self._have: dict[str, set[int]] = {}  # the steps the run has of each series
        self._epoch: int | None = None
        self._fenced_by: int | None = None
        self._dropped = 0
        self._error: str | None = None
        self._warned = False
        self._sending = threading.Lock()  # the sender thread's batch, or a drain's after a slow join
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    # --- JobRun ---------------------------------------------------------------------------------

    def granted(self, epoch: int, workers: int, hosts: tuple[str, ...]) -> None:
        with self._lock:
            self._epoch = epoch
        self.client.set_tag(self.run_id, EPOCH_TAG, str(epoch))  # racing older tries stop sending

    def progressed(self, p: Progress) -> None:
        points = [_Point("workers", float(p.workers), p.iteration)]
        if p.loss is not None and math.isfinite(p.loss):
            points.append(_Point("loss", float(p.loss), p.iteration))
        if p.samples_per_sec is not None and math.isfinite(p.samples_per_sec):
            points.append(_Point("samples_per_sec", float(p.samples_per_sec), p.iteration))
        self._put(points)

    def rescaled(self, iteration: int, workers: int, previous: int, reason: str | None) -> None:
        why = f" ({reason})" if reason else ""
        self._event("rescales", iteration, f"iteration {iteration}: {previous} -> {workers} workers{why}")

    def chunk_ended(self, chunk_index: int, result: ChunkResult) -> None:
        # every step's loss, those that live progress (sampled through an agent) did not have
        points = [_Point("loss", float(loss), int(it)) for it, loss in result.loss_history]
        ends = dict(result.metrics or {}).items()
        points += [_Point(_key(k), float(v), int(result.iteration)) for k, v in ends
                   if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
        if str(result.status) == "completed":
            points.append(_Point("elastic_ops.chunk", str(chunk_index + 1), 0, series=False))
        self._put(points)

    def preempted(self, iteration: int) -> None:
        self._event("preemptions", iteration, f"iteration {iteration}")

    def failed(self, error: BaseException, *, host: str | None, final: bool) -> None:
        said = getattr(error, "message", None) or str(error)
        where = f" on {host}" if host else ""
        task = f"{self.job.task_id} try {self.job.try_number or '?'}"
        self._event("failures", None, f"{task}{where}: {type(error).__name__}: {said}"[:MAX_TAG])
        if final:
            self._drain()
            self.client.set_terminated(self.run_id, status="FAILED")

    def finalized(self, summary: Mapping[str, Any], model: Callable[[], nn.Module] | None,
                  weights: Callable[[], dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        step = int(summary.get("iteration") or 0)
        figures = {k: summary.get(k) for k in ("slot_hours", "train_s", "waited_s", "preemptions")}
        self._put([_Point(f"job.{k}", float(v), step) for k, v in figures.items()
                   if isinstance(v, int | float) and math.isfinite(v)])
        self._put([_Point("elastic_ops.checkpoint_uri", str(summary.get("checkpoint_uri")), 0, series=False)])
        self._drain()
        extra: dict[str, Any] = {"mlflow_run_id": self.run_id, "mlflow_experiment_id": self.experiment_id}
        if self.cfg.log_model and model is not None:
            extra.update(self._log_model(model, str(summary.get("checkpoint_uri"))))
        elif self.cfg.log_model and weights is not None:
            extra.update(self._log_weights(weights, str(summary.get("checkpoint_uri"))))
        self.client.set_terminated(self.run_id, status="FINISHED")
        return extra

    def close(self) -> None:
        self._drain()

    # --- the model ------------------------------------------------------------------------------

    def _log_model(self, model: Callable[[], nn.Module], checkpoint: str) -> dict[str, Any]:
        """The final weights as an MLflow model (registered under the configured name). A finalize
        run again for the same checkpoint logs nothing new: the run's tags name the model."""
        tags = self.client.get_run(self.run_id).data.tags
        name = self.cfg.registered_model_name
        if tags.get(MODEL_CHECKPOINT_TAG) == checkpoint and tags.get(MODEL_URI_TAG):
            self.log.info("MLflow: the model of %s is logged already: %s", checkpoint, tags[MODEL_URI_TAG])
            return {"mlflow_model_uri": tags[MODEL_URI_TAG],
                    **({"mlflow_registered_model": name} if name else {})}
        import mlflow
        import mlflow.pytorch
        import torch

        mlflow.set_tracking_uri(self.uri)
        mlflow.set_registry_uri(self.uri)
        with mlflow.start_run(run_id=self.run_id):
            # explicit requirements: inferring them runs the model's code in a subprocess (slow);
            # pickled: 'pt2' (MLflow's default) traces forward() and needs an input example
            info = mlflow.pytorch.log_model(model(), name="model", registered_model_name=name,
                                            serialization_format="pickle",
                                            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
        self.client.set_tag(self.run_id, MODEL_URI_TAG, info.model_uri)
        self.client.set_tag(self.run_id, MODEL_CHECKPOINT_TAG, checkpoint)
        out: dict[str, Any] = {"mlflow_model_uri": info.model_uri}
        if name:
            out |= {"mlflow_registered_model": name,
                    "mlflow_model_version": str(info.registered_model_version)}
        self.log.info("MLflow: logged the final model of %s as %s%s", checkpoint, info.model_uri,
                      f", registered as {name} version {info.registered_model_version}" if name else "")
        return out

    def _log_weights(self, weights: Callable[[], dict[str, torch.Tensor]], checkpoint: str) -> dict[str, Any]:
        """A script's final ``state_dict`` as the run's artifact :data:`WEIGHTS_PATH`. Not an
        MLflow model: that pickles the model's class, and a script's model class lives in the
        script, which no task but its workers runs. Not registered (nor registrable) either."""
        uri = f"runs:/{self.run_id}/{WEIGHTS_PATH}"
        tags = self.client.get_run(self.run_id).data.tags
        if tags.get(MODEL_CHECKPOINT_TAG) == checkpoint and tags.get(MODEL_URI_TAG) == uri:
            self.log.info("MLflow: the weights of %s are logged already: %s", checkpoint, uri)
            return {"mlflow_state_dict_uri": uri}
        import mlflow
        import mlflow.pytorch

        mlflow.set_tracking_uri(self.uri)
        with mlflow.start_run(run_id=self.run_id):
            mlflow.pytorch.log_state_dict(weights(), artifact_path=WEIGHTS_PATH)
        self.client.set_tag(self.run_id, MODEL_URI_TAG, uri)
        self.client.set_tag(self.run_id, MODEL_CHECKPOINT_TAG, checkpoint)
        name = self.cfg.registered_model_name
        self.log.info("MLflow: logged the final weights of %s as %s (a script entrypoint: a state_dict, "
                      "not an MLflow model; load it with mlflow.pytorch.load_state_dict)%s", checkpoint, uri,
                      f"; not registered as {name}: only a Trainable's model can be" if name else "")
        return {"mlflow_state_dict_uri": uri}

    # --- the sender -----------------------------------------------------------------------------

    def _event(self, counter: str, iteration: int | None, text: str) -> None:
        with self._lock:
            self._counts[counter] += 1
            count = self._counts[counter]
        points = [_Point(f"elastic_ops.{counter}", str(count), 0, series=False),
                  _Point(f"elastic_ops.last_{counter[:-1]}", text[:MAX_TAG], 0, series=False)]
        if iteration is not None:
            points.append(_Point(counter, float(count), iteration, series=False))
        self._put(points)

    def _put(self, points: list[_Point]) -> None:
        if not points:
            return
        with self._lock:
            if self._fenced_by is not None:
                return
            self._pending.extend(points)
            over = len(self._pending) - MAX_PENDING
            if over > 0:
                del self._pending[:over]
                self._dropped += over
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"mlflow-{self.run_id[:8]}",
                                                daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        delay = FLUSH_EVERY_S
        while not self._closing.wait(delay):
            delay = FLUSH_EVERY_S if self._send() else min(delay * 2, 30.0)

    def _drain(self) -> None:
        """Send everything pending (the task ends, or the run is about to end) within
        ``timeout_s``; what is left then is dropped, with a warning (strict: an error)."""
        self._closing.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.cfg.timeout_s)
        deadline = time.monotonic() + self.cfg.timeout_s
        while self._pending and time.monotonic() < deadline and self._send():
            pass
        self._closing.clear()
        with self._lock:
            left, self._pending = len(self._pending), []
            dropped, self._dropped = self._dropped + left, 0
        if dropped:
            text = (f"MLflow: {dropped} metric points and tags of run {self.run_id} could not be sent "
                    f"({self._error}); training went on without them")
            if self.cfg.strict:
                raise TrackingError(text, hint="the tracking is strict=True")
            self.log.warning("%s", text)

    def _send(self) -> bool:
        """One batch to the server: True when it went (or nothing was pending)."""
        with self._sending:
            return self._send_one()

    def _send_one(self) -> bool:
        from mlflow.entities import Metric, RunTag

        with self._lock:
            batch = self._pending[:BATCH]
            epoch = self._epoch
        if not batch:
            return True
        added: list[_Point] = []
        try:
            if epoch is not None and self._fenced(epoch):
                return True
            metrics, tags = [], {}
            for p in batch:
                if isinstance(p.value, str):
                    tags[p.key] = p.value  # the latest of each tag
                    continue
                if p.series:
                    if p.key not in self._have:
                        self._have[p.key] = self._steps_of(p.key)
                    if p.step in self._have[p.key]:
                        continue  # a re-trained step, or a live point: the run has it
                    self._have[p.key].add(p.step)
                    added.append(p)
                metrics.append(Metric(p.key, p.value, p.at_ms, p.step))
            if metrics or tags:
                self.client.log_batch(self.run_id, metrics=metrics,
                                      tags=[RunTag(k, v) for k, v in tags.items()])
        except Exception as exc:  # noqa: BLE001 - a server down or refusing: warn, keep the points, retry
            for p in added:  # not sent: the run does not have them
                self._have[p.key].discard(p.step)
            self._error = self.cfg.redact(f"{type(exc).__name__}: {str(exc)[:300]}")
            if not self._warned:
                self._warned = True
                self.log.warning("MLflow tracking failed (%s); training goes on, sending again later",
                                 self._error)
            return False
        with self._lock:
            del self._pending[:len(batch)]
        return True

    def _steps_of(self, key: str) -> set[int]:
        """The steps the run has of series ``key`` (read once per task: earlier tasks' steps)."""
        return {int(m.step) for m in self.client.get_metric_history(self.run_id, key)}

    def _fenced(self, epoch: int) -> bool:
        """Whether a newer try's grant took the run over (its epoch in the run's tag)."""
        tag = self.client.get_run(self.run_id).data.tags.get(EPOCH_TAG)
        newer = _int(tag)
        if newer <= epoch:
            return False
        with self._lock:
            self._fenced_by, self._pending = newer, []
        self.log.warning("MLflow: a newer try (epoch %d) records job %s now; this try (epoch %d) stops "
                         "sending", newer, self.job.spec.name, epoch)
        return True


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _key(name: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_-./`` and spaces)."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in str(name))[:250] or "_"
