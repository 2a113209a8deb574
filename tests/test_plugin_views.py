"""The timeline route and the two views (pool, job) of the plugin, on a scripted ledger: the
seed sequence as the charts' series, ranges and point limits, the plan's reasons, controls only
for users who may change the pool, filters and paging of the event log, and every value from the
ledger or Airflow escaped. (The real browser against a real api-server: tests/e2e/test_airflow_e2e.py.)"""

from __future__ import annotations

import re
from urllib.parse import quote

import pytest

from elastic_ops.plugin import api as plugin_api
from elastic_ops.plugin.runs import ChunkInfo, TryInfo
from elastic_ops.pool import PoolClient
from elastic_ops.timeline import MAX_POINTS, allocation_sequence, compute
from tests.pool.conftest import Clock
from tests.test_plugin_api import make_api

T0 = 1_796_300_000.0
EVIL = '<img src=x onerror="alert(1)">'


def seed(pool: PoolClient, clock: Clock, job2: str = "job2") -> None:
    """The seed scenario on 8 slots: job 1 alone 8; job 2 arrives 4 / 4; its priority 5: 3 / 5;
    job 1 finishes: 0 / 8 — each step 30 s apart, each shrink done at the next heartbeat."""
    pool.configure(policy="priority", preemption="graceful", min_rescale_interval_s=0.0, min_gain=0.0)
    pool.add_host("gpu-0", 8)
    pool.submit("job1", min_workers=1, max_workers=8, priority=3)
    g1 = pool.request("job1")
    clock.advance(30)
    pool.submit(job2, min_workers=1, max_workers=8, priority=3)
    pool.request(job2)
    pool.heartbeat("job1", g1.epoch, workers=8)
    clock.advance(1)
    pool.heartbeat("job1", g1.epoch, workers=4)
    g2 = pool.request(job2)
    clock.advance(30)
    pool.set_priority(job2, 5)
    pool.heartbeat("job1", g1.epoch, workers=4)
    clock.advance(1)
    pool.heartbeat("job1", g1.epoch, workers=3)
    pool.heartbeat(job2, g2.epoch, workers=4)
    clock.advance(30)
    pool.release("job1", g1.epoch, finished=True)
    pool.heartbeat(job2, g2.epoch, workers=5)
    clock.advance(5)


@pytest.fixture
def seeded(tmp_path, monkeypatch):
    """The API (as an operator) on a ledger that went through the seed scenario."""
    client, _ = make_api(tmp_path, monkeypatch, role="op")
    clock = Clock(T0)
    pool = PoolClient(f"sqlite:///{tmp_path / 'seed.db'}", clock=clock)
    monkeypatch.setattr(plugin_api, "_client", lambda: pool)
    seed(pool, clock)
    return client, pool, clock


def test_the_timeline_route_draws_the_seed_sequence_with_the_plans_reasons(seeded):
    client, pool, _ = seeded
    tl = client.get("/timeline").json()
    held = {j: [n for _, n in pts] for j, pts in tl["held"].items()}
    assert held == {"job1": [8, 4, 3, 0], "job2": [4, 5, 8]}
    assert [n for _, n in tl["capacity"]] == [8]
    assert tl["truncated"] is False and tl["progress"] == {}
    # the series are the ones the demo's PNG and the e2e checks replay: one computation
    assert compute(pool.events()).to_dict()["held"] == tl["held"]
    seq = allocation_sequence(pool.events(), ["job1", "job2"])
    assert seq == [(8, 0), (4, 0), (4, 4), (3, 4), (3, 5), (0, 5), (0, 8)]
    shrink = next(c for c in tl["changes"] if c["job"] == "job1" and c["kind"] == "shrink")
    assert shrink["workers"] == 4 and "share 4 of 8" in shrink["reason"]
    one = client.get("/timeline?job=job2").json()
    assert set(one["held"]) == {"job2"} and {c["job"] for c in one["changes"]} == {"job2"}
    assert one["capacity"] and one["start"] == pytest.approx(T0 + 30)  # from the job's first event


def test_a_range_starts_with_the_state_in_force_and_a_limit_keeps_the_newest(seeded):
    client, _, _ = seeded
    since = T0 + 45  # between 4 / 4 and 3 / 5
    tl = client.get(f"/timeline?since_ts={since}&until_ts={T0 + 70}").json()
    assert tl["held"]["job1"][0] == [since, 4] and tl["held"]["job2"][0] == [since, 4]
    assert [n for _, n in tl["held"]["job1"]] == [4, 3]
    assert all(since <= c["ts"] <= T0 + 70 for c in tl["changes"])
    early = client.get(f"/timeline?since_ts={T0 - 3600}").json()  # before the log: from its first event
    assert early["start"] == pytest.approx(T0)
    small = client.get("/timeline?max_points=4").json()
    assert small["truncated"] is True
    points = sum(map(len, small["held"].values())) + len(small["capacity"]) + len(small["changes"])
    assert points <= 4 and small["held"]["job2"][-1][1] == 8  # the newest kept


