"""``elastic-ops pool --api-url``: the same commands through Airflow's api-server (the plugin's
routes) instead of the ledger's database, with the same errors.

The api-server here is the plugin's real FastAPI app, mounted where Airflow mounts it, authorized
by Airflow's real ``SimpleAuthManager``; only Airflow's token check is replaced (bearer
``op-token`` / ``viewer-token``; ``POST /auth/token`` hands out ``op-token`` for ``op``/``pw``).
tests/e2e/test_airflow_e2e.py runs the CLI against a real api-server with a real login."""

from __future__ import annotations

import json

import pytest
from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi import FastAPI, HTTPException, Request
from fastapi.testclient import TestClient

from elastic_ops.errors import ApiAuthError, LedgerUnavailableError, PoolError, SpecError, UnknownJobError
from elastic_ops.plugin import api as plugin_api
from elastic_ops.pool import PoolClient
from elastic_ops.pool import api_client as api_module
from elastic_ops.pool.api_client import ApiPoolClient

from .cli_helper import run

ROLES = {"op-token": "op", "viewer-token": "viewer"}
BASE = "http://testserver"


def _user(request: Request) -> SimpleAuthManagerUser:
    token = request.headers.get("authorization", "").removeprefix("Bearer ")
    if token not in ROLES:
        raise HTTPException(status_code=401, detail="Not authenticated")
    return SimpleAuthManagerUser(username=ROLES[token], role=ROLES[token])


@pytest.fixture
def server(monkeypatch, sqlite_url):
    """(the ledger, an HTTP client for the api-server, the token requests it saw)"""
    pool = PoolClient(sqlite_url)
    logins: list[dict] = []
    airflow = FastAPI()

    @airflow.post("/auth/token")
    def token(body: dict) -> dict:
        logins.append(body)
        if body != {"username": "op", "password": "pw"}:
            raise HTTPException(status_code=401, detail="Invalid credentials")
        return {"access_token": "op-token"}

    airflow.mount("/elastic-ops", plugin_api.app)
    monkeypatch.setattr(plugin_api, "_client", lambda: pool)
    monkeypatch.setattr("airflow.api_fastapi.app.get_auth_manager", SimpleAuthManager)
    monkeypatch.setitem(plugin_api.app.dependency_overrides, get_user, _user)
    http = TestClient(airflow, base_url=BASE)
    monkeypatch.setattr(api_module.httpx, "Client", lambda **kwargs: http)  # what the CLI opens
    for var in ("ELASTIC_OPS_POOL_URL", "ELASTIC_OPS_API_TOKEN", "ELASTIC_OPS_API_USER",
                "ELASTIC_OPS_API_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ELASTIC_OPS_API_URL", BASE)
    return pool, http, logins


