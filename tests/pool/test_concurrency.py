"""Many processes requesting, heartbeating and releasing against one ledger stay consistent,
with some SIGKILLed mid-lease and changes made from another process meanwhile."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import sqlalchemy as sa

from elastic_ops.errors import LeaseExpiredError, UnknownJobError
from elastic_ops.pool import Grant, PoolClient, TargetAction

from .timeline import held_now, replay

PROCS, OPS = 6, 30
TENANTS = ("a", "b", "default")


def _worker(url: str, proc: int, seed: int, out) -> None:
    """Two jobs per process, driven like chunk tasks: request, follow targets, release or hand
    over to the next chunk (whose first request re-takes the parked lease, if the plan left it)."""
    rng = random.Random(seed)
    pool = PoolClient(url)
    jobs = [f"p{proc}-j{k}" for k in range(2)]
    live: dict[str, tuple[int, int]] = {}  # job -> (epoch, workers)
    parked: set[str] = set()
    new_try: set[str] = set(jobs)
    for j in jobs:  # in tenants a and b (guaranteed 6 each of the 18 slots) and the default one
        pool.submit(
            j, min_workers=rng.randint(1, 3), max_workers=rng.randint(3, 8), priority=rng.randint(1, 5),
            tenant=TENANTS[proc % len(TENANTS)],
        )
    done = 0
    for _ in range(OPS):
        j = rng.choice(jobs)
        if j not in live:
            g = pool.request(j, new_attempt=j in new_try)  # a preempted try asks again as itself
            parked.discard(j)
            new_try.discard(j)
            if isinstance(g, Grant):
                live[j] = (g.epoch, g.workers)
            done += 1
            continue
        epoch, workers = live[j]
        if rng.random() < 0.2:
            how = rng.choice(["finished", "unfinished", "handover"])
            pool.release(j, epoch, finished=how == "finished", handover=how == "handover")
            new_try.add(j)  # the next chunk, a retry, or a cleared run
            if how == "handover":
                parked.add(j)
            del live[j]
        else:
            t = pool.heartbeat(j, epoch, workers=workers)
            live[j] = (epoch, 0 if t.action == TargetAction.PREEMPT else t.workers)  # acts at the boundary
            if t.action == TargetAction.PREEMPT:
                pool.heartbeat(j, epoch, workers=0)
                del live[j]
        done += 1
    for j, (epoch, _) in live.items():
        pool.release(j, epoch, finished=True)
    for j in set(jobs) - set(live):  # the run ended between two chunks, or while it waited
        pool.finish(j)  # (a job told to wait stays asking: a later plan may have granted it)
    pool.close()
    out.put(done)


def _assert_every_slot_came_back(setup: PoolClient) -> list[dict]:
    """The event log replays (no slot ever held by two jobs; only holders release), agrees with
    the tables, and says every slot came back and every lease ended. Returns the events."""
    events = setup.events()
    with setup.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT host, slot, job FROM allocations")).all()
        live = conn.execute(sa.text("SELECT job, epoch FROM leases WHERE ended IS NULL")).all()
    allocations = {(r.host, r.slot): r.job for r in rows}
    tables = f"allocations table: {allocations}; live leases: {[tuple(r) for r in live]}"
    replay(events)
    held = held_now(events)
    # Both sides, so a failure says which is wrong: an unrecorded change (they disagree) or a
    # slot never given back (they agree, both non-empty).
    assert held == allocations, f"event log says {held} is held, but the {tables}"
    assert held == {}, f"slots never given back; {tables}"
    assert not live, f"leases never ended; {tables}"
    return events


def _run(url: str) -> None:
    setup = PoolClient(url, lease_ttl_s=3600, policy="priority", preemption="graceful")
    for h in range(3):
        setup.add_host(f"h{h}", 6)
    setup.add_tenant("a", guaranteed=6)
    setup.add_tenant("b", guaranteed=6, max_slots=10, weight=2.0)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, i, 1000 + i, out)) for i in range(PROCS)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0, f"worker exited with {p.exitcode}"
    finally:  # no worker outlives a failed run
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert sum(out.get(timeout=5) for _ in procs) == PROCS * OPS

    events = _assert_every_slot_came_back(setup)
    # the run moved slots between jobs (not a pool that only ever said "wait"): how many grants
    # there are depends on how the processes interleave, but the second job to ask always finds
    # free slots (18 of them, a max of 8 each), so at least two jobs were granted some
    assert len({e["job"] for e in events if e["kind"] in ("grant", "reissue")}) >= 2
    assert any(e["kind"] == "park" for e in events) and any(e["kind"] == "reissue" for e in events)
    assert setup.status()["slots"]["used"] == 0


def test_many_processes_on_sqlite(sqlite_url):
    _run(sqlite_url)


@pytest.mark.postgres
def test_many_processes_on_postgres(pg_url):
    _run(pg_url)


def _holder(url: str, proc: int, seed: int, seconds: float, marker: str, out) -> None:
    """Two jobs driven like chunk tasks for ``seconds``, following their targets with
    placements (as the lease keeper does); writes ``marker`` once it holds a lease (the test
    may SIGKILL it from then on, mid-lease). A lease lost to expiry is asked for again."""
    rng = random.Random(seed)
    pool = PoolClient(url)
    jobs = [f"k{proc}-j{k}" for k in range(2)]
    live: dict[str, tuple[int, tuple]] = {}  # job -> (epoch, placements it runs on)
    for j in jobs:
        pool.submit(j, min_workers=1, max_workers=rng.randint(2, 6), priority=rng.randint(1, 5))
    end, done = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for j in jobs:
            if j not in live:
                g = pool.request(j, new_attempt=True)
                if isinstance(g, Grant):
                    live[j] = (g.epoch, g.placements)
                    open(marker, "a").close()
                continue
            epoch, on = live[j]
            try:
                if rng.random() < 0.05:
                    pool.release(j, epoch, handover=rng.random() < 0.5)
                    del live[j]
                    continue
                t = pool.heartbeat(j, epoch, workers=len(on), placements=on)
                if t.action == TargetAction.PREEMPT:
                    pool.heartbeat(j, epoch, workers=0)
                    del live[j]
                elif set(t.placements) != set(on):  # a boundary: run on the target's slots
                    live[j] = (epoch, t.placements)
                    pool.heartbeat(j, epoch, workers=len(t.placements), placements=t.placements)
            except LeaseExpiredError:
                del live[j]
            done += 1
        time.sleep(0.01)
    for j, (epoch, _) in live.items():
        pool.release(j, epoch, finished=True)
    for j in jobs:
        pool.finish(j)
    pool.close()
    out.put(done)


def _operator(url: str, seed: int, seconds: float) -> None:
    """Priorities and bounds changed, hosts drained and brought back, from another process."""
    rng = random.Random(seed)
    pool = PoolClient(url)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        what = rng.random()
        try:
            if what < 0.5:
                job = f"k{rng.randint(0, HOLDERS - 1)}-j{rng.randint(0, 1)}"
                pool.set_priority(job, rng.randint(1, 9))
            else:
                host = f"h{rng.randint(0, 2)}"
                pool.set_host_state(host, "draining" if what < 0.75 else "up")
        except UnknownJobError:
            pass
        time.sleep(0.05)
    for h in range(3):
        pool.set_host_state(f"h{h}", "up")
    pool.close()


HOLDERS, KILLED = 5, 2


def _run_with_kills(url: str, tmp_path) -> None:
    ttl = 3.0
    setup = PoolClient(url, lease_ttl_s=ttl, policy="priority", preemption="graceful", plan_interval_s=0.02)
    for h in range(3):
        setup.add_host(f"h{h}", 6)
    setup.add_tenant("a", guaranteed=6)
    setup.add_tenant("b", guaranteed=6, max_slots=10, weight=2.0)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    seconds = 6.0
    markers = [str(tmp_path / f"holding-{i}") for i in range(HOLDERS)]
    holders = [ctx.Process(target=_holder, args=(url, i, 2000 + i, seconds, markers[i], out))
               for i in range(HOLDERS)]
    operator = ctx.Process(target=_operator, args=(url, 7, seconds))
    procs = [*holders, operator]
    try:
        for p in procs:
            p.start()
        for i in range(KILLED):  # SIGKILLed while holding a lease
            deadline = time.monotonic() + 60
            while not os.path.exists(markers[i]):
                assert time.monotonic() < deadline, "a holder never got a grant"
                time.sleep(0.01)
            time.sleep(0.5 + i)
            os.kill(holders[i].pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in holders[KILLED:]] == [0] * (HOLDERS - KILLED)
        assert operator.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert all(out.get(timeout=5) > 0 for _ in range(HOLDERS - KILLED))
    time.sleep(ttl + 0.5)  # the killed holders' leases run out; nobody calls for their jobs...
    setup.status()  # ...and the next call that finds a lease overdue plans (expiry returns them)
    events = _assert_every_slot_came_back(setup)
    killed = {f"k{i}-j{k}" for i in range(KILLED) for k in range(2)}
    expired = {e["job"] for e in events if e["kind"] == "expiry"}
    granted = {e["job"] for e in events if e["kind"] in ("grant", "reissue")}
    assert killed & granted <= expired | {e["job"] for e in events if e["kind"] == "release"}
    assert killed & expired, "no killed holder's lease expired: they were not killed mid-lease"
    assert any(e["kind"] == "host" and "draining" in e["reason"] for e in events)
    assert any(e["kind"] == "config" and "priority" in e["reason"] for e in events)


def test_holders_killed_mid_lease_with_changes_from_another_process_on_sqlite(sqlite_url, tmp_path):
    _run_with_kills(sqlite_url, tmp_path)


@pytest.mark.postgres
def test_holders_killed_mid_lease_with_changes_from_another_process_on_postgres(pg_url, tmp_path):
    _run_with_kills(pg_url, tmp_path)


def _hold_the_pool_lock(url: str, *, engine=None):
    """A client stopped inside a transaction that holds the pool's lock (a SIGSTOPped or frozen
    process): the connection, idle in its transaction."""
    engine = engine or sa.create_engine(url)
    conn = engine.connect()
    conn.begin()
    conn.execute(sa.text("SELECT id FROM pool WHERE id = 1 FOR UPDATE"))
    return conn


@pytest.mark.postgres
def test_a_client_stopped_inside_a_transaction_does_not_stall_the_pool(pg_url, monkeypatch):
    """It blocked every other client for good: heartbeats too, so every lease expired (a probe)."""
    from elastic_ops.pool import engine as engine_module

    monkeypatch.setattr(engine_module, "PG_IDLE_IN_TX_S", 1)
    stopped = PoolClient(pg_url)
    held = _hold_the_pool_lock(pg_url, engine=stopped.engine)
    other = PoolClient(pg_url)
    other.add_host("h0", 2)  # the server ended the stopped client's transaction after 1 s
    assert other.status()["slots"]["up"] == 2
    with pytest.raises(sa.exc.OperationalError, match="server closed the connection"):
        held.execute(sa.text("SELECT 1"))
    held.close()
    stopped.add_host("h1", 1)  # the stopped client's next call works on a new connection
    assert other.status()["slots"]["up"] == 3


@pytest.mark.postgres
def test_waiting_too_long_for_the_pool_lock_is_ledger_busy(pg_url, monkeypatch):
    from elastic_ops.errors import LedgerBusyError
    from elastic_ops.pool import engine as engine_module

    pool = PoolClient(pg_url)
    held = _hold_the_pool_lock(pg_url)  # a client without the server's idle limit
    monkeypatch.setattr(engine_module, "PG_LOCK_TIMEOUT_S", 1)
    waiting = PoolClient(pg_url)
    with pytest.raises(LedgerBusyError, match=r"lock \(or a table's\) was not granted within 1s") as err:
        waiting.add_host("h0", 2)
    assert err.value.retryable
    held.close()
    waiting.add_host("h0", 2)
    assert pool.status()["slots"]["up"] == 2


@pytest.mark.postgres
def test_the_ledger_reads_committed_data_whatever_the_servers_default(pg_url):
    """Under REPEATABLE READ a transaction's snapshot predates its wait for the pool's lock: it
    planned from stale rows and a raw IntegrityError reached the caller (a probe)."""
    url = pg_url.replace("options=", "options=-cdefault_transaction_isolation%3Drepeatable%5C%20read%20")
    pool = PoolClient(url)
    with pool.engine.begin() as conn:
        assert conn.execute(sa.text("SHOW transaction_isolation")).scalar() == "read committed"
    with sa.create_engine(url).connect() as conn:  # the URL does set the server's default
        assert conn.execute(sa.text("SHOW transaction_isolation")).scalar() == "repeatable read"


@pytest.mark.postgres
def test_a_urls_own_session_settings_win(pg_url):
    url = pg_url.replace("options=", "options=-clock_timeout%3D5000%20")
    with PoolClient(url).engine.begin() as conn:
        assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "5s"
        assert conn.execute(sa.text("SHOW idle_in_transaction_session_timeout")).scalar() == "15s"
        assert conn.execute(sa.text("SHOW search_path")).scalar().startswith("pool_")  # the URL's own


@pytest.mark.postgres
def test_session_settings_hold_in_every_transaction_behind_a_pooler(pg_url):
    """A transaction-mode pooler (PgBouncer) runs each transaction on whichever server session is
    free, where settings made when this client connected may be missing: here the session is
    reset under the client's pooled connection. They were session SETs made at connect time."""
    pool = PoolClient(pg_url)
    with pool.engine.connect() as conn:
        conn.exec_driver_sql("RESET ALL")
        conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.commit()
    with pool.engine.begin() as conn:
        assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "30s"
        assert conn.execute(sa.text("SHOW idle_in_transaction_session_timeout")).scalar() == "15s"
        assert conn.execute(sa.text("SHOW transaction_isolation")).scalar() == "read committed"
        assert conn.execute(sa.text("SHOW search_path")).scalar().startswith("pool_")
    pool.add_host("h0", 2)
    assert pool.status()["slots"]["up"] == 2


