"""Host selectors: a job runs only on hosts that carry all of its labels (``{"gpu": "h100"}``),
whatever else is free; hosts that failed it are avoided only among those; ledgers from before
selectors are migrated."""

from __future__ import annotations

import json
import random

import pytest
import sqlalchemy as sa

from elastic_ops.errors import JobEndedError, SpecError
from elastic_ops.pool import PoolClient, report
from elastic_ops.pool.model import Host, outside
from elastic_ops.pool.schema import LATEST

from .cli_helper import run


def make_pool(url: str, clock=None) -> PoolClient:
    """a100-0 (4 slots, gpu=a100), h100-0 (4, gpu=h100, zone=a), h100-1 (2, gpu=h100, zone=b)."""
    pool = PoolClient(url, clock=clock, aging_s=0.0)
    pool.add_host("a100-0", 4, {"gpu": "a100"})
    pool.add_host("h100-0", 4, {"gpu": "h100", "zone": "a"})
    pool.add_host("h100-1", 2, {"gpu": "h100", "zone": "b"})
    return pool


def hosts_of(grant) -> set[str]:
    return {h for h, _ in grant.placements}


def run_for(pool: PoolClient, clock, grant, beats: int, every: float) -> None:
    """``grant``'s job runs on its placements for ``beats`` heartbeats ``every`` seconds apart."""
    for _ in range(beats):
        clock.advance(every)
        pool.heartbeat(grant.job, grant.epoch, workers=len(grant.placements), placements=grant.placements)


def test_a_job_runs_only_on_hosts_with_its_labels(ledger_url):
    pool = make_pool(ledger_url)
    pool.submit("h100-job", min_workers=1, max_workers=10, selector={"gpu": "h100"})
    grant = pool.request("h100-job")
    assert hosts_of(grant) == {"h100-0", "h100-1"} and grant.workers == 6  # not a100's 4 free slots
    pool.submit("zone-b", min_workers=1, max_workers=4, selector={"gpu": "h100", "zone": "b"})
    pool.submit("anywhere", min_workers=1, max_workers=8)
    assert hosts_of(pool.request("anywhere")) == {"a100-0"}
    job = {j["name"]: j for j in pool.status()["jobs"]}["h100-job"]
    assert job["selector"] == {"gpu": "h100"}
    submit = next(e for e in pool.events("zone-b") if e["kind"] == "submit")
    assert submit["reason"].endswith("on hosts with gpu=h100,zone=b")


def test_a_job_whose_labels_no_host_has_waits_and_says_why(ledger_url):
    pool = make_pool(ledger_url)
    pool.submit("b200-job", min_workers=1, max_workers=2, selector={"gpu": "b200"})
    outcome = pool.request("b200-job")
    assert not hasattr(outcome, "epoch")
    assert "0 usable slots" in outcome.reason
    assert pool.status()["slots"]["used"] == 0


def test_a_waiting_jobs_selector_relaxed_at_runtime_gets_it_slots(sqlite_url, monkeypatch, capsys):
    pool = make_pool(sqlite_url)
    pool.submit("b200-job", min_workers=2, max_workers=2, selector={"gpu": "b200"})
    assert not hasattr(pool.request("b200-job"), "epoch")
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "set-selector", "b200-job", "--label", "gpu=h100"]) == 0
    assert hosts_of(pool.request("b200-job")) <= {"h100-0", "h100-1"}
    assert {j["name"]: j["selector"] for j in pool.status()["jobs"]} == {"b200-job": {"gpu": "h100"}}
    assert run(["pool", "set-selector", "b200-job"]) == 0  # no label: any host
    assert {j["name"]: j["selector"] for j in pool.status()["jobs"]} == {"b200-job": {}}
    assert any(e["reason"] == "selector -> any host" for e in pool.events("b200-job"))
    with pytest.raises(SpecError, match="selector"):
        pool.set_selector("b200-job", {"gpu": 1})