def test_the_pool_commands_work_through_the_api_server(server, monkeypatch, capsys):
    pool, _, _ = server
    monkeypatch.setenv("ELASTIC_OPS_API_TOKEN", "op-token")
    assert run(["pool", "add-host", "gpu-0", "8", "--label", "zone=a"]) == 0
    assert run(["pool", "add-host", "gpu-1", "4"]) == 0
    pool.submit("train", min_workers=1, max_workers=8)
    pool.request("train")
    for argv in (["set-priority", "train", "7"], ["set-bounds", "train", "2", "4"],
                 ["set-preemptible", "train", "false"], ["drain", "gpu-0"],
                 ["set-selector", "train", "--label", "zone=a"],
                 ["set-host-state", "gpu-1", "down"], ["configure", "--policy", "fairshare"]):
        assert run(["pool", *argv]) == 0, argv
    capsys.readouterr()
    assert run(["pool", "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    def timeless(jobs):
        return [{k: v for k, v in j.items() if k != "lease_expires_in"} for j in jobs]

    assert timeless(st["jobs"]) == timeless(pool.status()["jobs"])
    job = st["jobs"][0]
    assert (job["priority"], job["min_workers"], job["max_workers"], job["preemptible"]) == (7, 2, 4, False)
    assert {h["name"]: h["state"] for h in st["hosts"]} == {"gpu-0": "draining", "gpu-1": "down"}
    assert st["hosts"][0]["labels"] == {"zone": "a"} and st["settings"]["policy"] == "fairshare"
    assert job["selector"] == {"zone": "a"}
    assert run(["pool", "status"]) == 0
    assert "gpu-0" in capsys.readouterr().out
    assert run(["pool", "events", "--job", "train", "--json"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert lines == [json.loads(json.dumps(e)) for e in pool.events("train")]
    # the filters travel to the ledger through the api-server
    assert run(["pool", "events", "--kind", "host,grant", "--since", "1h", "--last", "3", "--json"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert lines == [json.loads(json.dumps(e)) for e in pool.events(kinds=["host", "grant"], last=3)]
    assert run(["pool", "set-priority", "train", "9"]) == 0
    assert capsys.readouterr().out == "job train: priority 7 -> 9\n"  # changes print over the api too
    assert run(["pool", "usage", "--json"]) == 0
    used = json.loads(capsys.readouterr().out)
    assert {j["job"] for j in used["jobs"]} == {"train"} and used["slot_hours"] >= 0
    assert run(["pool", "prune-events", "--older-than-days", "1"]) == 0
    assert "deleted 0 events" in capsys.readouterr().out


def test_a_login_is_exchanged_for_a_token_once(server, monkeypatch):
    pool, http, logins = server
    client = ApiPoolClient(BASE, username="op", password="pw", http=http)
    client.add_host("h", 2)
    client.set_host_state("h", "draining")
    assert len(logins) == 1 and pool.status()["hosts"][0]["state"] == "draining"
    with pytest.raises(ApiAuthError, match="refused the login of 'op'") as err:
        ApiPoolClient(BASE, username="op", password="wrong", http=http).status()
    assert "wrong" not in str(err.value)


@pytest.mark.parametrize(("token", "call", "error", "says"), [
    ("viewer-token", lambda c: c.add_host("h", 2), ApiAuthError, "HTTP 403"),
    ("nobody", lambda c: c.status(), ApiAuthError, "HTTP 401"),
    ("op-token", lambda c: c.set_priority("nope", 3), UnknownJobError, "unknown job 'nope'"),
    ("op-token", lambda c: c.set_host_state("nope", "up"), PoolError, "unknown host 'nope'"),
    ("op-token", lambda c: c.set_bounds("j", 3, 2), PoolError, "min_workers"),
    ("op-token", lambda c: c.set_priority("j", 0), PoolError, "priority"),
    ("op-token", lambda c: c.configure(policy="fastest"), PoolError, "policy='fastest': must be"),
])
def test_the_api_servers_refusals_are_the_pools_errors(server, token, call, error, says):
    pool, http, _ = server
    pool.submit("j", min_workers=1, max_workers=2)
    with pytest.raises(error, match=says):
        call(ApiPoolClient(BASE, token=token, http=http))


def test_an_api_server_without_the_plugin_is_named_as_such(server):
    _, http, _ = server
    client = ApiPoolClient(f"{BASE}/elsewhere", token="op-token", http=http)  # no plugin mounted there
    for call in (client.status, lambda: client.set_priority("j", 2)):
        with pytest.raises(PoolError, match="has no /elastic-ops/.* route") as err:
            call()
        assert not isinstance(err.value, UnknownJobError)


def test_an_api_server_whose_ui_answers_every_path_is_named_as_without_the_plugin():
    """Airflow's UI serves its page for any unknown GET (200, HTML) and refuses other methods
    (405): the client failed on the page as JSON, and called a 405 a refusal (a probe)."""
    from fastapi.responses import HTMLResponse

    airflow = FastAPI()

    @airflow.get("/{path:path}", response_class=HTMLResponse)
    def page(path: str) -> str:
        return "<!doctype html><title>Airflow</title>"

    @airflow.post("/auth/token", response_class=HTMLResponse)
    def login() -> str:
        return "<!doctype html>"

    http = TestClient(airflow, base_url=BASE)
    client = ApiPoolClient(BASE, token="op-token", http=http)
    for call in (client.status, client.events, lambda: client.set_priority("j", 2)):
        with pytest.raises(PoolError, match="has no /elastic-ops/.* route"):
            call()
    with pytest.raises(ApiAuthError, match="answered the login without a token"):
        ApiPoolClient(BASE, username="op", password="pw", http=http).status()


def test_bad_settings_are_refused_before_any_request(server, monkeypatch, capsys):
    with pytest.raises(ApiAuthError, match="no credentials for the api-server"):
        ApiPoolClient(BASE).status()
    # half a login says which half is missing (it said "no credentials" with the user name set)
    monkeypatch.setenv("ELASTIC_OPS_API_USER", "ops")
    with pytest.raises(ApiAuthError, match=r"the login of 'ops' for the api-server at .* lacks a password "
                                           r"\(hint: set \$ELASTIC_OPS_API_PASSWORD as well, or "
                                           r"\$ELASTIC_OPS_API_TOKEN instead\)"):
        ApiPoolClient(BASE).status()
    monkeypatch.delenv("ELASTIC_OPS_API_USER")
    monkeypatch.setenv("ELASTIC_OPS_API_PASSWORD", "s3cret")
    with pytest.raises(ApiAuthError, match=r"lacks a user name \(hint: set \$ELASTIC_OPS_API_USER") as err:
        ApiPoolClient(BASE).status()
    assert "s3cret" not in str(err.value)
    monkeypatch.delenv("ELASTIC_OPS_API_PASSWORD")
    with pytest.raises(SpecError, match="api_url"):
        ApiPoolClient("ftp://airflow")
    # were ValueError tracebacks at the CLI (an audit)
    assert run(["pool", "--api-url", "http://[::1", "status"]) == 2
    assert "Invalid IPv6 URL" in (err := capsys.readouterr().err) and "Traceback" not in err
    assert run(["pool", "--api-url", "http://airflow:notaport", "status"]) == 2
    assert "'notaport'" in (err := capsys.readouterr().err) and "Traceback" not in err
    with pytest.raises(SpecError, match="must not hold credentials") as err:
        ApiPoolClient("https://op:secret@airflow.example.com")
    assert "secret" not in str(err.value)
    assert run(["pool", "--pool-url", "sqlite:////tmp/x.db", "--api-url", BASE, "status"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_an_api_server_that_does_not_answer_is_retryable(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LedgerUnavailableError, match="unreachable") as err:
        ApiPoolClient(f"http://127.0.0.1:{port}", token="t").status()
    assert err.value.retryable


def test_node_agents_are_listed_through_the_api_server(server, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_API_TOKEN", "viewer-token")
    monkeypatch.delenv("ELASTIC_OPS_NODE_REDIS_URL", raising=False)
    announced = {"gpu-0": {"host": "gpu-0", "pid": 7, "version": 1, "chunks": 2, "addr": "10.0.0.7"}}

    class Nodes:
        def announced(self):
            return announced

    monkeypatch.setattr(plugin_api, "_nodes", lambda: Nodes())
    assert run(["nodes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == announced
    assert run(["nodes"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["HOST", "PID", "VERSION", "CHUNKS", "ADDRESS"]
    assert table[1].split() == ["gpu-0", "7", "1", "2", "10.0.0.7"]
    monkeypatch.setattr(plugin_api, "_nodes", lambda: None)  # the api-server has no cluster settings
    assert run(["nodes"]) != 0
    assert "unset on the api-server" in capsys.readouterr().err  # the CLI says what to set, and where


def test_tenants_through_the_api_server(server, monkeypatch, capsys):
    pool, _, _ = server
    monkeypatch.setenv("ELASTIC_OPS_API_TOKEN", "op-token")
    assert run(["pool", "add-tenant", "vision", "--guaranteed", "4", "--max", "8", "--weight", "2"]) == 0
    assert capsys.readouterr().out.startswith("tenant vision: added guaranteed 4, max 8, weight 2")
    (t,) = pool.status()["tenants"]
    assert (t["name"], t["guaranteed"], t["max_slots"], t["weight"]) == ("vision", 4, 8, 2.0)
    assert run(["pool", "add-tenant", "vision", "--guaranteed", "2"]) == 0  # changed: no max now
    assert pool.status()["tenants"][0]["max_slots"] is None
    assert run(["pool", "remove-tenant", "vision"]) == 0
    assert pool.status()["tenants"] == []
    monkeypatch.setenv("ELASTIC_OPS_API_TOKEN", "viewer-token")
    assert run(["pool", "add-tenant", "nlp", "--guaranteed", "1"]) == 2
    assert "HTTP 403" in capsys.readouterr().err
