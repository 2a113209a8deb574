"""The plugin's HTTP API (``/elastic-ops``): every route needs an Airflow login, the auth
manager's pool permissions decide who may read and who may change, bodies are strict, refused
values name the field, and the status page escapes what the ledger holds.

Authorization runs Airflow's real ``SimpleAuthManager`` on users of its roles; only the token
check is bypassed here (the e2e test does it with real tokens against a real api-server)."""

from __future__ import annotations

import time
from urllib.parse import urlencode

import pytest
from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from elastic_ops.plugin import api as plugin_api
from elastic_ops.pool import PoolClient

# (method, path, json body or None): one of each route, with a valid request
CHANGES = [
    ("POST", "/jobs/j/priority", {"priority": 5}),
    ("POST", "/jobs/j/bounds", {"min_workers": 2, "max_workers": 3}),
    ("POST", "/jobs/j/preemptible", {"preemptible": False}),
    ("POST", "/jobs/j/selector", {"selector": {"gpu": "h200"}}),
    ("PUT", "/hosts/h3", {"slots": 2, "labels": {"gpu": "h200"}}),
    ("POST", "/hosts/h2/state", {"state": "draining"}),
    ("PATCH", "/settings", {"policy": "fairshare", "lease_ttl_s": 30}),
    ("DELETE", "/events?older_than_days=1", None),
]
READS = [("GET", "/status", None), ("GET", "/events", None), ("GET", "/ui", None),
         ("GET", "/usage?hours=2", None), ("GET", "/nodes", None), ("GET", "/timeline?job=j", None),
         ("GET", "/ui/job?dag_id=d&run_id=r", None), ("GET", "/ui/static/ui.js", None)]
VIEWS = ("/ui", "/ui/job?dag_id=d&run_id=r")  # pages: without a login, to the login page and back


def make_api(tmp_path, monkeypatch, role: str | None = "op") -> tuple[TestClient, PoolClient]:
    """The API on a fresh ledger (hosts h1, h2 with 4 slots; job ``j`` 1..4, priority 2), called
    as a user of ``role`` (None: no user override, so the real token check runs)."""
    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}")
    pool.add_host("h1", 4)
    pool.add_host("h2", 4)
    pool.submit("j", min_workers=1, max_workers=4, priority=2)
    monkeypatch.setattr(plugin_api, "_client", lambda: pool)
    monkeypatch.setattr(plugin_api, "_nodes", lambda: None)  # no cluster, unless a test says so
    monkeypatch.setattr(plugin_api, "_run_chunks", lambda dag_id, run_id: [])  # no Airflow metadata here
    monkeypatch.setattr(plugin_api, "_recent_runs", dict)
    monkeypatch.setattr(plugin_api, "_totals", lambda refs: {})
    monkeypatch.setattr("airflow.api_fastapi.app.get_auth_manager", SimpleAuthManager)
    if role is not None:
        user = SimpleAuthManagerUser(username=f"a-{role}", role=role)
        monkeypatch.setitem(plugin_api.app.dependency_overrides, get_user, lambda: user)
    return TestClient(plugin_api.app), pool


def call(client: TestClient, method: str, path: str, body):
    if body is None:
        return client.request(method, path, follow_redirects=False)
    return client.request(method, path, json=body, follow_redirects=False)


def job(pool: PoolClient) -> dict:
    return next(j for j in pool.status()["jobs"] if j["name"] == "j")


def host(pool: PoolClient, name: str) -> dict | None:
    return next((h for h in pool.status()["hosts"] if h["name"] == name), None)


@pytest.mark.parametrize(("method", "path", "body"), CHANGES + READS)
def test_every_route_refuses_requests_without_a_login(tmp_path, monkeypatch, method, path, body):
    client, pool = make_api(tmp_path, monkeypatch, role=None)
    before = pool.status()
    r = call(client, method, path, body)
    if path in VIEWS:
        assert r.status_code == 303 and "/login" in r.headers["location"], r.text
        assert r.headers["location"].endswith("?" + urlencode({"next": "/" + path.split("/", 1)[1]}))
        assert "h1" not in r.text
    else:
        assert r.status_code == 401
    assert pool.status()["jobs"] == before["jobs"] and pool.status()["hosts"] == before["hosts"]


