"""The plugin's HTTP API, mounted by the api-server at ``/elastic-ops``.

Every route needs an authenticated Airflow user (JWT bearer token or the UI's session cookie);
reading needs pool read access, changing a job's priority needs pool edit access, both through
the configured auth manager.
"""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from elastic_ops.errors import ElasticOpsError, UnknownJobError


def _authorize(method: str, user: Any) -> None:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import PoolDetails

    if not get_auth_manager().is_authorized_pool(method=method, details=PoolDetails(name="elastic_ops"),
                                                 user=user):
        raise HTTPException(status_code=403, detail=f"user may not {method} the elastic_ops pool")


def _client():
    from elastic_ops.hooks.elastic_ops import ElasticOpsHook

    return ElasticOpsHook().pool()


class PriorityBody(BaseModel):
    """``{"priority": N}``: an integer 1..1000, nothing coerced ("5", 5.0, true) and nothing else."""

    model_config = ConfigDict(extra="forbid")

    priority: StrictInt = Field(ge=1, le=1000)


app = FastAPI(title="elastic_ops pool", description="Resource pool status and runtime control")


@app.get("/status")
def pool_status(user: GetUserDep) -> dict[str, Any]:
    _authorize("GET", user)
    return _client().status()


@app.get("/events")
def pool_events(user: GetUserDep, job: str | None = None) -> list[dict[str, Any]]:
    _authorize("GET", user)
    return _client().events(job=job)


@app.post("/jobs/{job}/priority")
def set_priority(job: str, body: PriorityBody, user: GetUserDep) -> dict[str, Any]:
    _authorize("PUT", user)
    try:
        _client().set_priority(job, body.priority)
    except UnknownJobError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    except ElasticOpsError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from None
    return {"job": job, "priority": body.priority}
