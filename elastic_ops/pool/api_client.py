"""``ApiPoolClient``: the pool's reading and control methods through Airflow's api-server (the
plugin's routes, ``/elastic-ops``), for operators with an Airflow login but no credentials for
the ledger's database. Same method names, arguments and error types as :class:`PoolClient`'s,
so ``elastic-ops pool`` runs on either (``--api-url``).

The token: ``ELASTIC_OPS_API_TOKEN`` (a JWT the api-server issued), else one fetched from
``POST /auth/token`` with ``ELASTIC_OPS_API_USER`` / ``ELASTIC_OPS_API_PASSWORD`` (read from
the environment only, never from the command line, which ``ps`` shows; never logged).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

import httpx

from elastic_ops.errors import (
    ApiAuthError,
    LedgerUnavailableError,
    PoolError,
    SpecError,
    UnknownHostError,
    UnknownJobError,
)
from elastic_ops.urls import shown_url

if TYPE_CHECKING:
    from elastic_ops.pool.model import HostState

ENV_API_URL = "ELASTIC_OPS_API_URL"
ENV_API_TOKEN = "ELASTIC_OPS_API_TOKEN"
ENV_API_USER = "ELASTIC_OPS_API_USER"
ENV_API_PASSWORD = "ELASTIC_OPS_API_PASSWORD"  # noqa: S105 - a variable's name, not a password
PREFIX = "/elastic-ops"


def _check_base(url: str) -> str:
    try:
        parts = urlsplit(url or "")
        parts.port  # noqa: B018 - parsed on access: a port that is no number raises here
    except ValueError as exc:  # "Invalid IPv6 URL", "Port could not be cast to integer value"
        raise SpecError("api_url", shown_url(url), f"must be the api-server's http(s) URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise SpecError("api_url", url, "must be the api-server's http(s) URL, e.g. https://airflow.example.com")
    if parts.username or parts.password:
        raise SpecError("api_url", "<hidden: holds credentials>", "must not hold credentials",
                        hint=f"put them in ${ENV_API_TOKEN}, or ${ENV_API_USER} and ${ENV_API_PASSWORD}")
    return url.rstrip("/")


class ApiPoolClient:
    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        username: str | None = None,
        password: str | None = None,
        http: httpx.Client | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.url = _check_base(url or os.environ.get(ENV_API_URL, ""))
        self._token = token or os.environ.get(ENV_API_TOKEN) or None
        self._login = (username or os.environ.get(ENV_API_USER), password or os.environ.get(ENV_API_PASSWORD))
        self._http = http or httpx.Client(timeout=timeout)

    def __repr__(self) -> str:
        return f"ApiPoolClient({self.url!r})"

    # --- transport ----------------------------------------------------------------------

    def _bearer(self) -> str:
        if self._token is None:
            user, password = self._login
            if bool(user) != bool(password):  # half a login: say which half (never the password)
                lacking, env = ("a password", ENV_API_PASSWORD) if user else ("a user name", ENV_API_USER)
                whose = f" of {user!r}" if user else ""
                raise ApiAuthError(
                    f"the login{whose} for the api-server at {self.url} lacks {lacking}",
                    hint=f"set ${env} as well, or ${ENV_API_TOKEN} instead",
                )
            if not user or not password:
                raise ApiAuthError(
                    f"no credentials for the api-server at {self.url}",
                    hint=f"set ${ENV_API_TOKEN}, or ${ENV_API_USER} and ${ENV_API_PASSWORD}",
                )
            r = self._send("POST", f"{self.url}/auth/token", json={"username": user, "password": password})
            if r.status_code >= 400:
                raise ApiAuthError(f"the api-server at {self.url} refused the login of {user!r} "
                                   f"(HTTP {r.status_code})", hint="check the user name and password")
            body = _json(r)
            token = body.get("access_token") if isinstance(body, dict) else None
            if not isinstance(token, str):
                raise ApiAuthError(f"the api-server at {self.url} answered the login without a token "
                                   f"(HTTP {r.status_code})", hint="is the URL Airflow 3's api-server?")
            self._token = token
        return self._token

    def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise LedgerUnavailableError(f"api-server {self.url} unreachable: {type(exc).__name__}: {exc}",
                                         hint="check the URL and that the api-server is up") from None

    def _call(self, method: str, path: str, *, json: object = None, params: dict | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self._bearer()}"}
        r = self._send(method, f"{self.url}{PREFIX}{path}", json=json, params=params, headers=headers)
        no_route = PoolError(f"the api-server at {self.url} has no {PREFIX}{path} route",
                             hint="install elastic-ops where the api-server runs (its plugin serves it)")
        if r.status_code < 400:
            if not r.content:
                return None
            if (body := _json(r)) is _NOT_JSON:  # the UI's page for any unknown path: no plugin here
                raise no_route
            return body
        detail = _detail(r)
        if r.status_code in (401, 403):
            raise ApiAuthError(f"{method} {PREFIX}{path}: HTTP {r.status_code}: {detail}",
                               hint="log in again (the token may have expired)" if r.status_code == 401
                               else "ask for the permission on the Airflow pool 'elastic_ops'")
        if (r.status_code, detail) in ((404, "Not Found"), (405, "Method Not Allowed")):  # no such route
            raise no_route
        if r.status_code == 404 and path.startswith("/jobs/"):
            raise UnknownJobError(_unquoted(path, 2))
        if r.status_code == 404 and path.startswith("/hosts/"):
            raise UnknownHostError(_unquoted(path, 2))
        if r.status_code >= 500:
            raise LedgerUnavailableError(f"{method} {PREFIX}{path}: HTTP {r.status_code}: {detail}")
        raise PoolError(f"{method} {PREFIX}{path} refused (HTTP {r.status_code}): {detail}")

    # --- reading ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/status")

    def events(
        self, job: str | None = None, *, since_id: int = 0, last: int | None = None,
        since_ts: float | None = None, kinds: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"since_id": since_id}
        if job is not None:
            params["job"] = job
        if last is not None:
            params["last"] = last
        if since_ts is not None:
            params["since_ts"] = since_ts
        if kinds:
            params["kind"] = list(kinds)
        events = self._call("GET", "/events", params=params)
        return [{**e, "slots": [tuple(x) for x in e["slots"]]} for e in events]

    def usage(self, *, hours: float | None = None) -> dict[str, Any]:
        return self._call("GET", "/usage", params={} if hours is None else {"hours": hours})

    def nodes(self) -> dict[str, Any]:
        """``{"cluster": bool, "nodes": {host: announcement}}`` (``elastic-ops nodes --api-url``)."""
        return self._call("GET", "/nodes")

    # --- control ------------------------------------------------------------------------

    def set_priority(self, job: str, priority: int) -> None:
        self._call("POST", f"/jobs/{_q(job)}/priority", json={"priority": priority})

    def set_bounds(self, job: str, min_workers: int, max_workers: int) -> None:
        body = {"min_workers": min_workers, "max_workers": max_workers}
        self._call("POST", f"/jobs/{_q(job)}/bounds", json=body)

    def set_selector(self, job: str, selector: dict[str, str] | None) -> None:
        self._call("POST", f"/jobs/{_q(job)}/selector", json={"selector": dict(selector or {})})

    def set_preemptible(self, job: str, preemptible: bool) -> None:
        self._call("POST", f"/jobs/{_q(job)}/preemptible", json={"preemptible": preemptible})

    def drain_host(self, name: str) -> None:
        self.set_host_state(name, "draining")

    def set_host_state(self, name: str, state: HostState | str) -> None:
        self._call("POST", f"/hosts/{_q(name)}/state", json={"state": str(getattr(state, "value", state))})

    def add_host(self, name: str, slots: int, labels: dict[str, str] | None = None) -> None:
        self._call("PUT", f"/hosts/{_q(name)}", json={"slots": slots, "labels": dict(labels or {})})

    def add_tenant(self, name: str, *, guaranteed: int, max_slots: int | None = None,
                   weight: float = 1.0) -> None:
        body = {"guaranteed": guaranteed, "max_slots": max_slots, "weight": weight}
        self._call("PUT", f"/tenants/{_q(name)}", json=body)

    def remove_tenant(self, name: str) -> None:
        self._call("DELETE", f"/tenants/{_q(name)}")

    def configure(self, **settings: object) -> dict[str, Any]:
        return self._call("PATCH", "/settings", json=settings)

    def prune_events(self, older_than_s: float) -> int:
        out = self._call("DELETE", "/events", params={"older_than_days": older_than_s / 86400.0})
        return int(out["deleted"])


def _q(name: str) -> str:
    return quote(str(name), safe="")


def _unquoted(path: str, part: int) -> str:
    return unquote(path.split("/")[part])


_NOT_JSON = object()


def _json(r: httpx.Response) -> Any:
    """The response's JSON body, or ``_NOT_JSON`` (an HTML page: a server without the plugin)."""
    if "json" not in r.headers.get("content-type", ""):
        return _NOT_JSON
    try:
        return r.json()
    except ValueError:
        return _NOT_JSON


def _detail(r: httpx.Response) -> str:
    """The api-server's reason: FastAPI's ``detail`` (a message, or validation errors)."""
    body = _json(r)
    if not isinstance(body, dict):
        return r.text[:500]
    detail = body.get("detail", r.text[:500])
    if isinstance(detail, list):  # 422: [{"loc": [...], "msg": ...}, ...]
        return "; ".join(f"{'.'.join(str(x) for x in d.get('loc', [])[1:])}: {d.get('msg')}"
                         for d in detail if isinstance(d, dict))
    return str(detail)