def test_a_viewer_reads_the_pool_but_changes_nothing(tmp_path, monkeypatch):
    client, pool = make_api(tmp_path, monkeypatch, role="viewer")
    for method, path, body in READS:
        assert call(client, method, path, body).status_code == 200, path
    events = len(pool.events())
    for method, path, body in CHANGES:
        r = call(client, method, path, body)
        assert r.status_code == 403, (path, r.text)
        assert "elastic_ops pool" in r.json()["detail"]
    assert job(pool)["priority"] == 2 and job(pool)["preemptible"]
    assert host(pool, "h2")["state"] == "up" and host(pool, "h3") is None
    assert pool.status()["settings"]["policy"] == "priority"
    assert len(pool.events()) == events


def test_an_operator_controls_jobs_hosts_and_settings(tmp_path, monkeypatch):
    client, pool = make_api(tmp_path, monkeypatch, role="op")
    for method, path, body in CHANGES:
        r = call(client, method, path, body)
        assert r.status_code == 200, (path, r.text)
    j = job(pool)
    assert (j["priority"], j["min_workers"], j["max_workers"], j["preemptible"]) == (5, 2, 3, False)
    assert j["selector"] == {"gpu": "h200"}
    assert host(pool, "h2")["state"] == "draining"
    assert host(pool, "h3") == {**host(pool, "h3"), "slots": 2, "state": "up", "labels": {"gpu": "h200"}}
    settings = pool.status()["settings"]
    assert (settings["policy"], settings["lease_ttl_s"]) == ("fairshare", 30)
    assert client.patch("/settings", json={}).json() == settings  # nothing to change: every setting
    assert client.post("/hosts/h2/state", json={"state": "up"}).status_code == 200
    assert host(pool, "h2")["state"] == "up"


@pytest.mark.parametrize(("method", "path", "body", "code", "says"), [
    ("POST", "/jobs/j/bounds", {"min_workers": 3, "max_workers": 2}, 400, "min_workers"),
    ("POST", "/jobs/nope/bounds", {"min_workers": 1, "max_workers": 2}, 404, "unknown job 'nope'"),
    ("POST", "/jobs/nope/priority", {"priority": 3}, 404, "unknown job 'nope'"),
    ("POST", "/jobs/nope/preemptible", {"preemptible": True}, 404, "unknown job 'nope'"),
    ("POST", "/hosts/nope/state", {"state": "down"}, 404, "unknown host 'nope'"),
    ("PATCH", "/settings", {"policy": "fastest"}, 400, "invalid policy='fastest'"),
    ("PATCH", "/settings", {"lease_ttl_s": 0}, 400, "lease_ttl_s"),
    ("PATCH", "/settings", {"failure_threshold": 0}, 400, "failure_threshold"),
    ("PUT", "/hosts/bad%20name", {"slots": 2}, 400, "host"),
    # strict bodies: nothing coerced, nothing unknown, nothing missing (422 names the field)
    ("POST", "/jobs/j/bounds", {"min_workers": "1", "max_workers": 2}, 422, "min_workers"),
    ("POST", "/jobs/j/bounds", {"min_workers": 0, "max_workers": 2}, 422, "min_workers"),
    ("POST", "/jobs/j/preemptible", {"preemptible": "yes"}, 422, "preemptible"),
    ("POST", "/jobs/j/selector", {"selector": {"": "x"}}, 400, "label name"),
    ("POST", "/jobs/j/selector", {"selector": {"gpu": 1}}, 422, "selector"),
    ("POST", "/jobs/j/priority", {"priority": 3, "extra": 1}, 422, "extra"),
    ("PUT", "/hosts/h3", {"slots": 2.0}, 422, "slots"),
    ("PUT", "/hosts/h3", {"slots": 2, "labels": {"gpu": 1}}, 422, "labels"),
    ("POST", "/hosts/h1/state", {"state": "broken"}, 422, "state"),
    ("PATCH", "/settings", {"lease_ttl_s": "30"}, 422, "lease_ttl_s"),
    ("PATCH", "/settings", {"policies": "fairshare"}, 422, "policies"),
    ("DELETE", "/events?older_than_days=0", None, 422, "older_than_days"),
    ("DELETE", "/events?older_than_days=inf", None, 422, "older_than_days"),
    ("DELETE", "/events", None, 422, "older_than_days"),
    ("GET", "/events?last=0", None, 422, "last"),
    ("GET", "/usage?hours=0", None, 422, "hours"),
    ("GET", "/usage?hours=inf", None, 400, "hours"),
    # finite, but past what seconds and the ledger's integers hold (was a 500 / a null result)
    ("DELETE", "/events?older_than_days=1e307", None, 422, "older_than_days"),
    ("GET", "/usage?hours=1e308", None, 400, "hours=1e+308"),
    ("GET", "/events?since_id=99999999999999999999", None, 422, "since_id"),
])
def test_refused_values_change_nothing_and_say_why(tmp_path, monkeypatch, method, path, body, code, says):
    client, pool = make_api(tmp_path, monkeypatch)
    before = pool.status()
    r = call(client, method, path, body)
    assert r.status_code == code, r.text
    assert says in r.text
    after = pool.status()
    for part in ("jobs", "hosts", "settings"):
        assert after[part] == before[part], part