def test_a_long_held_sqlite_lock_is_ledger_busy_after_the_busy_timeout(sqlite_url, monkeypatch):
    """A client stopped inside an SQLite write transaction: the others got LedgerBusyError only
    after 21 tries that each waited the whole 30 s busy timeout (~10.5 minutes: every lease long
    expired, the heartbeats blocked meanwhile), not after the busy timeout (a probe)."""
    import sqlite3
    import threading
    import time

    from elastic_ops.errors import LedgerBusyError
    from elastic_ops.pool import engine as engine_module

    path = sqlite_url.removeprefix("sqlite:///")
    PoolClient(sqlite_url).add_host("h0", 2)
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_S", 0.5, raising=False)
    waiting = PoolClient(sqlite_url)
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    hold_s = 10.0  # the lock comes back after this: a call still blocked then was not refused
    threading.Timer(hold_s, lambda: holder.execute("COMMIT")).start()
    started = time.monotonic()
    try:
        with pytest.raises(LedgerBusyError, match="stayed busy") as err:
            waiting.add_host("h1", 1)
        assert err.value.retryable
        assert time.monotonic() - started < hold_s / 2
    finally:
        time.sleep(max(0.0, hold_s - (time.monotonic() - started)) + 0.2)
        holder.close()
    waiting.add_host("h1", 1)  # the lock is free again
    assert waiting.status()["slots"]["up"] == 3