def test_hosts_that_failed_a_job_are_avoided_among_its_hosts_only(sqlite_url):
    pool = make_pool(sqlite_url)
    pool.set_host_state("h100-1", "down")  # one h100 host left
    pool.submit("j", min_workers=2, max_workers=4, selector={"gpu": "h100"})
    grant = pool.request("j")
    assert hosts_of(grant) == {"h100-0"}
    pool.report_failure("j", "h100-0")
    pool.release("j", grant.epoch)
    # its only h100 host failed it: retried there (avoiding it would mean waiting forever),
    # never on the free a100 host
    assert hosts_of(pool.request("j", avoid_hosts=("h100-0",), new_attempt=True)) == {"h100-0"}
    pool.set_host_state("h100-1", "up")
    pool.release("j", pool.status()["jobs"][0]["epoch"])
    assert hosts_of(pool.request("j", avoid_hosts=("h100-0",), new_attempt=True)) == {"h100-1"}


@pytest.mark.parametrize("seed", range(12))
def test_no_job_ever_holds_a_slot_on_a_host_without_its_labels(sqlite_url, clock, seed):
    rng = random.Random(seed)
    pool = PoolClient(sqlite_url, clock=clock, aging_s=0.0)
    kinds = [{"gpu": "a100"}, {"gpu": "h100"}, {"gpu": "h100", "zone": "b"}, {}]
    for i in range(rng.randint(2, 5)):
        pool.add_host(f"n{i}", rng.randint(1, 4), rng.choice(kinds))
    selectors = {f"j{k}": rng.choice([{}, {"gpu": "h100"}, {"gpu": "a100"}, {"zone": "b"}]) for k in range(5)}
    labels = {h["name"]: h["labels"] for h in pool.status()["hosts"]}
    for _ in range(40):
        job = rng.choice(sorted(selectors))
        op = rng.random()
        if op < 0.35:
            lo = rng.randint(1, 3)
            pool.submit(job, min_workers=lo, max_workers=lo + rng.randint(0, 4), selector=selectors[job],
                        priority=rng.randint(1, 5))
        elif op < 0.7:
            try:
                pool.request(job, avoid_hosts=tuple(rng.sample(sorted(labels), rng.randint(0, 1))))
            except JobEndedError:  # released as finished: it asks for workers again only when submitted
                pass
            except Exception as exc:  # noqa: BLE001 - a job not submitted yet
                assert "unknown job" in str(exc)
        elif op < 0.85:
            live = {j["name"]: j for j in pool.status()["jobs"] if j["workers"]}
            if job in live:
                pool.heartbeat(job, live[job]["epoch"], workers=live[job]["workers"])
        else:
            live = {j["name"]: j for j in pool.status()["jobs"] if j["workers"]}
            if job in live:
                pool.release(job, live[job]["epoch"], finished=rng.random() < 0.5)
        clock.advance(rng.uniform(0, 5))
        for j in pool.status()["jobs"]:
            want = set(selectors[j["name"]].items())
            for host, _ in j["placements"]:
                assert want <= set(labels[host].items()), (j["name"], host, labels[host])


def test_selectors_are_checked_where_they_enter(sqlite_url):
    pool = make_pool(sqlite_url)
    for bad, says in (({"gpu": 1}, "string value"), ({"": "x"}, "label name ''"), ("gpu=h100", "mapping"),
                      ({f"k{i}": "v" for i in range(17)}, "at most 16"),
                      ({"k": "\x1b[2J\nFAKE ROW"}, "printable string value")):  # shown in tables and logs
        with pytest.raises(SpecError, match=says):
            pool.submit("j", min_workers=1, max_workers=1, selector=bad)
    with pytest.raises(SpecError, match="printable string value"):
        pool.add_host("h9", 1, {"k": "\x1b]0;pwned\x07"})
    assert outside({"gpu": "h100"}, [Host("a", 1, labels=(("gpu", "a100"),)), Host("b", 1)]) == {"a", "b"}
    assert outside({}, [Host("a", 1)]) == frozenset()