def test_events_filter_by_job_since_and_last(tmp_path, monkeypatch):
    client, pool = make_api(tmp_path, monkeypatch, role="viewer")
    every = client.get("/events").json()
    assert [e["id"] for e in every] == sorted(e["id"] for e in every) and len(every) >= 3
    assert client.get("/events?last=2").json() == every[-2:]
    assert client.get(f"/events?since_id={every[0]['id']}").json() == every[1:]
    assert {e["job"] for e in client.get("/events?job=j").json()} == {"j"}


def test_status_page_shows_the_pool_and_escapes_what_the_ledger_holds(tmp_path, monkeypatch):
    client, pool = make_api(tmp_path, monkeypatch, role="viewer")
    pool.add_host("h4", 1, {"owner": "<script>alert(1)</script>"})
    r = client.get("/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    page = r.text
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 1 and '<script src="/elastic-ops/ui/static/ui.js" defer>' in page
    for text in ("h1", "h2", "<td>j</td>", "<td>1..4</td>", "slots used 0 of 9 up", "policy priority"):
        assert text in page, text


def test_node_agents_are_listed_and_hosts_without_one_named(tmp_path, monkeypatch, redis_url):

    from elastic_ops.agent.cluster import NodeConfig
    from elastic_ops.agent.node_client import NodeClient
    from tests.agent.node_helpers import SECRET, drop_namespace, make_config

    client, pool = make_api(tmp_path, monkeypatch, role="viewer")
    assert client.get("/nodes").json() == {"cluster": False, "nodes": {}}
    assert "Node agents" not in client.get("/ui").text  # no cluster: no section
    config = make_config()
    try:
        info = {"host": "h1", "pid": 42, "version": 1, "chunks": 1, "addr": "10.0.0.7", "at": time.time()}
        config.redis().set(config.alive_key("h1"), config.announcement("h1", info), ex=60)
        monkeypatch.setattr(plugin_api, "_nodes", lambda: NodeClient(config))
        assert client.get("/nodes").json() == {"cluster": True, "nodes": {"h1": info}}
        page = client.get("/ui").text
        assert "<h3>Node agents</h3>" in page and "<td>10.0.0.7</td>" in page
        assert "without a live node agent (they get no chunks): h2" in page
    finally:
        drop_namespace(config)
    gone = NodeConfig(url="redis://127.0.0.1:1/0", secret=SECRET, namespace="x")  # nothing listens there
    monkeypatch.setattr(plugin_api, "_nodes", lambda: NodeClient(gone))
    r = client.get("/nodes")
    assert r.status_code == 503 and "unreachable" in r.json()["detail"]
    assert "unreachable" in client.get("/ui").text


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"])
def test_no_route_is_served_without_a_login_not_even_fastapis_own(tmp_path, monkeypatch, path):
    client, _ = make_api(tmp_path, monkeypatch, role=None)
    assert client.get(path).status_code == 404


@pytest.mark.parametrize(("path", "status"), [
    ("/events?job=a%01b", 400),  # a name the pool refuses: its message, not a 500
    ("/events?job=" + "a" * 300, 422),  # refused before anything echoes it
    ("/jobs/" + "a" * 300 + "/priority", 422),
])
def test_bad_names_are_refused_not_server_errors(tmp_path, monkeypatch, path, status):
    client, _ = make_api(tmp_path, monkeypatch)
    method = "POST" if path.endswith("priority") else "GET"
    r = client.request(method, path, json={"priority": 3} if method == "POST" else None)
    assert r.status_code == status, r.text


@pytest.mark.parametrize(("method", "path", "body"), READS[:4] + CHANGES)
def test_a_ledger_out_of_reach_is_503_without_the_databases_address(
    tmp_path, monkeypatch, method, path, body
):
    """It was a 500 on the reading routes and a 400 (not retryable, naming the database's
    host and user) on the others."""
    from elastic_ops.errors import LedgerUnavailableError

    client, _ = make_api(tmp_path, monkeypatch)

    def unreachable():
        raise LedgerUnavailableError("pool ledger postgresql://pool:***@db.internal:5432/pool unreachable")

    monkeypatch.setattr(plugin_api, "_client", unreachable)
    r = call(client, method, path, body)
    assert r.status_code == 503, r.text
    assert "db.internal" not in r.text and "not reachable now" in r.json()["detail"]


def test_re_registering_a_host_needs_edit_permission_not_only_create(tmp_path, monkeypatch):
    """PUT /hosts/{host} also re-enables and resizes a host: with create alone, a user could undo
    a drain."""
    client, pool = make_api(tmp_path, monkeypatch)

    class CreateOnly:
        def is_authorized_pool(self, *, method, details, user):
            return method in ("GET", "POST")

    monkeypatch.setattr("airflow.api_fastapi.app.get_auth_manager", CreateOnly)
    assert client.put("/hosts/h9", json={"slots": 2}).status_code == 200  # a new host: create
    pool.drain_host("h1")
    assert client.put("/hosts/h1", json={"slots": 8}).status_code == 403
    assert host(pool, "h1")["state"] == "draining" and host(pool, "h1")["slots"] == 4


@pytest.mark.parametrize(("method", "path", "raw", "field"), [
    ("POST", "/jobs/j/priority", '{"priority": NaN}', "priority"),
    ("PUT", "/hosts/h9", '{"slots": Infinity}', "slots"),
    ("PATCH", "/settings", '{"failure_threshold": 1e400}', "failure_threshold"),
])
def test_a_non_finite_number_in_a_body_is_a_422_naming_it(tmp_path, monkeypatch, method, path, raw, field):
    """Python's JSON parser takes NaN, Infinity and 1e400; echoing them back in FastAPI's 422
    failed the response itself: a 500 (a probe)."""
    client, pool = make_api(tmp_path, monkeypatch)
    before = pool.status()
    r = client.request(method, path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"][-1] == field and error["input"] in ("nan", "inf")
    assert pool.status()["hosts"] == before["hosts"] and pool.status()["jobs"] == before["jobs"]


BODIED = [(m, p) for m, p, b in CHANGES if b is not None]


@pytest.mark.parametrize(("method", "path"), BODIED)
def test_a_user_who_may_not_change_gets_403_before_the_body_is_read(tmp_path, monkeypatch, method, path):
    # a viewer's change is refused as such whatever the body: not a 422 that would tell it the
    # body's shape, and not after parsing megabytes (the body is never read)
    client, pool = make_api(tmp_path, monkeypatch, role="viewer")
    for raw in ('{"nonsense": 1}', "not json", "{" * 100_000, "x" * (2 * plugin_api.MAX_BODY_BYTES)):
        r = client.request(method, path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 403, (raw[:20], r.text)
    assert host(pool, "h3") is None and job(pool)["priority"] == 2


def test_a_body_over_the_cap_is_413_and_changes_nothing(tmp_path, monkeypatch):
    client, pool = make_api(tmp_path, monkeypatch)
    big = '{"selector": {"gpu": "' + "a" * plugin_api.MAX_BODY_BYTES + '"}}'
    r = client.post("/jobs/j/selector", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "bytes" in r.json()["detail"]

    def chunks():  # no content-length: the cap holds while reading
        yield b'{"selector": {"gpu": "'
        for _ in range(100):
            yield b"a" * 1024
        yield b'"}}'

    r = client.post("/jobs/j/selector", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert job(pool)["selector"] == {}


@pytest.mark.parametrize(("raw", "says"), [
    ('{"priority": 3, "priority": 900}', "'priority' appears twice"),
    ('{"priority": 3', "not valid JSON"),
    ("", "not valid JSON"),
    ("[" * 20_000 + "]" * 20_000, "nested too deeply"),
])
def test_a_body_that_is_not_one_strict_json_object_is_a_422(tmp_path, monkeypatch, raw, says):
    client, pool = make_api(tmp_path, monkeypatch)
    r = client.post("/jobs/j/priority", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and says in r.text, r.text
    assert job(pool)["priority"] == 2


class _DagEditor:
    """May read the pool and edit DAG ``d`` only (not the pool)."""

    def is_authorized_pool(self, *, method, details, user):
        return method == "GET"

    def is_authorized_dag(self, *, method, details, user, access_entity=None):
        return details.id == "d"


def test_a_jobs_priority_and_bounds_need_edit_permission_on_its_dag(tmp_path, monkeypatch):
    client, pool = make_api(tmp_path, monkeypatch)
    pool.submit("k", min_workers=1, max_workers=4, dag_id="d")
    pool.submit("other", min_workers=1, max_workers=4, dag_id="e")
    monkeypatch.setattr("airflow.api_fastapi.app.get_auth_manager", _DagEditor)
    assert client.post("/jobs/k/priority", json={"priority": 7}).status_code == 200
    assert client.post("/jobs/k/bounds", json={"min_workers": 1, "max_workers": 2}).status_code == 200
    r = client.post("/jobs/other/priority", json={"priority": 7})
    assert r.status_code == 403 and "DAG e" in r.json()["detail"]
    # a job from no DAG: the pool's edit permission, which this user lacks; so for selectors
    assert client.post("/jobs/j/priority", json={"priority": 7}).status_code == 403
    assert client.post("/jobs/k/selector", json={"selector": {}}).status_code == 403
    jobs = {j["name"]: j for j in pool.status()["jobs"]}
    assert (jobs["k"]["priority"], jobs["k"]["max_workers"]) == (7, 2)
    assert jobs["other"]["priority"] == 1 and jobs["j"]["priority"] == 2


def test_tenants_through_the_api_need_the_pools_permissions(tmp_path, monkeypatch):
    client, pool = make_api(tmp_path, monkeypatch, role="op")
    assert client.put("/tenants/vision", json={"guaranteed": 4, "max_slots": 6}).status_code == 200
    (t,) = [t for t in client.get("/status").json()["tenants"] if t["name"] == "vision"]
    assert (t["guaranteed"], t["max_slots"], t["weight"]) == (4, 6, 1.0)
    r = client.put("/tenants/vision", json={"guaranteed": 8, "max_slots": 6})
    assert r.status_code == 400 and "max_slots" in r.json()["detail"]
    assert client.delete("/tenants/vision").status_code == 200
    viewer, _ = make_api(tmp_path / "v", monkeypatch, role="viewer")
    assert viewer.put("/tenants/nlp", json={"guaranteed": 1}).status_code == 403
