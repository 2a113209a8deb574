"""The pool's metrics: gauges from every decision and a counter per event, sent only once the
transaction that made them commits."""

from __future__ import annotations

import pytest

from elastic_ops.errors import SpecError, UnknownJobError
from elastic_ops.pool import PoolClient, ledger
from tests.recording_metrics import RecordingMetrics

GAUGES = ("pool.slots_up", "pool.slots_used", "pool.jobs_running", "pool.jobs_waiting")


def make_pool(tmp_path, metrics) -> PoolClient:
    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}", metrics=metrics, aging_s=0.0)
    pool.add_host("h1", 4)
    pool.add_host("h2", 4)
    return pool


def status_numbers(pool: PoolClient) -> dict[str, int]:
    st = pool.status()
    running = sum(1 for j in st["jobs"] if j["workers"] and j["state"] != "finished")
    return {"pool.slots_up": st["slots"]["up"], "pool.slots_used": st["slots"]["used"],
            "pool.jobs_running": running,
            "pool.jobs_waiting": sum(1 for j in st["jobs"] if not j["workers"] and j["state"] != "finished")}


def test_every_decision_reports_the_pool_as_status_shows_it(tmp_path):
    rec = RecordingMetrics()
    pool = make_pool(tmp_path, rec)
    steps = [
        lambda: pool.submit("a", min_workers=2, max_workers=8),
        lambda: pool.request("a"),
        lambda: pool.submit("b", min_workers=2, max_workers=4, priority=3),
        lambda: pool.request("b"),
        lambda: pool.set_host_state("h2", "down"),
        lambda: pool.release("a", pool.status()["jobs"][0]["epoch"], finished=True),
    ]
    for step in steps:
        step()
        expected = status_numbers(pool)
        pool.configure()  # a decision that changes nothing: its gauges are the current pool
        assert {g: rec.last(g) for g in GAUGES} == expected


def test_each_event_is_counted_once_under_its_kind(tmp_path):
    rec = RecordingMetrics()
    pool = make_pool(tmp_path, rec)
    pool.submit("a", min_workers=1, max_workers=4)
    pool.request("a")
    pool.report_failure("a", "h1")
    kinds = [e["kind"] for e in pool.events()]
    counted = [n.removeprefix("pool.event.") for k, n, _, _ in rec.sent if k == "incr"]
    assert sorted(counted) == sorted(kinds) and {"host", "submit", "grant", "failure"} <= set(kinds)


@pytest.mark.parametrize("change", [
    lambda pool: pool.set_bounds("nope", 1, 2),
    lambda pool: pool.set_bounds("a", 3, 2),
    lambda pool: pool.add_host("h1", 1),  # would drop slot 1..3 under job a
])
def test_a_refused_change_sends_nothing(tmp_path, change):
    rec = RecordingMetrics()
    pool = make_pool(tmp_path, rec)
    pool.submit("a", min_workers=4, max_workers=4)
    pool.request("a")
    before = list(rec.sent)
    with pytest.raises((SpecError, UnknownJobError)):
        change(pool)
    assert rec.sent == before


def test_without_metrics_nothing_is_computed(tmp_path, monkeypatch):
    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}")
    monkeypatch.setattr(ledger.Tx, "_gauges", lambda *a: pytest.fail("gauges computed for nobody"))
    pool.add_host("h1", 2)
    pool.submit("a", min_workers=1, max_workers=2)
    assert pool.request("a").workers == 2