def test_a_ledger_from_before_selectors_is_migrated(ledger_url):
    pool = make_pool(ledger_url)
    pool.submit("old", min_workers=1, max_workers=2)
    pool.close()
    engine = sa.create_engine(ledger_url)
    with engine.begin() as conn:  # back to schema 1, as a ledger written by an earlier release
        conn.execute(sa.text("ALTER TABLE jobs DROP COLUMN selector"))
        conn.execute(sa.text("DELETE FROM schema_version WHERE version >= 2"))
    again = PoolClient(ledger_url)
    assert {j["name"]: j["selector"] for j in again.status()["jobs"]} == {"old": {}}
    assert hosts_of(again.request("old")) == {"h100-1"}  # any host: best fit, the one of 2 slots
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT max(version) FROM schema_version")).scalar() == LATEST
        assert json.loads(conn.execute(sa.text("SELECT selector FROM jobs")).scalar()) == {}
    again.close()
    engine.dispose()


def test_a_running_jobs_narrowed_selector_moves_it_at_its_next_heartbeat(ledger_url):
    """Narrowing a running job's selector is a hard constraint at once: its next heartbeat's
    target keeps the count on hosts with the new labels and gives up the others (as a drain
    does), and the slots it leaves are free once it reports running on the new ones."""
    pool = make_pool(ledger_url)
    pool.set_host_state("h100-1", "down")
    pool.submit("j", min_workers=2, max_workers=2)
    grant = pool.request("j")
    assert hosts_of(grant) == {"a100-0"} and grant.workers == 2
    pool.set_selector("j", {"gpu": "h100"})
    target = pool.heartbeat("j", grant.epoch, workers=2)
    assert target.workers == 2 and {h for h, _ in target.placements} == {"h100-0"}
    assert "moving off hosts outside its host selector" in target.reason
    held = {h for h, _ in next(j for j in pool.status()["jobs"] if j["name"] == "j")["placements"]}
    assert "a100-0" in held  # the running workers still use them: nobody else gets them yet
    pool.heartbeat("j", grant.epoch, workers=2, placements=target.placements)  # relaunched there
    (job,) = pool.status()["jobs"]
    assert {h for h, _ in job["placements"]} == {"h100-0"}
    pool.submit("other", min_workers=4, max_workers=4)
    assert hosts_of(pool.request("other")) == {"a100-0"}  # the slots it left are free again


def test_a_job_holding_the_only_hosts_a_higher_priority_job_may_use_moves_off_them(ledger_url):
    """'high' may run only on gpu=h100 hosts, which 'low' filled before it came, with another host
    idle: 'high' waited for good while 'low' kept its slots (a probe). Now 'low' is moved to the
    idle host at its next boundary, and 'high' gets the slots it left."""
    pool = PoolClient(ledger_url, aging_s=0.0)
    pool.add_host("h0", 4, {"gpu": "h100"})
    pool.add_host("h1", 4)
    pool.submit("low", min_workers=1, max_workers=4, priority=1)
    low = pool.request("low")
    assert hosts_of(low) == {"h0"} and low.workers == 4
    pool.submit("high", min_workers=4, max_workers=4, priority=5, selector={"gpu": "h100"})
    waiting = pool.request("high")
    assert not hasattr(waiting, "epoch") and "released on its hosts" in waiting.reason
    target = pool.heartbeat("low", low.epoch, workers=4)
    assert target.workers == 4 and {h for h, _ in target.placements} == {"h1"}
    assert "moving 4 slots off hosts that job high needs" in target.reason
    pool.heartbeat("low", low.epoch, workers=4, placements=target.placements)  # relaunched on h1
    high = pool.request("high")
    assert hosts_of(high) == {"h0"} and high.workers == 4
    assert pool.status()["slots"]["used"] == 8