@pytest.mark.parametrize(("query", "says"), [
    ("max_points=0", "max_points"), (f"max_points={MAX_POINTS + 1}", "max_points"),
    ("since_ts=-1", "since_ts"), ("since_ts=nan", "since_ts"), ("until_ts=1e12", "until_ts"),
    ("since_ts=200&until_ts=100", "until_ts"), ("job=" + "a" * 300, "job"),
    ("job=j&dag_id=d", "dag_id and run_id go together"),
])
def test_the_timeline_refuses_unbounded_or_bad_requests_naming_the_field(seeded, query, says):
    client, _, _ = seeded
    r = client.get(f"/timeline?{query}")
    assert r.status_code == 422 and says in r.text, r.text


def test_the_pool_view_shows_chart_hosts_jobs_and_events_as_the_ledger_has_them(seeded):
    client, pool, _ = seeded
    pool.submit("waiting-job", min_workers=9, max_workers=9, priority=1)  # can never fit: waits, says why
    page = client.get("/ui?range=all").text
    series = dict(re.findall(r'<polygon class="series" data-job="([^"]+)" data-workers="(\d+)"', page))
    assert series == {"job1": "0", "job2": "8"}
    assert 'data-capacity="8"' in page
    assert len(re.findall(r'<rect class="slot" data-host="gpu-0" data-job="job2"', page)) == 8
    live, finished = page.split('<details class="finished">')
    assert "<td>job2</td>" in live and "<td>waiting-job</td>" in live and "<td>job1</td>" not in live
    assert "Finished jobs (1)" in finished and "<td>job1</td>" in finished
    waiting = next(j for j in pool.status()["jobs"] if j["name"] == "waiting-job")
    assert f"<td>{waiting['reason']}</td>" in live and waiting["reason"]
    assert ">None<" not in page and "<td>None</td>" not in page
    assert 'data-path="/jobs/job2/priority"' in live and 'data-path="/hosts/gpu-0/state"' in page


def test_a_reader_sees_no_controls(tmp_path, monkeypatch):
    client, _ = make_api(tmp_path, monkeypatch, role="viewer")
    page = client.get("/ui").text
    assert "<td>j</td>" in page and 'class="control"' not in page and "needs edit permission" in page


def test_the_event_log_filters_by_job_host_and_kind_and_pages(seeded):
    client, pool, _ = seeded

    def rows(page: str) -> list[tuple[str, str]]:  # (kind, job) of the event log's rows
        log = page.split('<table class="events">')[1] if '<table class="events">' in page else ""
        return re.findall(r"<tr><td>[^<]+</td><td>(\w+)</td><td>([^<]*)</td>", log)

    kinds = {k for k, _ in rows(client.get("/ui?range=all&kind=shrink").text)}
    assert kinds == {"shrink"}
    assert {j for _, j in rows(client.get("/ui?range=all&job=job2").text)} == {"job2"}
    on_host = rows(client.get("/ui?range=all&host=gpu-0").text)
    assert on_host and all(k in {"host", "grant", "grow", "shrink", "release"} for k, _ in on_host)
    for n in range(60):  # more than a page
        pool.set_priority("job2", 1 + n % 9)
    first, second = client.get("/ui?range=all").text, client.get("/ui?range=all&page=1").text
    assert len(rows(first)) == 50 and 'class="page older"' in first and 'class="page newer"' in second
    total = len(pool.events())
    assert f"events 1–50 of {total}" in first and f"events 51–{min(100, total)} of {total}" in second
    assert client.get("/ui?range=forever").status_code == 422 and client.get("/ui?page=-1").status_code == 422


def test_every_value_from_the_ledger_and_airflow_is_escaped(tmp_path, monkeypatch):
    client, _ = make_api(tmp_path, monkeypatch, role="op")
    clock = Clock(T0)
    pool = PoolClient(f"sqlite:///{tmp_path / 'evil.db'}", clock=clock)
    monkeypatch.setattr(plugin_api, "_client", lambda: pool)
    seed(pool, clock, job2=EVIL)
    pool.add_host("evil", 1, {"owner": EVIL})
    result = {"chunk_index": 0, "start": 0, "end": 10, "workers_timeline": [[0, 4, T0 + 31]], "loss": 0.5,
              "metrics": {EVIL: 1.0}, "checkpoint_uri": "file:///" + EVIL, "epochs": [1], "hosts": [EVIL],
              "preemptions": 0, "samples_per_sec": 10.0, "param_sha256": EVIL}
    chunks = [ChunkInfo("train.chunk_01_of_01", "train", 1, 1, "success",
                        (TryInfo(1, "success", EVIL, T0 + 31, T0 + 40),), result)]
    monkeypatch.setattr(plugin_api, "_run_chunks", lambda dag_id, run_id: chunks)
    monkeypatch.setattr("elastic_ops.plugin.runs.job_id", lambda dag, group, run: EVIL)
    for path in ("/ui?range=all", f"/ui/job?dag_id={quote(EVIL)}&run_id={quote(EVIL)}"):
        page = client.get(path).text
        assert "<img" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page, path
        assert page.count("<script") == 1, path


