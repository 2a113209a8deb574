"""The control plane: heartbeats renew and read without planning; plans run when inputs change,
coalesce in bursts, one at a time, and survive the death of the client running one
(SQLite + PostgreSQL)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from elastic_ops.errors import LeaseExpiredError, SpecError
from elastic_ops.pool import Grant, PoolClient, TargetAction, Wait, ledger
from elastic_ops.pool.model import Observation
from elastic_ops.pool.policies import get_policy

from .builders import grant
from .timeline import held_now, replay


@pytest.fixture
def counted(monkeypatch):
    """Every policy call in this process, counted."""
    calls: list[int] = []
    real = get_policy

    def counting(name):
        policy = real(name)

        def run(snap):
            calls.append(len(snap.jobs))
            return policy(snap)

        return run

    monkeypatch.setattr(ledger, "get_policy", counting)
    return calls


@pytest.fixture
def pool(ledger_url, clock):
    client = PoolClient(ledger_url, clock=clock, lease_ttl_s=30, plan_refresh_s=3600)
    client.add_host("h0", 4)
    client.add_host("h1", 4)
    yield client
    client.close()


def test_a_heartbeat_renews_and_reads_without_running_the_policy(pool, clock, counted):
    a = grant(pool, "a", max_workers=4)
    b = grant(pool, "b", max_workers=8)
    assert a.workers == b.workers == 4
    pool.set_bounds("a", 1, 8)
    before = len(counted)
    for _ in range(20):
        clock.advance(1)
        ta = pool.heartbeat("a", a.epoch, workers=a.workers, placements=a.placements,
                            measured=Observation(iterations=10, seconds=1.5, workers=a.workers))
        pool.heartbeat("b", b.epoch, workers=b.workers, placements=b.placements)
    assert len(counted) == before, "a heartbeat ran the policy"
    assert ta.action == TargetAction.KEEP and ta.workers == a.workers
    # a change plans (once), and the next heartbeat reads what that plan decided
    pool.set_priority("b", 9)
    assert len(counted) == before + 1
    ta = pool.heartbeat("a", a.epoch, workers=a.workers, placements=a.placements)
    assert ta.action == TargetAction.SHRINK and ta.workers < 4
    assert len(counted) == before + 1
    pool.heartbeat("a", a.epoch, workers=ta.workers, placements=ta.placements)  # shrunk: a change
    assert len(counted) == before + 2
    tb = pool.heartbeat("b", b.epoch, workers=b.workers, placements=b.placements)
    assert tb.action == TargetAction.GROW and tb.workers == 8 - ta.workers
    assert len(counted) == before + 2
    # what the heartbeats measured is kept, summed per configuration
    obs = pool.observations("a")
    assert obs == [{"workers": a.workers, "hosts": 1, "batch": 0, "iterations": 200, "seconds": 30.0,
                    "reports": 20, "first_ts": obs[0]["first_ts"], "last_ts": obs[0]["last_ts"]}]


def test_a_shrink_reported_in_a_heartbeat_is_a_change_the_others_see_at_once(pool, counted):
    low = grant(pool, "low", min_workers=1, max_workers=8)
    assert low.workers == 8
    pool.submit("high", min_workers=4, max_workers=4, priority=9)
    assert isinstance(pool.request("high"), Wait)  # asks: granted once low gives up 4 slots
    t = pool.heartbeat("low", low.epoch, workers=8)
    assert t.action == TargetAction.SHRINK and t.workers == 4
    plans = len(counted)
    pool.heartbeat("low", low.epoch, workers=4, placements=t.placements)  # shrunk at its boundary
    assert len(counted) == plans + 1  # the freed slots were planned: high, still asking, got them
    g = pool.request("high")
    assert isinstance(g, Grant) and g.workers == 4
    assert not set(g.placements) & set(t.placements)
    replay(pool.events())


def test_an_expired_lease_returns_with_no_heartbeat_of_its_own(pool, clock):
    """Nobody calls for the dead job: the next heartbeat of another one finds the lease overdue
    and its plan returns the slots (and grows the live job onto them)."""
    dead = grant(pool, "dead", max_workers=4)
    live = grant(pool, "live", max_workers=8)
    assert dead.workers == 4 and live.workers == 4
    clock.advance(25)
    pool.heartbeat("live", live.epoch, workers=4)
    clock.advance(10)  # dead's lease (30 s) is past; live's is not
    t = pool.heartbeat("live", live.epoch, workers=4)
    kinds = [e["kind"] for e in pool.events("dead")]
    assert kinds[-1] == "expiry"
    assert t.action == TargetAction.KEEP
    status = pool.status()
    assert status["slots"]["used"] == 4 and status["planner"]["planned_seq"] == status["planner"]["dirty_seq"]
    with pytest.raises(LeaseExpiredError):
        pool.heartbeat("dead", dead.epoch, workers=4)


def test_time_alone_is_planned_within_the_refresh(ledger_url, clock):
    """Aging lifts a waiting job's priority with time: no input changes, but the plan must be
    made again; a heartbeat past ``plan_refresh_s`` runs it."""
    pool = PoolClient(ledger_url, clock=clock, plan_refresh_s=0.2, aging_s=10, lease_ttl_s=86400)
    pool.add_host("h0", 2)
    old = grant(pool, "old", min_workers=2, max_workers=2, priority=5)
    pool.submit("young", min_workers=2, max_workers=2, priority=1)
    assert isinstance(pool.request("young"), Wait)
    clock.advance(100)  # young has aged 10 priority units past old
    t = pool.heartbeat("old", old.epoch, workers=2)
    time.sleep(0.25)
    t = pool.heartbeat("old", old.epoch, workers=2)  # plans (the refresh is due)...
    t = pool.heartbeat("old", old.epoch, workers=2)  # ...and reads it
    assert t.action == TargetAction.PREEMPT, t
    pool.close()


def test_planner_settings_are_checked(pool):
    with pytest.raises(SpecError, match="plan_interval_s=-1"):
        pool.configure(plan_interval_s=-1)
    with pytest.raises(SpecError, match="measured.hosts=3"):
        g = grant(pool, "a")
        pool.heartbeat("a", g.epoch, workers=2,
                       measured=Observation(iterations=1, seconds=1.0, workers=2, hosts=3))
    with pytest.raises(SpecError, match="measured"):
        pool.heartbeat("a", g.epoch, workers=2, measured={"iterations": 1, "speed": 2})
    assert pool.configure(plan_interval_s=0.2)["plan_interval_s"] == 0.2


def _a_ledger_holding_one_lease(ledger_url, clock):
    """A ledger where job "a" holds 4 slots (its grant), closed; an engine to edit it with."""
    pool = PoolClient(ledger_url, clock=clock)
    pool.add_host("h0", 4)
    g = grant(pool, "a", max_workers=4)
    pool.close()
    return g, sa.create_engine(ledger_url)


def test_a_ledger_of_schema_3_upgrades_in_place(ledger_url, clock):
    g, engine = _a_ledger_holding_one_lease(ledger_url, clock)
    with engine.begin() as conn:  # back to what schema 3 had
        conn.execute(sa.text("DROP TABLE planner"))
        conn.execute(sa.text("DROP TABLE observations"))
        conn.execute(sa.text("DROP INDEX leases_live"))
        for col in ("plan_placements", "plan_release", "asked"):
            conn.execute(sa.text(f"ALTER TABLE jobs DROP COLUMN {col}"))
        for col in ("plan_interval_s", "plan_refresh_s"):
            conn.execute(sa.text(f"ALTER TABLE pool DROP COLUMN {col}"))
        for col in ("obs_workers", "obs_hosts", "obs_batch", "obs_iterations", "obs_seconds", "obs_reports",
                    "obs_first"):
            conn.execute(sa.text(f"ALTER TABLE leases DROP COLUMN {col}"))
        conn.execute(sa.text("ALTER TABLE pool DROP COLUMN rescale_cost_s"))
        conn.execute(sa.text("DELETE FROM schema_version WHERE version IN (4, 5, 6)"))
    engine.dispose()
    pool = PoolClient(ledger_url, clock=clock)
    assert pool.heartbeat("a", g.epoch, workers=4).action == TargetAction.KEEP
    pool.submit("b", min_workers=1, max_workers=4)
    assert isinstance(pool.request("b"), Wait)  # a plan: a shrinks for b
    assert pool.heartbeat("a", g.epoch, workers=4).action == TargetAction.SHRINK
    assert pool.status()["settings"]["plan_interval_s"] == 0.05
    assert pool.status()["settings"]["rescale_cost_s"] == 30.0  # schema 6
    pool.close()


def test_a_ledger_of_schema_4_upgrades_to_in_place_renewals(ledger_url, clock):
    g, engine = _a_ledger_holding_one_lease(ledger_url, clock)
    with engine.begin() as conn:  # back to what schema 4 had: the live leases indexed by expiry
        conn.execute(sa.text("DROP INDEX leases_live"))
        conn.execute(sa.text("CREATE INDEX leases_live_expires ON leases (expires) WHERE ended IS NULL"))
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("ALTER TABLE leases RESET (fillfactor)"))
        conn.execute(sa.text("ALTER TABLE pool DROP COLUMN rescale_cost_s"))
        conn.execute(sa.text("DELETE FROM schema_version WHERE version IN (5, 6)"))
    pool = PoolClient(ledger_url, clock=clock)
    clock.advance(5)
    assert pool.heartbeat("a", g.epoch, workers=4).action == TargetAction.KEEP
    with engine.connect() as conn:
        names = {i["name"] for i in sa.inspect(conn).get_indexes("leases")}
        assert "leases_live" in names and "leases_live_expires" not in names
        if conn.dialect.name == "postgresql":
            options = conn.execute(sa.text("SELECT reloptions FROM pg_class WHERE oid = 'leases'::regclass"))
            assert "fillfactor=50" in options.scalar_one()
    engine.dispose()
    pool.close()


def test_a_ledger_of_schema_6_upgrades_to_adaptive_batches_in_place(ledger_url, clock):
    g, engine = _a_ledger_holding_one_lease(ledger_url, clock)
    with engine.begin() as conn:  # back to what schema 6 had: no batching, no gradient statistics
        for table, col in (("jobs", "batching"), ("jobs", "plan_batch"), ("leases", "obs_grad_sqr"),
                           ("leases", "obs_grad_var")):
            conn.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN {col}"))
        conn.execute(sa.text("DELETE FROM schema_version WHERE version = 7"))
    pool = PoolClient(ledger_url, clock=clock)
    clock.advance(5)
    beat = Observation(iterations=5, seconds=1.0, workers=4, grad_sqr=1.0, grad_var=2.0)
    t = pool.heartbeat("a", g.epoch, workers=4, measured=beat)  # the lease held across the upgrade
    assert t.action == TargetAction.KEEP and t.batch == 0
    pool.submit("b", min_workers=1, max_workers=2, batching={"base": 8, "most": 64})
    assert next(j for j in pool.status()["jobs"] if j["name"] == "b")["batching"]["most"] == 64
    engine.dispose()
    pool.close()


@pytest.mark.postgres
def test_a_heartbeat_on_a_session_without_its_prepared_statement_still_renews(pg_url, clock):
    """Behind a transaction-mode pooler (PgBouncer) a transaction may run on a server session
    that lacks the heartbeat's prepared statement (or whose reset deallocated it): the heartbeat
    renews and reports all the same, and the client stops preparing."""
    pool = PoolClient(pg_url, clock=clock, lease_ttl_s=600)
    pool.add_host("h0", 2)
    g = grant(pool, "a", max_workers=2)
    beat = Observation(iterations=5, seconds=1.0, workers=2)
    pool.heartbeat("a", g.epoch, workers=2, measured=beat)
    held = pool._local.conn[1].connection.driver_connection
    cur = held.cursor()
    cur.execute("DEALLOCATE ALL")
    held.commit()
    clock.advance(10)
    assert pool.heartbeat("a", g.epoch, workers=2, measured=beat).action == TargetAction.KEEP
    clock.advance(10)
    assert pool.heartbeat("a", g.epoch, workers=2, measured=beat).action == TargetAction.KEEP
    with sa.create_engine(pg_url).connect() as conn:
        expires = conn.execute(sa.text("SELECT expires FROM leases WHERE job = 'a' AND ended IS NULL"))
        assert expires.scalar_one() == pytest.approx(clock() + 600)
    assert pool.observations("a")[0]["iterations"] == 15
    assert not pool._inline_head[1].prepare  # the measured heartbeat: plain statements from now on
    pool.close()


# --- many clients --------------------------------------------------------------------------


def _gated(gate: Path, inside: Path):
    """A policy that says it started (``inside``) and waits until ``gate`` exists."""
    real = get_policy

    def pick(name):
        policy = real(name)

        def run(snap):
            inside.touch()
            while not gate.exists():
                time.sleep(0.01)
            return policy(snap)

        return run

    return pick


def _plan_blocked(url: str, gate: str, inside: str, job: str) -> None:
    ledger.get_policy = _gated(Path(gate), Path(inside))
    PoolClient(url).set_priority(job, 7)  # its change commits, then it plans, inside the policy


def _changes(url: str, jobs: list[str], priority: int, threads: int = 1, wait: bool = True) -> None:
    """Set each job's priority, from ``threads`` threads at once (one client)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = PoolClient(url, wait_for_plan=wait)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda job: pool.set_priority(job, priority), jobs))
    pool.close()


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.postgres
def test_a_burst_of_changes_during_a_plan_makes_one_more_plan(pg_url, tmp_path):
    """100 changes arrive while a plan runs: they all commit (a demand change waits for no
    plan): 20 callers then wait for a plan that saw theirs, 80 changes come from a bulk client
    that does not wait. One plan after the running one covers them all; its targets are those
    of one plan over the final state."""
    pool = PoolClient(pg_url, lease_ttl_s=600, plan_refresh_s=3600)
    pool.add_host("h0", 16)
    jobs = [f"j{i}" for i in range(20)]
    for j in jobs:
        pool.submit(j, min_workers=1, max_workers=4)
        pool.request(j)
    gate, inside = tmp_path / "gate", tmp_path / "inside"
    ctx = mp.get_context("fork")
    blocked = ctx.Process(target=_plan_blocked, args=(pg_url, str(gate), str(inside), jobs[0]))
    blocked.start()
    _wait_for(inside.exists, "the plan to start")
    start = pool.planner_state()
    procs = [ctx.Process(target=_changes, args=(pg_url, jobs[k::4], 2 + k, 5)) for k in range(4)]
    procs.append(ctx.Process(target=_changes, args=(pg_url, jobs * 4, 3, 1, False)))
    try:
        for p in procs:
            p.start()
        _wait_for(lambda: pool.planner_state()["dirty_seq"] >= start["dirty_seq"] + 100, "100 changes")
        gate.touch()
        for p in [blocked, *procs]:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in [blocked, *procs]:
            if p.is_alive():
                p.kill()
    end = pool.planner_state()
    assert end["planned_seq"] == end["dirty_seq"]
    assert end["plans"] - start["plans"] <= 2, (start, end)  # the gated plan, and one for the burst
    _assert_targets_are_one_plan_over_the_final_state(pool)


