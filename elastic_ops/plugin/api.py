"""The plugin's HTTP API, mounted by the api-server at ``/elastic-ops``: the pool's status and
every runtime control the ``elastic-ops pool`` CLI has, for operators who have an Airflow login
but no credentials for the ledger's database.

Every route needs an authenticated Airflow user (JWT bearer token or the UI's session cookie),
authorized through the configured auth manager as an Airflow pool named ``elastic_ops``:
reading needs ``GET`` (read) access, changing a job, a host, a tenant or a setting ``PUT`` (edit),
adding a host or a tenant ``POST`` (create), pruning events or removing a tenant ``DELETE``;
changing a job's priority or bounds needs edit access to the DAG the job comes from instead
(the pool's for a job from no DAG). A change is authorized before its body is
read: a user who may not change the pool gets 403 whatever it sent, and no body is parsed for
one. Bodies are at most ``MAX_BODY_BYTES`` (64 KiB; more: 413, read no further) of strict JSON
(no key twice, nothing coerced, no unknown fields: 422, naming the field); values the pool
refuses are 400 with its message (field, value, what is allowed), an unknown job or host 404,
the ledger out of reach 503 (the cause is logged here, not shown: it names the database's host
and user). No OpenAPI document or interactive docs are served: they would be the only routes
without a login.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from typing import Annotated, Any, Literal, TypeVar

from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from elastic_ops.agent.protocol import unique_keys
from elastic_ops.errors import ElasticOpsError, UnknownHostError, UnknownJobError
from elastic_ops.pool.api import EventKind
from elastic_ops.pool.checks import MAX_LOOKBACK_H
from elastic_ops.spec import MAX_WORKERS_LIMIT

log = logging.getLogger(__name__)

HostStateName = Literal["up", "draining", "down", "cooling"]
NAME_MAX = 255  # job and host names (the pool allows fewer; longer is refused before any echo)
Job = Annotated[str, Path(max_length=NAME_MAX)]
Host = Annotated[str, Path(max_length=NAME_MAX)]


def _authorize(method: str, user: Any) -> None:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import PoolDetails

    if not get_auth_manager().is_authorized_pool(method=method, details=PoolDetails(name="elastic_ops"),
                                                 user=user):
        raise HTTPException(status_code=403, detail=f"user may not {method} the elastic_ops pool")


@functools.cache
def _nodes() -> Any:
    """The cluster's node agents as this api-server's environment names them
    (``ELASTIC_OPS_NODE_REDIS_URL``, ``_SECRET``, ``_NAMESPACE``, as the workers'), or ``None``."""
    from elastic_ops.agent.cluster import node_config_from_env

    config = node_config_from_env()
    if config is None:
        return None
    from elastic_ops.agent.node_client import NodeClient

    return NodeClient(config)


def _node_view() -> dict[str, Any]:
    """``{"cluster": bool, "nodes": {host: announcement}}``, plus ``"error"`` when the cluster's
    Redis cannot be read."""
    from elastic_ops.errors import AgentLostError

    nodes = _nodes()
    if nodes is None:
        return {"cluster": False, "nodes": {}}
    try:
        return {"cluster": True, "nodes": nodes.announced()}
    except AgentLostError as exc:
        return {"cluster": True, "nodes": {}, "error": exc.message}


@functools.cache
def _client():
    """One ``PoolClient`` (one engine and connection pool) per api-server process."""
    from elastic_ops.hooks.elastic_ops import ElasticOpsHook

    return ElasticOpsHook().pool()


def _call(method: str, *args, **kwargs) -> Any:
    """Call the pool's ``method``, mapping its errors onto HTTP: unknown job/host 404, refused
    value 400, the ledger out of reach or busy (a retryable error: the caller may try again)
    503 with the cause only in this server's log."""
    try:
        return getattr(_client(), method)(*args, **kwargs)
    except (UnknownJobError, UnknownHostError) as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    except ElasticOpsError as exc:
        if exc.retryable:
            log.warning("elastic_ops pool API: %s failed: %s", method, exc)
            raise HTTPException(status_code=503, detail="the pool ledger is not reachable now; "
                                "try again (the api-server's log says why)") from None
        raise HTTPException(status_code=400, detail=str(exc)) from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_BODY_BYTES = 64 * 1024  # the largest body is a selector or labels: a few hundred bytes
B = TypeVar("B", bound=_Body)


async def _read_body(request: Request, model: type[B]) -> B:
    """The request's body as ``model``, read only now (after authorization): at most
    MAX_BODY_BYTES (413 past it, the rest unread), strict JSON with no key twice, then the
    model's checks (422 naming the field, as FastAPI's own)."""
    if "authorization" not in request.headers and not request.headers.get("content-type", "").startswith(
            "application/json"):  # the UI's cookie: a cross-site form cannot send JSON without asking first
        raise HTTPException(status_code=415, detail="a change sent with the session cookie must be "
                            "application/json")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(status_code=413, detail=f"the body is over {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise HTTPException(status_code=413, detail=f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(bytes(raw), object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        msg = f"the body is not valid JSON: {why}"
        error = {"type": "json_invalid", "loc": ("body",), "msg": msg, "input": None}
        raise RequestValidationError([error]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


async def _authorized(method: str, user: Any) -> None:
    await run_in_threadpool(_authorize, method, user)  # an auth manager may ask its database


class PriorityBody(_Body):
    """``{"priority": N}``: an integer 1..1000, nothing coerced ("5", 5.0, true) and nothing else."""

    priority: StrictInt = Field(ge=1, le=1000)


class BoundsBody(_Body):
    """``{"min_workers": A, "max_workers": B}``, 1 <= A <= B (the pool checks A <= B)."""

    min_workers: StrictInt = Field(ge=1, le=MAX_WORKERS_LIMIT)
    max_workers: StrictInt = Field(ge=1, le=MAX_WORKERS_LIMIT)


class PreemptibleBody(_Body):
    preemptible: StrictBool


class SelectorBody(_Body):
    """``{"selector": {"gpu": "h100"}}`` (``{}``: any host); the pool checks the labels."""

    selector: dict[StrictStr, StrictStr]


class HostStateBody(_Body):
    state: HostStateName


class HostBody(_Body):
    """``{"slots": N, "labels": {"gpu": "h200"}}``: register a host, or re-enable and resize one."""

    slots: StrictInt = Field(ge=1, le=1_000_000)
    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict)


class SettingsBody(_Body):
    """Pool-wide settings to change (any subset); the pool validates the values."""

    policy: StrictStr | None = Field(None, max_length=64)
    preemption: Literal["none", "graceful"] | None = None
    lease_ttl_s: StrictFloat | StrictInt | None = None
    min_rescale_interval_s: StrictFloat | StrictInt | None = None
    min_gain: StrictFloat | StrictInt | None = None
    aging_s: StrictFloat | StrictInt | None = None
    job_idle_s: StrictFloat | StrictInt | None = None
    cooling_s: StrictFloat | StrictInt | None = None
    failure_threshold: StrictInt | None = None
    rescale_cost_s: StrictFloat | StrictInt | None = None


app = FastAPI(title="elastic_ops pool", description="Resource pool status and runtime control",
              docs_url=None, redoc_url=None, openapi_url=None)


def _json_safe(value: object) -> Any:
    """``value`` with every non-finite float as its text: JSON has none, and a body may hold one
    (``NaN``, ``Infinity`` and ``1e400`` parse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


@app.exception_handler(RequestValidationError)
async def _refused_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 (each error names the field), but a refused NaN or infinity is echoed as
    text: echoing it as a number failed the response itself (a 500)."""
    return JSONResponse(status_code=422, content={"detail": _json_safe(jsonable_encoder(exc.errors()))})


# --- reading ----------------------------------------------------------------------------------


@app.get("/status")
def pool_status(user: GetUserDep) -> dict[str, Any]:
    _authorize("GET", user)
    return _call("status")


KIND_QUERY = Query(None)  # a list parameter (?kind=grant&kind=shrink); each checked by the ledger


@app.get("/events")
def pool_events(
    user: GetUserDep,
    job: str | None = Query(None, max_length=NAME_MAX),
    since_id: int = Query(0, ge=0, le=2**63 - 1),  # a larger id overflows the ledger's integer
    last: int | None = Query(None, ge=1, le=1_000_000),
    since_ts: float | None = Query(None, ge=0, le=1e11),
    kind: list[str] | None = KIND_QUERY,
) -> list[dict[str, Any]]:
    """The event log, oldest first: one job's, after ``since_id``, at or after ``since_ts``, of
    the ``kind`` s given, the ``last`` N (any subset)."""
    _authorize("GET", user)
    return _call("events", job=job, since_id=since_id, last=last, since_ts=since_ts, kinds=kind)


@app.get("/usage")
def pool_usage(user: GetUserDep, hours: float | None = Query(None, gt=0)) -> dict[str, Any]:
    """Slot-hours per job and per host over the last ``hours`` (default: the whole event log)."""
    _authorize("GET", user)
    return _call("usage", hours=hours)


@app.get("/nodes")
def node_agents(user: GetUserDep) -> dict[str, Any]:
    """The node agents announced in the cluster's Redis (host → pid, protocol version, chunks,
    address), ``{"cluster": false}`` when this api-server has no cluster settings; 503 when the
    Redis cannot be read."""
    _authorize("GET", user)
    view = _node_view()
    if "error" in view:
        raise HTTPException(status_code=503, detail=view["error"])
    return view


def _may(method: str, user: Any) -> bool:
    try:
        _authorize(method, user)
    except HTTPException:
        return False
    return True


def _authorize_run(dag_id: str, user: Any) -> None:
    """Reading a DAG run's chunks needs read access to the DAG's runs, as Airflow's own pages."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    if not get_auth_manager().is_authorized_dag(method="GET", access_entity=DagAccessEntity.RUN,
                                                details=DagDetails(id=dag_id), user=user):
        raise HTTPException(status_code=403, detail=f"user may not read the runs of DAG {dag_id}")


def _run_chunks(dag_id: str, run_id: str) -> list:
    from elastic_ops.plugin.runs import read_run

    return read_run(dag_id, run_id)


def _recent_runs() -> dict[str, tuple[str, str]]:
    """Job name -> (DAG id, run id) of the recent chunk tasks: the pool view's links to job views."""
    from elastic_ops.plugin.runs import recent_jobs

    try:
        return recent_jobs()
    except Exception as exc:  # noqa: BLE001 - the links are a convenience: the view shows without them
        log.warning("elastic_ops: the recent runs' jobs could not be read: %s", exc)
        return {}


def _totals(refs: dict[str, tuple[str, str]]) -> dict[str, int]:
    """Job name -> total iterations (from the chunk tasks' rendered fields): the pool view's ETAs."""
    from elastic_ops.plugin.runs import totals_of

    try:
        return totals_of(refs)
    except Exception as exc:  # noqa: BLE001 - an ETA is a convenience: the view shows without it
        log.warning("elastic_ops: the jobs' total iterations could not be read: %s", exc)
        return {}


def _html(page: str) -> HTMLResponse:
    from elastic_ops.plugin.page import CSP

    return HTMLResponse(page, headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store",
                                       "X-Content-Type-Options": "nosniff"})


MAX_SCAN = 5000  # the events a view or the timeline reads at most (the newest)
TIMELINE_SCAN = 100_000  # the events a timeline replays at most (to know who held what at its start)


def _timeline(job: str | None, since: float | None, until: float | None, max_points: int,
              progress: dict | None = None):
    from elastic_ops.timeline import check_bounds, compute

    try:
        check_bounds(since, until, max_points)
    except ElasticOpsError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from None
    events = _call("events", job=job, last=TIMELINE_SCAN)
    if job is not None:  # the pool's capacity too, from the host events
        events = sorted([*events, *_call("events", kinds=["host"], last=MAX_SCAN)], key=lambda e: e["id"])
    status = _call("status")
    done = job is not None and any(j["name"] == job and j["state"] == "finished" for j in status["jobs"])
    now = None if done else status["now"]  # a finished job's picture ends where it did
    tenant_of = {j["name"]: j.get("tenant", "default") for j in status["jobs"]}
    return compute(events, progress, job=job, since=since, until=until, max_points=max_points, now=now,
                   tenant_of=tenant_of)


@app.get("/timeline")
def timeline(
    user: GetUserDep,
    job: str | None = Query(None, max_length=NAME_MAX),
    since_ts: float | None = Query(None, ge=0, le=1e11),
    until_ts: float | None = Query(None, ge=0, le=1e11),
    max_points: int = Query(5000, ge=1, le=20_000),
    dag_id: str | None = Query(None, max_length=NAME_MAX),
    run_id: str | None = Query(None, max_length=NAME_MAX),
) -> dict[str, Any]:
    """The series the views draw (``elastic_ops.timeline.Timeline``): slots held per job (``job``:
    that one; none: the pool), the capacity, every allocation change with the plan's reason, and,
    given the job's DAG run (``dag_id`` and ``run_id``), its completed iterations over time;
    between ``since_ts`` and ``until_ts``, at most ``max_points`` points (the newest)."""
    _authorize("GET", user)
    progress = None
    if dag_id is not None or run_id is not None:
        if dag_id is None or run_id is None or job is None:
            raise HTTPException(status_code=422, detail="dag_id and run_id go together, with job")
        from elastic_ops.plugin.runs import jobs_of, progress_of

        _authorize_run(dag_id, user)
        chunks = jobs_of(dag_id, run_id, _run_chunks(dag_id, run_id)).get(job, [])
        progress = {job: progress_of(chunks)}
    return _timeline(job, since_ts, until_ts, max_points, progress).to_dict()


KINDS = tuple(k.value for k in EventKind)


@app.get("/ui", response_class=HTMLResponse)
def pool_view(
    request: Request,
    user: GetUserDep,
    job: str = Query("", max_length=NAME_MAX),
    host: str = Query("", max_length=NAME_MAX),
    kind: Literal["", *KINDS] = Query(""),  # type: ignore[valid-type]
    range: str = Query("1h", pattern="^(15m|1h|6h|24h|all)$"),  # noqa: A002 - the query's name
    page: int = Query(0, ge=0, le=MAX_SCAN // 50),
) -> HTMLResponse:
    """The pool view (the "Elastic pool" entry in the Airflow UI's navigation)."""
    from elastic_ops.links.pool import job_view_url
    from elastic_ops.plugin.page import RANGES, EventFilter, pool_page

    _authorize("GET", user)
    flt = EventFilter(job=job, host=host, kind=kind, range=range, page=page)
    status = _call("status")
    span = RANGES[range]
    since = None if span is None else max(0.0, status["now"] - span)
    tl = _timeline(None, since, None, 5000)
    events = _call("events", job=job or None, since_ts=since, kinds=[kind] if kind else None, last=MAX_SCAN)
    observations = {j["name"]: _call("observations", j["name"]) for j in status["jobs"]
                    if j["state"] != "finished"}
    base = _base(request)
    refs = _recent_runs()
    links = {name: job_view_url(_airflow_base(), d, r) for name, (d, r) in refs.items()}
    totals = _totals({name: ref for name, ref in refs.items() if name in observations})
    page_html = pool_page(status, tl, events, flt, kinds=KINDS, observations=observations,
                          can_edit=_may("PUT", user), base=base, nodes=_node_view(), job_links=links,
                          totals=totals)
    return _html(page_html)


@app.get("/ui/job", response_class=HTMLResponse)
def job_view(
    request: Request,
    user: GetUserDep,
    dag_id: str = Query(max_length=NAME_MAX),
    run_id: str = Query(max_length=NAME_MAX),
) -> HTMLResponse:
    """The job view of one DAG run (the "Elastic job" tab of the run in the Airflow UI)."""
    from elastic_ops.plugin.page import job_page, job_section
    from elastic_ops.plugin.runs import jobs_of, progress_of

    _authorize("GET", user)
    _authorize_run(dag_id, user)
    status = _call("status")
    known = {j["name"]: j for j in status["jobs"]}
    can_edit = _may("PUT", user)
    sections = []
    for name, chunks in jobs_of(dag_id, run_id, _run_chunks(dag_id, run_id)).items():
        tl = _timeline(name, None, None, 5000, {name: progress_of(chunks)})
        job = known.get(name)
        observations = _call("observations", name) if job else []
        sections.append(job_section(name, job, tl, chunks, can_edit=can_edit, observations=observations))
    return _html(job_page(dag_id, run_id, sections, _base(request)))


STATIC = {"ui.js": "text/javascript", "ui.css": "text/css"}


@app.get("/ui/static/{name}")
def static_file(name: Literal["ui.js", "ui.css"], user: GetUserDep) -> Response:
    """The views' script and style, from the package (nothing is loaded from elsewhere)."""
    from importlib.resources import files

    _authorize("GET", user)
    text = files("elastic_ops.plugin").joinpath("static", name).read_text()
    return Response(text, media_type=STATIC[name], headers={"Cache-Control": "no-cache",
                                                            "X-Content-Type-Options": "nosniff"})


def _base(request: Request) -> str:
    """This app's path as the browser sees it (``/elastic-ops`` behind the api-server's base URL)."""
    return str(request.scope.get("root_path", "")).rstrip("/") or "/elastic-ops"


def _airflow_base() -> str:
    """The Airflow UI's path prefix (from ``[api] base_url``; empty at the root)."""
    from urllib.parse import urlsplit

    from airflow.configuration import conf

    return urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


@app.exception_handler(HTTPException)
async def _login_first(request: Request, exc: HTTPException) -> Response:
    """A view opened without a login (or with an expired one) goes to Airflow's login page and
    back; every other answer is FastAPI's own JSON."""
    if exc.status_code == 401 and request.method == "GET" and request.url.path.rstrip("/").endswith(
            ("/ui", "/ui/job")):
        from airflow.api_fastapi.app import get_auth_manager

        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(get_auth_manager().get_url_login(next_url=target), status_code=303)
    return await http_exception_handler(request, exc)


# --- jobs -------------------------------------------------------------------------------------
# Changes are async so that each authorizes before reading its body (a body parameter would be
# read and parsed by FastAPI before any dependency runs); the pool calls run in the threadpool.


def _authorize_job_dag(job: str, user: Any) -> None:
    """Changing a job's priority or bounds needs edit permission on the DAG the job comes from
    (the ledger records it at registration); a job that names no DAG (submitted outside
    Airflow) needs edit permission on the pool. 404 for a job the pool does not know."""
    dag_id = _call("job_dag", job)
    if dag_id is None:
        _authorize("PUT", user)
        return
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    if not get_auth_manager().is_authorized_dag(method="PUT", details=DagDetails(id=dag_id), user=user):
        raise HTTPException(status_code=403,
                            detail=f"user may not edit DAG {dag_id}, which job {job} comes from")


@app.post("/jobs/{job}/priority")
async def set_priority(job: Job, request: Request, user: GetUserDep) -> dict[str, Any]:
    """Needs edit permission on the job's DAG (the pool's, for a job from no DAG)."""
    await run_in_threadpool(_authorize_job_dag, job, user)
    body = await _read_body(request, PriorityBody)
    await run_in_threadpool(_call, "set_priority", job, body.priority)
    return {"job": job, "priority": body.priority}


@app.post("/jobs/{job}/bounds")
async def set_bounds(job: Job, request: Request, user: GetUserDep) -> dict[str, Any]:
    """Needs edit permission on the job's DAG (the pool's, for a job from no DAG)."""
    await run_in_threadpool(_authorize_job_dag, job, user)
    body = await _read_body(request, BoundsBody)
    await run_in_threadpool(_call, "set_bounds", job, body.min_workers, body.max_workers)
    return {"job": job, "min_workers": body.min_workers, "max_workers": body.max_workers}


@app.post("/jobs/{job}/preemptible")
async def set_preemptible(job: Job, request: Request, user: GetUserDep) -> dict[str, Any]:
    await _authorized("PUT", user)
    body = await _read_body(request, PreemptibleBody)
    await run_in_threadpool(_call, "set_preemptible", job, body.preemptible)
    return {"job": job, "preemptible": body.preemptible}


@app.post("/jobs/{job}/selector")
async def set_selector(job: Job, request: Request, user: GetUserDep) -> dict[str, Any]:
    await _authorized("PUT", user)
    body = await _read_body(request, SelectorBody)
    await run_in_threadpool(_call, "set_selector", job, body.selector)
    return {"job": job, "selector": body.selector}


# --- hosts ------------------------------------------------------------------------------------


@app.put("/hosts/{host}")
async def add_host(host: Host, request: Request, user: GetUserDep) -> dict[str, Any]:
    await _authorized("POST", user)
    body = await _read_body(request, HostBody)
    status = await run_in_threadpool(_call, "status")
    if any(h["name"] == host for h in status["hosts"]):
        await _authorized("PUT", user)  # re-enabling or resizing a host is an edit (it undoes a drain)
    await run_in_threadpool(_call, "add_host", host, body.slots, body.labels)
    return {"host": host, "slots": body.slots, "labels": body.labels, "state": "up"}


@app.post("/hosts/{host}/state")
async def set_host_state(host: Host, request: Request, user: GetUserDep) -> dict[str, Any]:
    """``{"state": "draining"}`` drains a host: no new grants, its jobs move off at their next
    iteration boundary."""
    await _authorized("PUT", user)
    body = await _read_body(request, HostStateBody)
    await run_in_threadpool(_call, "set_host_state", host, body.state)
    return {"host": host, "state": body.state}


# --- tenants ----------------------------------------------------------------------------------

Tenant = Annotated[str, Path(max_length=NAME_MAX)]


class TenantBody(_Body):
    """``{"guaranteed": N, "max_slots": M, "weight": W}`` (``max_slots`` null: no limit)."""

    guaranteed: StrictInt = Field(ge=0, le=10**9)
    max_slots: StrictInt | None = Field(None, ge=1, le=10**9)
    weight: StrictFloat | StrictInt = 1.0


@app.put("/tenants/{tenant}")
async def add_tenant(tenant: Tenant, request: Request, user: GetUserDep) -> dict[str, Any]:
    """Register a tenant (create permission on the pool) or change one (edit permission), as hosts."""
    await _authorized("POST", user)
    body = await _read_body(request, TenantBody)
    status = await run_in_threadpool(_call, "status")
    if any(t["name"] == tenant for t in status.get("tenants", ())):
        await _authorized("PUT", user)
    await run_in_threadpool(lambda: _call("add_tenant", tenant, guaranteed=body.guaranteed,
                                          max_slots=body.max_slots, weight=float(body.weight)))
    return {"tenant": tenant, "guaranteed": body.guaranteed, "max_slots": body.max_slots,
            "weight": float(body.weight)}


@app.delete("/tenants/{tenant}")
def remove_tenant(tenant: Tenant, user: GetUserDep) -> dict[str, Any]:
    """Remove a tenant no unfinished job belongs to (delete permission on the pool)."""
    _authorize("DELETE", user)
    _call("remove_tenant", tenant)
    return {"tenant": tenant, "removed": True}


# --- pool -------------------------------------------------------------------------------------


@app.patch("/settings")
async def configure(request: Request, user: GetUserDep) -> dict[str, Any]:
    """Change the given settings (none: re-plan only); returns every setting."""
    await _authorized("PUT", user)
    body = await _read_body(request, SettingsBody)
    return await run_in_threadpool(_call, "configure", **body.model_dump(exclude_none=True))


@app.delete("/events")
def prune_events(user: GetUserDep, older_than_days: float = Query(gt=0)) -> dict[str, Any]:
    """Delete events older than ``older_than_days`` (a job holding a lease keeps its events)."""
    _authorize("DELETE", user)
    if not math.isfinite(older_than_days) or older_than_days > MAX_LOOKBACK_H / 24:
        raise HTTPException(status_code=422, detail=f"older_than_days={older_than_days}: must be finite and "
                            f"<= {MAX_LOOKBACK_H / 24:g}")
    return {"deleted": _call("prune_events", older_than_days * 86400.0)}