def test_the_job_view_shows_workers_iterations_chunks_tries_and_checkpoints(seeded, monkeypatch):
    client, _, _ = seeded
    result = {"chunk_index": 0, "start": 0, "end": 300,
              "workers_timeline": [[0, 4, T0 + 31], [150, 5, T0 + 62]], "loss": 0.25,
              "metrics": {"accuracy": 0.875}, "checkpoint_uri": "file:///ck/300",
              "epochs": [2, 3], "hosts": ["gpu-0"], "preemptions": 0, "samples_per_sec": 640.0,
              "param_sha256": "ab" * 32}
    tries = (TryInfo(1, "failed", "w1", T0 + 30, T0 + 31), TryInfo(2, "success", "w1", T0 + 31, T0 + 70))
    chunks = [ChunkInfo("train.chunk_01_of_02", "train", 1, 2, "success", tries, result),
              ChunkInfo("train.chunk_02_of_02", "train", 2, 2, "running",
                        (TryInfo(1, "running", "w1", T0 + 70, None),), None)]
    monkeypatch.setattr(plugin_api, "_run_chunks", lambda dag_id, run_id: chunks)
    monkeypatch.setattr("elastic_ops.plugin.runs.job_id", lambda dag, group, run: "job2")
    page = client.get("/ui/job?dag_id=seed&run_id=manual__1").text
    assert re.search(r'class="series workers" data-job="job2" data-workers="8"', page)
    assert 'data-iteration="300"' in page
    assert "share 8 of 8" in page  # the plan's reason beside (and on) the change
    assert "<td>1 of 2</td><td>success</td><td>0..300</td><td>loss 0.25, accuracy 0.875</td>" in page
    assert "<td>iteration 0</td>" in page and "<td>failed</td>" in page and "file:///ck/300" in page
    assert 'data-path="/jobs/job2/priority"' in page
    tl = client.get("/timeline?job=job2&dag_id=seed&run_id=manual__1").json()
    assert tl["progress"]["job2"] == [[T0 + 31, 0], [T0 + 62, 150], [T0 + 70, 300]]


def test_a_change_with_the_session_cookie_must_be_json(seeded):
    client, pool, _ = seeded
    r = client.post("/jobs/job2/priority", content='{"priority": 7}', headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert next(j for j in pool.status()["jobs"] if j["name"] == "job2")["priority"] == 5
    r = client.post("/jobs/job2/priority", json={"priority": 7})
    assert r.status_code == 200
    assert next(j for j in pool.status()["jobs"] if j["name"] == "job2")["priority"] == 7


def test_throughput_and_eta_come_from_what_the_heartbeats_measured(seeded, monkeypatch):
    client, pool, _ = seeded
    epoch = next(j for j in pool.status()["jobs"] if j["name"] == "job2")["epoch"]
    pool.heartbeat("job2", epoch, workers=8, measured={"iterations": 200, "seconds": 10.0, "workers": 8})
    monkeypatch.setattr(plugin_api, "_recent_runs", lambda: {"job2": ("seed", "manual__1")})
    monkeypatch.setattr(plugin_api, "_totals", lambda refs: {"job2": 1200} if "job2" in refs else {})
    page = client.get("/ui").text
    assert "<td>20.0 it/s</td><td>~50 s (200 of 1200)</td>" in page  # 1000 left at 20 a second
    assert 'href="/dags/seed/runs/manual__1/plugin/elastic-job" target="_top"' in page


def test_the_chunk_link_opens_the_runs_job_view_tab_with_the_run_id_quoted():
    from elastic_ops.links.pool import job_view_url
    from elastic_ops.plugin import ElasticOpsPlugin

    url = job_view_url("http://af.example/base/", "team.train", "manual__2026-12-03T14:00:00+00:00")
    assert url == "http://af.example/base/dags/team.train/runs/manual__2026-12-03T14%3A00%3A00%2B00%3A00/plugin/elastic-job"
    tab = next(v for v in ElasticOpsPlugin.external_views if v["destination"] == "dag_run")
    assert tab["url_route"] == "elastic-job" and "{DAG_ID}" in tab["href"] and "{RUN_ID}" in tab["href"]


@pytest.mark.parametrize(("rendered", "total"), [
    ({"spec_fields": {"total_iterations": 900}}, 900), ({"spec_fields": {"total_iterations": "1200"}}, 1200),
    ({"spec_fields": '{"total_iterations": 30}'}, 30),
    ({"spec_fields": {"total_iterations": "{{ x }}"}}, None), ({}, None), (None, None),
])
def test_a_jobs_total_comes_from_its_chunk_tasks_rendered_spec(rendered, total):
    from elastic_ops.plugin.runs import _total

    assert _total(rendered) == total


def test_the_pool_view_lists_the_tenants_once_there_are_any(seeded):
    client, pool, _ = seeded
    assert "<h3>Tenants</h3>" not in client.get("/ui").text  # every job in the default tenant
    pool.add_tenant("vision", guaranteed=2)
    page = client.get("/ui").text
    assert "<h3>Tenants</h3>" in page and "<td>vision</td>" in page and "<td>default</td>" in page