def test_a_burst_of_changes_from_many_processes_ends_on_one_plans_targets(ledger_url):
    pool = PoolClient(ledger_url, lease_ttl_s=600, plan_refresh_s=3600, plan_interval_s=0.1)
    pool.add_host("h0", 12)
    jobs = [f"j{i}" for i in range(8)]
    for j in jobs:
        pool.submit(j, min_workers=1, max_workers=4)
        pool.request(j)
    start = pool.planner_state()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_changes, args=(ledger_url, jobs[k::4] * 12, 1 + k)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    end = pool.planner_state()
    assert end["dirty_seq"] - start["dirty_seq"] == 96
    assert end["planned_seq"] == end["dirty_seq"]
    assert end["plans"] - start["plans"] <= 96
    _assert_targets_are_one_plan_over_the_final_state(pool)


def _assert_targets_are_one_plan_over_the_final_state(pool: PoolClient) -> None:
    now = pool._read(lambda t: t.now)
    with pool.engine.begin() as conn:
        tx = ledger.Tx(conn, now)
        snap, _ = tx.snapshot()
        plan = get_policy(tx.settings["policy"])(snap)
        conn.rollback()
    rows = {j["name"]: j["target"] for j in pool.status()["jobs"] if j["state"] != "finished"}
    assert {name: rows[name] for name in plan.jobs} == plan.targets()


