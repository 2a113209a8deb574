"""Tenants through the ledger: borrowing, reclaim by graceful shrinks at iteration boundaries,
usage per tenant, refusals where a job enters, and a schema-7 ledger upgraded in place."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from elastic_ops.errors import SpecError
from elastic_ops.pool import Grant, PoolClient, TargetAction, Wait

from .timeline import replay


def test_two_tenants_one_idle_the_other_borrows_all_then_gets_its_guarantee_back(ledger_url, clock):
    pool = PoolClient(ledger_url, clock=clock, lease_ttl_s=600)
    pool.add_host("h0", 4)
    pool.add_host("h1", 4)
    pool.add_tenant("vision", guaranteed=4)
    pool.add_tenant("nlp", guaranteed=4, weight=2.0)
    pool.submit("n1", min_workers=1, max_workers=8, priority=5, tenant="nlp")
    n1 = pool.request("n1")
    assert isinstance(n1, Grant) and n1.workers == 8  # vision is idle: nlp borrows its 4
    (nlp,) = [t for t in pool.status()["tenants"] if t["name"] == "nlp"]
    assert (nlp["in_use"], nlp["borrowed"]) == (8, 4)
    clock.advance(600 - 1)
    pool.heartbeat("n1", n1.epoch, workers=8)
    clock.advance(60)
    pool.submit("v1", min_workers=2, max_workers=8, tenant="vision", dag_id="vision_dag")
    wait = pool.request("v1")
    assert isinstance(wait, Wait) and "waiting for 4 slots to be released" in wait.reason
    t = pool.heartbeat("n1", n1.epoch, workers=8)  # its next boundary: shrink to its guarantee
    assert (t.action, t.workers) == (TargetAction.SHRINK, 4)
    assert t.reason == "share 4 of 4; reclaimed for tenant vision (guaranteed 4, using 0)"
    pool.heartbeat("n1", n1.epoch, workers=4, placements=t.placements)  # it shrank: the slots go
    v1 = pool.request("v1")
    assert isinstance(v1, Grant) and v1.workers == 4
    assert not set(v1.placements) & set(t.placements)
    replay(pool.events())  # no slot ever held by two jobs
    by = {r["name"]: r for r in pool.status()["tenants"]}
    assert (by["vision"]["in_use"], by["nlp"]["in_use"], by["nlp"]["borrowed"]) == (4, 4, 0)
    clock.advance(3600)
    usage = {r["tenant"]: r for r in pool.usage()["tenants"]}
    assert usage["nlp"]["borrowed"] == pytest.approx(4 * 659 / 3600, abs=1e-3)
    assert usage["vision"]["lent"] == pytest.approx(4 * 659 / 3600, abs=1e-3)
    assert usage["vision"]["used"] == pytest.approx(4.0, abs=1e-3)
    assert pool.job_dag("v1") == "vision_dag" and pool.job_dag("n1") is None


def test_a_job_naming_an_unknown_tenant_or_more_than_its_max_is_refused_where_it_enters(ledger_url, clock):
    pool = PoolClient(ledger_url, clock=clock)
    pool.add_tenant("vision", guaranteed=2, max_slots=4)
    with pytest.raises(SpecError, match="tenant='nope': a tenant of the pool"):
        pool.submit("a", min_workers=1, max_workers=2, tenant="nope")
    with pytest.raises(SpecError, match="max_workers=8: must be <= 4, the max of tenant 'vision'"):
        pool.submit("a", min_workers=1, max_workers=8, tenant="vision")
    pool.submit("a", min_workers=1, max_workers=4, tenant="vision")
    with pytest.raises(SpecError, match="max of tenant 'vision'"):
        pool.set_bounds("a", 1, 6)
    with pytest.raises(SpecError, match="max_slots"):
        pool.add_tenant("vision", guaranteed=6, max_slots=4)
    with pytest.raises(SpecError, match="no unfinished job belongs to"):
        pool.remove_tenant("vision")
    pool.finish("a")
    pool.remove_tenant("vision")
    assert pool.status()["tenants"] == []  # and its finished job is listed as it was
    assert pool.status()["jobs"][0]["tenant"] == "vision"


def test_a_ledger_of_schema_7_upgrades_to_tenants_in_place(sqlite_url, clock):
    pool = PoolClient(sqlite_url, clock=clock)
    pool.add_host("h0", 2)
    pool.submit("a", min_workers=1, max_workers=2)
    g = pool.request("a")
    pool.close()
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:  # back to what schema 7 had
        conn.execute(sa.text("DROP TABLE tenants"))
        for col in ("tenant", "dag_id"):
            conn.execute(sa.text(f"ALTER TABLE jobs DROP COLUMN {col}"))
        conn.execute(sa.text("DELETE FROM schema_version WHERE version = 8"))
    pool = PoolClient(sqlite_url, clock=clock)
    assert pool.heartbeat("a", g.epoch, workers=2).action == TargetAction.KEEP
    (job,) = pool.status()["jobs"]
    assert (job["tenant"], job["dag_id"]) == ("default", None)
    pool.add_tenant("vision", guaranteed=1)
    pool.submit("b", min_workers=1, max_workers=2, tenant="vision")
    assert "tenant vision" in pool.status()["jobs"][1]["reason"]
    engine.dispose()


def test_the_timeline_groups_jobs_by_tenant(sqlite_url, clock):
    from elastic_ops.timeline import compute

    pool = PoolClient(sqlite_url, clock=clock)
    pool.add_host("h0", 4)
    pool.add_tenant("vision", guaranteed=2)
    pool.submit("v1", min_workers=1, max_workers=2, tenant="vision")
    pool.submit("v2", min_workers=1, max_workers=1, tenant="vision")
    pool.submit("d1", min_workers=1, max_workers=1)
    for j in ("v1", "v2", "d1"):
        assert isinstance(pool.request(j), Grant)
        clock.advance(1)
    tenant_of = {j["name"]: j["tenant"] for j in pool.status()["jobs"]}
    tl = compute(pool.events(), tenant_of=tenant_of)
    by = tl.held_by_tenant()
    assert by["vision"][-1][1] == 3 and by["default"][-1][1] == 1
    assert tl.to_dict()["tenants"] == {"v1": "vision", "v2": "vision", "d1": "default"}