def test_a_move_for_a_restricted_job_is_not_undone_by_min_rescale_interval(sqlite_url, clock):
    """The move's new slots were stamped as a rescale when booked: the mover, holding old and new,
    counted as rescaled 0 s ago, was frozen on its old host and moved back, again and again, and
    the restricted job never ran (a review). Now the move is stamped when its old slots go."""
    pool = PoolClient(sqlite_url, clock=clock, aging_s=0.0, min_rescale_interval_s=60.0, lease_ttl_s=60)
    pool.add_host("h0", 4, {"gpu": "h100"})
    pool.add_host("h1", 4)
    pool.submit("low", min_workers=1, max_workers=4, priority=1)
    low = pool.request("low")
    running = low.placements
    for _ in range(5):  # running for 100 s: past min_rescale_interval_s
        clock.advance(20)
        pool.heartbeat("low", low.epoch, workers=4, placements=running)
    pool.submit("high", min_workers=4, max_workers=4, priority=5, selector={"gpu": "h100"})
    for _ in range(10):  # low acts on each target at its next boundary, 20 s later
        clock.advance(20)
        running = pool.heartbeat("low", low.epoch, workers=len(running), placements=running).placements
        high = pool.request("high")
        if hasattr(high, "epoch"):
            break
    assert hosts_of(high) == {"h0"} and {h for h, _ in running} == {"h1"}
    low_slots = [(e["kind"], {h for h, _ in e["slots"]}) for e in pool.events("low") if e["slots"]]
    assert low_slots == [("grant", {"h0"}), ("grow", {"h1"}), ("shrink", {"h0"})]  # one move, once


def test_a_job_that_just_grew_moves_for_a_restricted_job_once_its_interval_passed(sqlite_url, clock):
    """It grew onto a host that came up just before the restricted job arrived: frozen by
    min_rescale_interval_s, it is moved (a grow-and-move, stamped when its old slots go) only
    after that, once, and the restricted job gets the slots."""
    pool = PoolClient(sqlite_url, clock=clock, aging_s=0.0, min_rescale_interval_s=60.0, lease_ttl_s=60)
    pool.add_host("h0", 2, {"gpu": "h100"})
    pool.add_host("h1", 4)
    pool.set_host_state("h1", "down")
    pool.submit("low", min_workers=1, max_workers=4, priority=1)
    low = pool.request("low")
    running = low.placements
    assert hosts_of(low) == {"h0"} and low.workers == 2
    for _ in range(4):  # running for 80 s: past min_rescale_interval_s
        clock.advance(20)
        pool.heartbeat("low", low.epoch, workers=2, placements=running)
    pool.set_host_state("h1", "up")
    pool.submit("high", min_workers=2, max_workers=2, priority=5, selector={"gpu": "h100"})
    for _ in range(10):
        clock.advance(20)
        running = pool.heartbeat("low", low.epoch, workers=len(running), placements=running).placements
        high = pool.request("high")
        if hasattr(high, "epoch"):
            break
    assert hosts_of(high) == {"h0"} and {h for h, _ in running} == {"h1"} and len(running) == 4
    kinds = [(e["kind"], {h for h, _ in e["slots"]}) for e in pool.events("low") if e["slots"]]
    # a grow onto h1 when it came up, then (once its interval passed) one grow-and-move, not undone
    assert kinds == [("grant", {"h0"}), ("grow", {"h1"}), ("grow", {"h1"}), ("shrink", {"h0"})]