def _killed_mid_plan(url: str, gate: str, inside: str, job: str) -> None:
    ledger.get_policy = _gated(Path(gate), Path(inside))  # the gate never opens: it is killed there
    PoolClient(url).set_priority(job, 9)


def test_a_planner_killed_mid_plan_loses_nothing(ledger_url, tmp_path):
    """The client running a plan is SIGKILLed inside it: its transaction rolls back (and its
    lock goes with its connection), another client plans, and the change it made stands."""
    # no rate limit: the next call after the kill plans however soon it comes
    pool = PoolClient(ledger_url, lease_ttl_s=600, plan_refresh_s=3600, plan_interval_s=0)
    pool.add_host("h0", 8)
    a = grant(pool, "a", max_workers=8)
    pool.submit("b", min_workers=4, max_workers=4)
    assert isinstance(pool.request("b"), Wait)
    held = pool._read(lambda tx: tx.holdings())
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_killed_mid_plan, args=(ledger_url, str(tmp_path / "never"),
                                                   str(tmp_path / "inside"), "b"))
    p.start()
    try:
        _wait_for((tmp_path / "inside").exists, "the plan to start")
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=30)
    finally:
        if p.is_alive():
            p.kill()
    state = pool.planner_state()
    assert state["dirty_seq"] > state["planned_seq"]  # its change committed; its plan did not
    assert pool._read(lambda tx: tx.holdings()) == held  # nothing half-applied
    pool.status()  # the plan is due: this client runs it (so would a heartbeat, a second later)
    state = pool.planner_state()
    assert state["planned_seq"] == state["dirty_seq"], state
    jobs = {j["name"]: j for j in pool.status()["jobs"]}
    assert jobs["b"]["priority"] == 9
    t = pool.heartbeat("a", a.epoch, workers=a.workers)
    assert t.action == TargetAction.SHRINK and t.workers == 4  # b (priority 9) takes half
    pool.heartbeat("a", a.epoch, workers=4, placements=t.placements)
    assert pool.request("b").workers == 4
    events = pool.events()
    replay(events)
    assert len(held_now(events)) == 8


def test_asking_again_while_waiting_plans_nothing_new(pool, counted, clock):
    """A trigger polls its request every second or two: a job already asking adds nothing to
    plan; one whose ask lapsed (a lease TTL without asking) is planned again."""
    big = grant(pool, "big", min_workers=8, max_workers=8)
    pool.submit("small", min_workers=2, max_workers=2)
    assert isinstance(pool.request("small"), Wait)
    plans = len(counted)
    for _ in range(5):
        clock.advance(1)
        assert isinstance(pool.request("small"), Wait)
    assert len(counted) == plans
    clock.advance(20)
    pool.heartbeat("big", big.epoch, workers=8)
    clock.advance(11)  # past the lease TTL (30 s) since small's last ask
    assert isinstance(pool.request("small"), Wait)
    assert len(counted) == plans + 1


@pytest.mark.postgres
def test_a_heartbeat_whose_connection_the_server_dropped_is_tried_again(pg_url):
    """The heartbeat thread keeps its connection between beats: one the server ended meanwhile
    (a restart, an administrator) is replaced, and the heartbeat succeeds."""
    pool = PoolClient(pg_url, lease_ttl_s=600)
    pool.add_host("h0", 2)
    g = grant(pool, "a", max_workers=2)
    pool.heartbeat("a", g.epoch, workers=2)
    pid = pool._local.conn[1].connection.driver_connection.get_backend_pid()
    with sa.create_engine(pg_url).connect() as admin:
        assert admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
    time.sleep(0.2)
    t = pool.heartbeat("a", g.epoch, workers=2, measured=Observation(iterations=5, seconds=1.0, workers=2))
    assert t.action == TargetAction.KEEP
    assert pool._local.conn[1].connection.driver_connection.get_backend_pid() != pid
    assert pool.observations("a")[0]["iterations"] == 5
    pool.close()