def test_a_moved_job_is_not_sent_back_when_the_job_it_made_room_for_leaves(sqlite_url, clock):
    """'low' moved off h0 for 'R'; R left before low's next boundary; the plan, no longer needing
    h0, kept it for low (most-used host, then name) and sent low back: two relaunches 15 s apart
    (a review). The slot it left is released when it says it runs elsewhere."""
    pool = PoolClient(sqlite_url, clock=clock, aging_s=0.0, min_rescale_interval_s=60, lease_ttl_s=60)
    pool.add_host("h0", 1, {"gpu": "a100"})
    pool.add_host("h1", 1, {"gpu": "h100"})
    pool.submit("low", min_workers=1, max_workers=1, priority=1)
    low = pool.request("low")
    run_for(pool, clock, low, beats=2, every=40)
    pool.submit("R", min_workers=1, max_workers=1, priority=5, selector={"gpu": "a100"})
    assert not hasattr(pool.request("R"), "epoch")
    clock.advance(15)
    moved = pool.heartbeat("low", low.epoch, workers=1, placements=low.placements)
    assert {h for h, _ in moved.placements} == {"h1"}  # relaunched there
    pool.finish("R")
    clock.advance(15)
    after = pool.heartbeat("low", low.epoch, workers=1, placements=moved.placements)
    assert after.placements == moved.placements and after.action.value == "keep"
    assert [(e["kind"], e["slots"]) for e in pool.events("low") if e["slots"]][-1] == ("shrink", [("h0", 0)])


def test_a_job_mid_move_is_not_moved_again_inside_min_rescale_interval(sqlite_url, clock):
    """'low' was told to move off hA for R1 and relaunches on hB; before it said so, R2 (which
    needs hB) arrived and the plan moved low again (booked hC for it while it still released
    hA), a second move before the first was stamped (its rescale is stamped when its old slots
    go). A job still releasing slots it was told to give up is moved only off those: it
    finishes the move it has, and R2 gets hB once low's interval since that move has passed."""
    pool = PoolClient(sqlite_url, clock=clock, aging_s=0.0, min_rescale_interval_s=60.0, lease_ttl_s=60)
    pool.add_host("hA", 2, {"gpu": "x"})
    pool.add_host("hB", 2, {"gpu": "y"})
    pool.add_host("hC", 2)
    pool.submit("low", min_workers=1, max_workers=2, priority=1)
    low = pool.request("low")
    assert hosts_of(low) == {"hA"}
    run_for(pool, clock, low, beats=5, every=20)  # 100 s: past min_rescale_interval_s
    pool.submit("R1", min_workers=2, max_workers=2, priority=5, selector={"gpu": "x"})
    assert not hasattr(pool.request("R1"), "epoch")
    clock.advance(5)
    moved = pool.heartbeat("low", low.epoch, workers=2, placements=low.placements)
    assert {h for h, _ in moved.placements} == {"hB"}  # told to move; it relaunches there
    row = next(j for j in pool.status()["jobs"] if j["name"] == "low")
    assert row["releasing"] == [["hA", 0], ["hA", 1]]  # shown in `pool status` and the UI page
    assert report.job_rows({"jobs": [row]})[0][report.JOB_COLUMNS.index("WORKERS")] == "4 (2 leaving)"
    pool.submit("R2", min_workers=2, max_workers=2, priority=5, selector={"gpu": "y"})
    assert not hasattr(pool.request("R2"), "epoch")
    clock.advance(5)
    now = pool.heartbeat("low", low.epoch, workers=2, placements=moved.placements)  # runs on hB
    assert now.placements == moved.placements and now.action.value == "keep"
    assert hasattr(pool.request("R1"), "epoch")
    running, stamped = moved.placements, clock()
    for _ in range(8):  # R2 gets hB once low's interval since the move has passed, not before
        clock.advance(10)
        running = pool.heartbeat("low", low.epoch, workers=2, placements=running).placements
        if hasattr(r2 := pool.request("R2"), "epoch"):
            break
        assert {h for h, _ in running} == {"hB"} or clock() - stamped >= 60
    assert hosts_of(r2) == {"hB"} and {h for h, _ in running} == {"hC"}
    low_slots = [(e["kind"], {h for h, _ in e["slots"]}) for e in pool.events("low") if e["slots"]]
    assert low_slots == [("grant", {"hA"}), ("grow", {"hB"}), ("shrink", {"hA"}), ("grow", {"hC"}),
                         ("shrink", {"hB"})]
