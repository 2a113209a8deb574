"""Ledger behaviour: leases, fencing, preemption, hosts, runtime control, errors (SQLite + PostgreSQL)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from elastic_ops.errors import (
    JobEndedError,
    LeaseExpiredError,
    LedgerUnavailableError,
    SpecError,
    UnknownHostError,
    UnknownJobError,
)
from elastic_ops.pool import Grant, PoolClient, TargetAction, Wait
from elastic_ops.pool.policies import SMALL_CLUSTER
from elastic_ops.pool.schema import LATEST

from .builders import grant
from .timeline import held_now, replay


@pytest.fixture
def pool(ledger_url, clock):
    client = PoolClient(ledger_url, clock=clock, lease_ttl_s=30)
    client.add_host("h0", 4)
    yield client
    client.close()


def test_expired_lease_returns_its_slots_and_its_epoch_is_dead(pool, clock):
    g = grant(pool, "a")
    clock.advance(20)
    pool.heartbeat("a", g.epoch, workers=4)  # renews: expires 30 s from now
    clock.advance(29)
    pool.check_epoch("a", g.epoch)
    clock.advance(2)
    with pytest.raises(LeaseExpiredError, match="lease epoch 1 of job 'a' is not live"):
        pool.check_epoch("a", g.epoch)
    with pytest.raises(LeaseExpiredError):
        pool.heartbeat("a", g.epoch, workers=4)
    assert pool.status()["slots"]["used"] == 0
    assert [e["kind"] for e in pool.events("a")][-1] == "expiry"
    g2 = grant(pool, "b")
    assert g2.workers == 2  # "a" still waits (its chunk will be retried): fair share
    # The zombie's release is a no-op and takes nothing from b; a retry gets a new epoch.
    assert pool.release("a", g.epoch) is False
    assert pool.status()["slots"]["used"] == 2
    assert pool.request("a").epoch == g.epoch + 1


def test_epoch_increases_with_every_grant_and_stale_ones_are_refused(pool, clock):
    g1 = grant(pool, "a")
    assert pool.request("a") == g1  # asking again returns the live lease
    pool.release("a", g1.epoch)
    g2 = pool.request("a")
    assert g2.epoch == g1.epoch + 1
    with pytest.raises(LeaseExpiredError, match="live epoch: 2"):
        pool.check_epoch("a", g1.epoch)
    pool.check_epoch("a", g2.epoch)


def test_release_is_idempotent_and_finished_jobs_leave_the_plan(pool):
    g = grant(pool, "a")
    assert pool.release("a", g.epoch, finished=True) is True
    assert pool.release("a", g.epoch, finished=True) is False
    job = {j["name"]: j for j in pool.status()["jobs"]}["a"]
    assert job["state"] == "finished" and job["workers"] == 0


def test_full_preemption_checkpoint_release_and_request_again(pool, clock):
    low = grant(pool, "low", priority=1, min_workers=2)
    pool.submit("high", min_workers=4, max_workers=4, priority=9)
    assert isinstance(pool.request("high"), Wait)
    t = pool.heartbeat("low", low.epoch, workers=4)
    assert t.action == TargetAction.PREEMPT and t.workers == 0
    t = pool.heartbeat("low", low.epoch, workers=0)  # checkpointed and stopped
    assert t.action == TargetAction.PREEMPT
    with pytest.raises(LeaseExpiredError):
        pool.check_epoch("low", low.epoch)
    assert pool.request("high").workers == 4
    assert isinstance(pool.request("low"), Wait)
    kinds = [e["kind"] for e in pool.events("low")]
    assert "preempt" in kinds and kinds.count("release") == 1
    replay(pool.events())


def test_drain_moves_jobs_off_at_their_boundary(pool, clock):
    pool.add_host("h1", 4)
    g = grant(pool, "a", max_workers=4)
    assert {h for h, _ in g.placements} == {"h0"}
    pool.drain_host("h0")
    t = pool.heartbeat("a", g.epoch, workers=4)
    assert t.action == TargetAction.GROW and {h for h, _ in t.placements} == {"h1"}
    pool.heartbeat("a", g.epoch, workers=4, placements=t.placements)
    assert {h for h, _ in held_now(pool.events())} == {"h1"}


def test_a_job_whose_host_drains_while_the_others_are_full_is_preempted_and_keeps_its_slots(pool):
    """Nothing usable is left for it: the target is a preemption (not a 0-worker shrink), and
    the slots it still runs on stay its own until it reports that it stopped."""
    pool.configure(policy="fairshare")
    pool.add_host("h1", 4)
    full = grant(pool, "full", max_workers=4)  # all of h0; it would shrink for r, at its boundary
    assert {h for h, _ in full.placements} == {"h0"}
    g = grant(pool, "r", max_workers=4)
    assert {h for h, _ in g.placements} == {"h1"}
    pool.drain_host("h1")
    t = pool.heartbeat("r", g.epoch, workers=4)  # r's share waits for slots "full" has not freed
    assert t.action == TargetAction.PREEMPT and t.workers == 0
    pool.heartbeat("r", g.epoch, workers=4)  # still running on h1 (count only): nothing released
    assert {s for s, job in held_now(pool.events()).items() if job == "r"} == set(g.placements)
    pool.heartbeat("r", g.epoch, workers=0)  # checkpointed and stopped: everything returns
    assert not [s for s, job in held_now(pool.events()).items() if job == "r"]


def test_a_job_moving_off_a_draining_host_never_runs_below_its_minimum(pool):
    """Its new slots are not all free yet (another job gives them up at its boundary): it keeps
    enough of its old ones meanwhile, and moves the rest when they are."""
    pool.configure(policy="priority")
    pool.add_host("h1", 4)
    grant(pool, "x", min_workers=2, max_workers=2, priority=1)  # h0:0-1 (best fit)
    y = grant(pool, "y", min_workers=1, max_workers=3, priority=1)  # h1:0-2
    a = grant(pool, "a", min_workers=3, max_workers=3, priority=5)  # h0:2-3 and h1:3: no host holds 3
    assert {h for h, _ in a.placements} == {"h0", "h1"} and len(y.placements) == 3
    pool.drain_host("h0")
    t = pool.heartbeat("a", a.epoch, workers=3, placements=a.placements)
    assert t.workers == 3 and t.action == TargetAction.KEEP, t  # not a shrink to its 1 slot on h1
    ty = pool.heartbeat("y", y.epoch, workers=3)
    assert ty.workers == 1  # y makes room for a on h1, at its boundary
    pool.heartbeat("y", y.epoch, workers=1, placements=ty.placements)
    t = pool.heartbeat("a", a.epoch, workers=3, placements=a.placements)
    assert t.workers == 3 and {h for h, _ in t.placements} == {"h1"}, t  # now it moves
    pool.heartbeat("a", a.epoch, workers=3, placements=t.placements)
    assert {s[0] for s, job in held_now(pool.events()).items() if job == "a"} == {"h1"}
    replay(pool.events())


def test_a_host_cannot_shrink_under_running_jobs(pool):
    g = grant(pool, "a", min_workers=4, max_workers=4)
    with pytest.raises(SpecError, match=r"invalid slots=2: must keep the slots jobs hold on host 'h0'"):
        pool.add_host("h0", 2)
    assert len(pool.heartbeat("a", g.epoch, workers=4).placements) == 4  # nothing vanished
    pool.add_host("h0", 8)  # growing is fine


def test_a_non_preemptible_jobs_minimum_cannot_rise_above_what_it_holds(pool):
    g = grant(pool, "np", min_workers=2, max_workers=2, preemptible=False)
    grant(pool, "filler", min_workers=2, max_workers=2)  # h0's other 2 slots: no room to grow
    with pytest.raises(SpecError, match="invalid min_workers=3: must be <= the 2 slots job 'np' holds"):
        pool.set_bounds("np", 3, 4)
    pool.set_bounds("np", 1, 2)  # within what it holds: fine
    # the same change by the other ways in (register submits the spec again at a run's start)
    with pytest.raises(SpecError, match="invalid min_workers=3: must be <= the 2 slots job 'np' holds"):
        pool.submit("np", min_workers=3, max_workers=4, preemptible=False)
    pool.set_preemptible("np", True)
    pool.set_bounds("np", 3, 4)  # preemptible now: it may be preempted to honour it
    with pytest.raises(SpecError, match="invalid min_workers=3: must be <= the 2 slots job 'np' holds"):
        pool.set_preemptible("np", False)  # still holding 2 until it reports the preemption
    assert pool.heartbeat("np", g.epoch, workers=2).workers == 0


def test_a_non_preemptible_job_whose_max_is_lowered_shrinks_to_it_and_no_further(pool):
    """Its max lowered by one, it was preempted outright for a waiting job (a probe)."""
    g = grant(pool, "np", min_workers=2, max_workers=4, preemptible=False)
    pool.submit("vip", min_workers=1, max_workers=4, priority=10)
    assert pool.request("vip").__class__.__name__ == "Wait"
    pool.set_bounds("np", 2, 3)
    t = pool.heartbeat("np", g.epoch, workers=4)
    assert t.workers == 3 and "keeps 3: job is not preemptible" in t.reason


def test_submitting_a_live_job_again_logs_what_changed(pool):
    """A re-submit changed bounds and priority with no event: nothing explained a drop from 8 to
    2 workers, and the log could not tell a job's demand (a probe)."""
    grant(pool, "j", min_workers=1, max_workers=4)
    pool.submit("j", min_workers=1, max_workers=4)  # the same demand: nothing to log
    pool.submit("j", min_workers=1, max_workers=2, priority=7, selector={"gpu": "a100"})
    configs = [e["reason"] for e in pool.events(job="j") if e["kind"] == "config"]
    assert configs == ['submitted again: max 4 -> 2, priority 1 -> 7, selector {} -> {"gpu": "a100"}']


def test_drained_host_takes_no_new_grants(pool):
    pool.drain_host("h0")
    pool.submit("a", min_workers=1, max_workers=4)
    w = pool.request("a")
    assert isinstance(w, Wait) and "exceeds the 0 usable slots" in w.reason
    pool.add_host("h0", 4)  # back up
    assert pool.request("a").workers == 4


def test_failures_make_the_job_avoid_the_host_and_cool_it_down(pool, clock):
    pool.configure(failure_threshold=2, cooling_s=100, lease_ttl_s=1000)
    pool.add_host("h1", 2)
    g = grant(pool, "a", max_workers=6)
    pool.report_failure("a", "h0")
    pool.release("a", g.epoch)
    g2 = pool.request("a", avoid_hosts=["h0"])
    assert {h for h, _ in g2.placements} == {"h1"}
    pool.submit("b", min_workers=1, max_workers=4)
    pool.report_failure("b", "h0")
    hosts = {h["name"]: h for h in pool.status()["hosts"]}
    assert hosts["h0"]["state"] == "cooling"
    pool.submit("c", min_workers=1, max_workers=4)
    assert isinstance(pool.request("c"), Wait)  # h0 is cooling, h1 is a's
    clock.advance(101)
    assert {h["name"]: h for h in pool.status()["hosts"]}["h0"]["state"] == "up"
    assert isinstance(pool.request("b"), Wait)  # b avoids h0 for good
    assert {h for h, _ in pool.request("c").placements} == {"h0"}


def test_finish_releases_what_a_job_holds_and_is_idempotent(pool):
    g = grant(pool, "j", min_workers=2, max_workers=2)
    pool.finish("j")
    pool.finish("j")
    assert pool.status()["slots"]["used"] == 0
    assert {j["name"]: j for j in pool.status()["jobs"]}["j"]["state"] == "finished"
    with pytest.raises(LeaseExpiredError):
        pool.check_epoch("j", g.epoch)
    replay(pool.events())  # the slots were released, not just forgotten
    assert held_now(pool.events()) == {}


def test_a_one_host_pool_grants_the_job_again_where_it_failed(pool):
    """Avoiding the only host that can hold the job would make it wait forever."""
    g = grant(pool, "a", max_workers=4)
    pool.report_failure("a", "h0")
    pool.release("a", g.epoch)
    again = pool.request("a", avoid_hosts=["h0"])
    assert isinstance(again, Grant) and {h for h, _ in again.placements} == {"h0"}


def test_a_new_try_gets_a_new_epoch_on_the_same_slots(pool):
    g = grant(pool, "a", max_workers=4)
    assert pool.request("a") == g  # the same try asking again: the same lease
    g2 = pool.request("a", new_attempt=True)  # a new try while the old lease is still live
    assert g2.epoch == g.epoch + 1 and g2.placements == g.placements
    with pytest.raises(LeaseExpiredError, match="lease epoch 1 of job 'a' is not live \\(live epoch: 2\\)"):
        pool.heartbeat("a", g.epoch, workers=4)
    assert pool.heartbeat("a", g2.epoch, workers=4).workers == 4
    assert pool.status()["slots"]["used"] == 4  # re-issued, not granted twice
    assert [e["kind"] for e in pool.events("a")][-1] == "reissue"
    replay(pool.events())  # no slot ever held twice
    assert held_now(pool.events()) == {tuple(slot): "a" for slot in g.placements}


def state_of(pool, job):
    return next(r["state"] for r in pool.status()["jobs"] if r["name"] == job)


def test_a_handed_over_lease_keeps_its_slots_for_the_next_chunk(pool):
    g = grant(pool, "a", max_workers=4)
    assert pool.release("a", g.epoch, handover=True) is True
    assert state_of(pool, "a") == "parked" and pool.status()["slots"]["used"] == 4
    g2 = pool.request("a", new_attempt=True)  # the next chunk's first request
    assert g2.epoch == g.epoch + 1 and g2.placements == g.placements
    assert state_of(pool, "a") == "running"
    with pytest.raises(LeaseExpiredError):
        pool.heartbeat("a", g.epoch, workers=4)  # the finished chunk's epoch is dead
    assert [e["kind"] for e in pool.events("a")][-2:] == ["park", "reissue"]
    replay(pool.events())


def test_parked_slots_the_plan_takes_go_at_once_without_a_boundary(pool):
    g = grant(pool, "a", max_workers=4)
    pool.release("a", g.epoch, handover=True)
    b = grant(pool, "b", max_workers=4)  # equal share: 2 / 2, granted on b's own request
    assert b.workers == 2
    assert len(pool.request("a", new_attempt=True).placements) == 2
    kinds = [(e["kind"], e["job"]) for e in pool.events() if e["kind"] in ("shrink", "grant")]
    assert kinds[-2:] == [("shrink", "a"), ("grant", "b")]  # freed before granted, never both
    replay(pool.events())


def test_a_parked_job_preempted_by_the_plan_ends_its_lease(pool):
    pool.configure(policy="priority")
    g = grant(pool, "a", min_workers=3, max_workers=4, priority=1)
    pool.release("a", g.epoch, handover=True)
    b = grant(pool, "b", min_workers=3, max_workers=4, priority=5)
    assert b.workers == 4
    assert state_of(pool, "a") == "waiting"
    with pytest.raises(LeaseExpiredError):
        pool.check_epoch("a", g.epoch)
    assert isinstance(pool.request("a", new_attempt=True), Wait)
    replay(pool.events())


def test_a_heartbeat_that_reports_workers_unparks_the_lease(pool):
    """A parked job runs nothing, so the plan frees its slots at once: a job that heartbeats
    workers under the same lease is running again, and its slots go only at a boundary."""
    g = grant(pool, "a", max_workers=4)
    pool.release("a", g.epoch, handover=True)
    assert pool.heartbeat("a", g.epoch, workers=4).workers == 4
    assert state_of(pool, "a") == "running"
    pool.submit("b", min_workers=1, max_workers=4)
    assert isinstance(pool.request("b"), Wait)  # a's 2 slots are released at its next boundary
    assert pool.status()["slots"]["used"] == 4


def test_a_parked_job_on_a_draining_host_moves_before_its_next_chunk_starts(pool):
    g = grant(pool, "a", max_workers=4)
    pool.add_host("h1", 4)
    pool.release("a", g.epoch, handover=True)
    pool.drain_host("h0")  # nothing runs on h0: its slots go at once, the job's share moves to h1
    nxt = pool.request("a", new_attempt=True)
    assert {h for h, _ in nxt.placements} == {"h1"} and nxt.workers == 4
    replay(pool.events())


def test_a_parked_lease_nobody_takes_over_expires_after_one_ttl(pool, clock):
    g = grant(pool, "a")
    clock.advance(20)
    pool.release("a", g.epoch, handover=True)  # kept for one TTL from the hand-over
    clock.advance(29)
    assert pool.status()["slots"]["used"] == 4
    clock.advance(2)
    assert pool.status()["slots"]["used"] == 0 and state_of(pool, "a") == "waiting"
    assert pool.request("a").epoch == g.epoch + 1


def test_handing_over_a_dead_lease_or_a_finished_job_is_refused_or_a_no_op(pool, clock):
    g = grant(pool, "a")
    with pytest.raises(SpecError, match="handover"):
        pool.release("a", g.epoch, finished=True, handover=True)
    clock.advance(31)
    assert pool.release("a", g.epoch, handover=True) is False
    assert state_of(pool, "a") == "waiting" and pool.status()["slots"]["used"] == 0


def test_an_overdue_lease_is_never_handed_out_again(pool, clock):
    g = grant(pool, "a")
    clock.advance(31)  # past the TTL; nothing has synced the ledger since
    assert pool.request("a").epoch == g.epoch + 1


def test_the_expiry_a_heartbeat_finds_is_committed_before_it_raises(pool, clock):
    g = grant(pool, "a")
    clock.advance(31)
    with pytest.raises(LeaseExpiredError):
        pool.heartbeat("a", g.epoch, workers=4)
    assert [e["kind"] for e in pool.events("a")][-1] == "expiry"


@pytest.mark.parametrize("setting", ["lease_ttl_s", "min_gain", "min_rescale_interval_s", "cooling_s"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300])
def test_pool_settings_must_be_finite_and_bounded(pool, setting, bad):
    """1e300 is finite, but a lease that long never expires: its dead holder's slots stay taken."""
    least = "of seconds >= 1" if setting == "lease_ttl_s" else ">= 0"
    with pytest.raises(SpecError, match=f"invalid {setting}=.*: must be a finite number {least} and <= "):
        pool.configure(**{setting: bad})


@pytest.mark.parametrize("bad", [1e-320, 1e-9, 0.5, float("nan"), 1e300])
def test_aging_is_off_or_at_least_a_second(pool, bad):
    """1e-320 raised an OverflowError in the policy at the next re-plan; 1e-9 made the two
    policy implementations rank long-waiting jobs differently."""
    with pytest.raises(SpecError, match=r"invalid aging_s="):
        pool.configure(aging_s=bad)
    assert pool.configure(aging_s=0)["aging_s"] == 0


def test_an_unreachable_ledger_is_a_retryable_error_without_the_password():
    with pytest.raises(LedgerUnavailableError) as err:
        PoolClient("postgresql+psycopg2://pool:S3cretPW@127.0.0.1:1/pool")
    assert err.value.retryable
    assert "S3cretPW" not in str(err.value) and "pool:***@127.0.0.1:1" in str(err.value)


def test_runtime_control_replans_at_once(pool):
    g = grant(pool, "a", max_workers=4)
    pool.set_bounds("a", 1, 2)
    assert pool.heartbeat("a", g.epoch, workers=4).workers == 2
    pool.set_preemptible("a", False)
    pool.set_priority("a", 7)
    job = {j["name"]: j for j in pool.status()["jobs"]}["a"]
    assert (job["priority"], job["max_workers"], job["preemptible"], job["target"]) == (7, 2, False, 2)


def test_a_waiting_job_that_stopped_asking_does_not_block_others(pool, clock):
    pool.configure(job_idle_s=60)
    pool.submit("gone", min_workers=4, max_workers=4, priority=9)
    clock.advance(61)
    assert grant(pool, "here").workers == 4


def test_invalid_input_gets_clear_errors(pool):
    with pytest.raises(SpecError, match="min_workers=5: must be <= max_workers \\(2\\)"):
        pool.submit("a", min_workers=5, max_workers=2)
    with pytest.raises(SpecError, match="priority=-1"):
        pool.submit("a", min_workers=1, max_workers=2, priority=-1)
    with pytest.raises(UnknownJobError, match="unknown job 'nope'"):
        pool.request("nope")
    with pytest.raises(UnknownJobError):
        pool.set_priority("nope", 3)
    with pytest.raises(UnknownHostError, match="unknown host 'h9'"):
        pool.drain_host("h9")
    with pytest.raises(SpecError, match="policy=.fastest.: must be a policy name, one of fairshare"):
        pool.configure(policy="fastest")
    with pytest.raises(SpecError, match="state='broken'"):
        pool.set_host_state("h0", "broken")
    with pytest.raises(SpecError, match="slots=0"):
        pool.add_host("h1", 0)
    for bad_host in (" ", "a:b,c", ""):
        with pytest.raises(SpecError, match="invalid host=.*letters, digits"):
            pool.add_host(bad_host, 2)
    with pytest.raises(SpecError, match="invalid labels=.*label name '' must be 1-63 letters"):
        pool.add_host("h1", 2, labels={"": "x"})


def test_every_entry_point_refuses_malformed_values_before_they_reach_the_ledger(pool):
    """Found by an adversarial probe: values that were stored as they came (a string iterated
    into one-letter hosts, a name with a NUL), placements that matched no slot, and types the
    database driver choked on (a raw OverflowError or ProgrammingError instead of a SpecError)."""
    pool.add_host("h0", 4)
    pool.submit("a", min_workers=1, max_workers=2)
    g = pool.request("a")
    huge = 2**63
    cases = [
        (lambda: pool.request("a", avoid_hosts="h0"), "avoid_hosts", "a list of host names"),
        (lambda: pool.request("a", avoid_hosts={"h0": 1}), "avoid_hosts", "a list of host names"),
        (lambda: pool.request("a", avoid_hosts=["bad host"]), "avoid_hosts", "letters, digits"),
        (lambda: pool.request("a", new_attempt="yes"), "new_attempt", "true or false"),
        (lambda: pool.request(huge), "job", "printable characters"),
        (lambda: pool.request(["a"]), "job", "printable characters"),
        (lambda: pool.submit("h\x00", min_workers=1, max_workers=1), "job", "printable"),
        (lambda: pool.submit(" a", min_workers=1, max_workers=1), "job", "surrounding spaces"),
        (lambda: pool.add_host("h1", 2, labels={"a b": "v"}), "labels", "label name 'a b'"),
        (lambda: pool.add_host("h1", 2, labels={"k": "v" * 254}), "labels", "at most 253"),
        (lambda: pool.set_host_state(huge, "up"), "host", "letters, digits"),
        (lambda: pool.report_failure("a", True), "host", "letters, digits"),
        (lambda: pool.heartbeat("a", True, workers=1), "epoch", "an integer"),
        (lambda: pool.heartbeat("a", g.epoch, workers=1, placements=["h0:0"]), "placements", "pairs"),
        (lambda: pool.heartbeat("a", g.epoch, workers=1, placements=[("h0",)]), "placements", "pairs"),
        (lambda: pool.heartbeat("a", g.epoch, workers=1, placements=[("h0", -1)]), "placements", "integer"),
        (lambda: pool.release("a", None), "epoch", "an integer"),
        (lambda: pool.release("a", g.epoch, finished="no"), "finished", "true or false"),
        (lambda: pool.events(since_id=None), "since_id", "an integer"),
        (lambda: pool.events(since_id=huge), "since_id", "an integer"),
        (lambda: pool.events(job=huge), "job", "printable"),
        (lambda: pool.usage(job=["a"]), "job", "printable"),
        (lambda: pool.configure(policy=[1]), "policy", "a policy name"),
        (lambda: pool.configure(lease_ttl_s=2**63), "lease_ttl_s", "<= 86400"),
        # leases lost to any pause of their holder, waiting jobs left out at once (were accepted)
        (lambda: pool.configure(lease_ttl_s=1e-320), "lease_ttl_s", "seconds >= 1"),
        (lambda: pool.configure(job_idle_s=0.5), "job_idle_s", "seconds >= 1"),
    ]
    before = pool.status()
    for call, field, allowed in cases:
        with pytest.raises(SpecError) as err:
            call()
        assert err.value.field == field and allowed in str(err.value), (field, str(err.value))
    after = pool.status()
    assert after["jobs"] == before["jobs"] and after["hosts"] == before["hosts"]
    # well-formed placements still work: the job says it runs on its slot
    assert pool.heartbeat("a", g.epoch, workers=2, placements=list(g.placements)).workers == 2


def test_bad_urls_are_rejected(tmp_path):
    with pytest.raises(SpecError, match="sqlite and postgresql") as err:
        PoolClient("mysql://x/y")
    assert "hint" not in str(err.value)
    # the spelling many DATABASE_URLs use: SQLAlchemy has no such dialect, so say which one it is
    with pytest.raises(SpecError, match=r"sqlite and postgresql URLs \(hint: write postgresql://…: "
                                        r"SQLAlchemy has no postgres:// alias\)"):
        PoolClient("postgres://pool@db.example/pool")
    with pytest.raises(SpecError, match="needs an absolute file path"):
        PoolClient("sqlite://")
    with pytest.raises(SpecError, match="needs an absolute file path"):  # each process its own ledger
        PoolClient("sqlite:///relative.db")


@pytest.mark.parametrize("url", ["mysql://pool:S3cr@tPW@db.example/pool", "not a url://pool:S3cr@tPW@db"])
def test_a_rejected_url_is_shown_without_its_password(url):
    with pytest.raises(SpecError) as err:
        PoolClient(url)
    assert "S3cr@tPW" not in str(err.value) and "pool:***@" in str(err.value)


def test_schema_is_versioned_and_reopening_keeps_data(ledger_url, clock):
    a = PoolClient(ledger_url, clock=clock)
    a.add_host("h0", 2)
    b = PoolClient(ledger_url, clock=clock)  # a second process opening the same ledger
    with b.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT max(version) FROM schema_version")).scalar() == LATEST
    assert [h["name"] for h in b.status()["hosts"]] == ["h0"]


def test_preempted_job_that_stopped_gives_everything_back_even_if_the_plan_changed(pool):
    """``workers=0`` after ``preempt`` ends the lease even when, in between, the preemptor left
    and the plan would now let the job keep its slots: the job has stopped and waits again."""
    a = grant(pool, "a", priority=1)
    pool.submit("b", min_workers=4, max_workers=4, priority=5)
    assert isinstance(pool.request("b"), Wait)
    assert pool.heartbeat("a", a.epoch, workers=4).action == TargetAction.PREEMPT
    pool.release("b", 0, finished=True)  # the preemptor goes away before "a" reaches its boundary
    t = pool.heartbeat("a", a.epoch, workers=0)  # "a" checkpointed and stopped
    assert (t.action, t.workers) == (TargetAction.PREEMPT, 0)
    with pytest.raises(LeaseExpiredError):
        pool.check_epoch("a", a.epoch)
    events = pool.events()
    replay(events)
    assert held_now(events) == {}
    assert pool.status()["slots"]["used"] == 0
    assert pool.request("a").epoch == a.epoch + 1


def test_a_pool_large_enough_for_the_vectorised_policy_stays_consistent(ledger_url, clock):
    """60 jobs on 70 two-slot hosts: more than ``policies.SMALL_CLUSTER`` hosts, so every re-plan
    uses the vectorised policy and the ledger reads its column plan (targets, reasons, the new
    slots of growing jobs, grants)."""
    assert 70 > SMALL_CLUSTER[1]
    pool = PoolClient(ledger_url, clock=clock, lease_ttl_s=600)
    try:
        for i in range(70):
            pool.add_host(f"h{i:02d}", 2)
        live = {}
        for i in range(60):
            job = f"j{i:02d}"
            pool.submit(job, min_workers=1, max_workers=4, priority=1 + i % 3)
            answer = pool.request(job)
            if isinstance(answer, Grant):
                live[job] = answer
        assert len(live) >= 30  # 140 slots for 60 jobs of 1..4
        for _ in range(2):  # heartbeats: shrink at a boundary, then grow into what was freed
            for job, g in sorted(live.items()):
                t = pool.heartbeat(job, g.epoch, workers=len(g.placements))
                if t.action == TargetAction.SHRINK:
                    t = pool.heartbeat(job, g.epoch, workers=t.workers)
                live[job] = Grant(job, g.epoch, t.placements, g.ttl_s)
        done = sorted(live)[:12]
        for job in done:  # some finish: the others grow into their slots
            pool.release(job, live.pop(job).epoch, finished=True)
        for job, g in sorted(live.items()):
            t = pool.heartbeat(job, g.epoch, workers=len(g.placements))
            live[job] = Grant(job, g.epoch, t.placements, g.ttl_s)
        for i in range(60):
            job = f"j{i:02d}"
            if job not in live and job not in done and isinstance(answer := pool.request(job), Grant):
                live[job] = answer
        events = pool.events()
        assert {"grant", "grow", "shrink", "release"} <= {e["kind"] for e in events}
        replay(events)  # no slot ever held by two jobs
        owner = held_now(events)
        assert len(owner) == pool.status()["slots"]["used"] <= 140
        for job, g in live.items():  # later re-plans may have grown a job, never shrunk it
            assert set(map(tuple, g.placements)) <= {s for s, j in owner.items() if j == job}, job
    finally:
        pool.close()


def test_pruning_old_events_keeps_what_explains_the_slots_held_now(pool, clock):
    pool.configure(lease_ttl_s=10_000)  # "a" keeps its lease over the hour
    a = grant(pool, "a", max_workers=2)
    b = grant(pool, "b", max_workers=2)
    pool.release("b", b.epoch, finished=True)
    clock.advance(3600)
    grant(pool, "c", max_workers=2)  # recent: kept
    before = held_now(pool.events())
    assert pool.prune_events(1800) > 0
    events = pool.events()
    assert not [e for e in events if e["job"] == "b"]  # finished and old: gone
    assert not [e for e in events if e["job"] is None]  # old host events: gone
    assert {e["job"] for e in events} == {"a", "c"} and held_now(events) == before
    replay(events)  # still a consistent history: no slot held twice, none freed by a stranger
    pool.check_epoch("a", a.epoch)  # the live lease is untouched (raises if not)
    assert pool.prune_events(1800) == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1d"])
def test_pruning_needs_a_positive_age(pool, bad):
    with pytest.raises(SpecError, match="older_than_s"):
        pool.prune_events(bad)


@pytest.mark.postgres
def test_clients_on_hosts_with_skewed_clocks_share_the_databases_clock(pg_url, monkeypatch):
    """A client on a host whose clock runs an hour ahead must not expire another's lease."""
    import time

    a = PoolClient(pg_url, lease_ttl_s=60)
    a.add_host("h0", 2)
    a.submit("j", min_workers=1, max_workers=2)
    g = a.request("j")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # this "host" is an hour ahead
    PoolClient(pg_url).status()  # by its own clock every lease is overdue
    monkeypatch.setattr(time, "time", real)
    a.check_epoch("j", g.epoch)  # still live: both clients read the database's clock
    assert a.status()["slots"]["used"] == 2


def test_a_job_nobody_asks_for_shows_as_idle_not_with_its_last_share(tmp_path):
    """A task marked failed between chunks asks no more: after job_idle_s it leaves the plan, and
    its row said so only as the last share it was given (a probe read it as still planned)."""
    now = [1000.0]
    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}", clock=lambda: now[0])
    pool.add_host("h1", 2)
    pool.submit("gone", min_workers=2, max_workers=2)
    pool.request("gone")  # granted
    pool.release("gone", pool.request("gone").epoch)  # released, not finished: it may ask again
    pool.submit("other", min_workers=1, max_workers=1)
    now[0] += pool.status()["settings"]["job_idle_s"] + 1
    pool.request("other")
    gone = next(j for j in pool.status()["jobs"] if j["name"] == "gone")
    assert gone["target"] == 0 and gone["reason"].startswith("idle: no request for over 180s"), gone


def test_a_late_release_does_not_bring_a_finished_job_back(pool):
    g = grant(pool, "a")
    pool.finish("a")  # e.g. on_kill ended it
    assert pool.release("a", g.epoch) is False  # the dying try releases again: nothing live
    assert {j["name"]: j for j in pool.status()["jobs"]}["a"]["state"] == "finished"
    with pytest.raises(JobEndedError, match="'a' has ended in the pool while this try was still running"):
        pool.request("a")  # the dying try, preempted by the lost lease, asks again: not revived
    assert {j["name"]: j for j in pool.status()["jobs"]}["a"]["state"] == "finished"
    pool.request("a", new_attempt=True)  # only a new try (a cleared chunk) makes it wait again
    assert {j["name"]: j for j in pool.status()["jobs"]}["a"]["state"] != "finished"


def test_event_ids_keep_growing_when_pruning_empties_the_log(ledger_url):
    """Pruning every event let SQLite number the next ones from 1 again: a reader polling
    ``events(since_id=…)`` with the last id it had seen missed them (a probe)."""
    from .conftest import Clock

    clock = Clock()
    pool = PoolClient(ledger_url, clock=clock)
    try:
        pool.add_host("h0", 2)
        pool.submit("a", min_workers=1, max_workers=1)
        seen = pool.events()[-1]["id"]
        clock.advance(3600)
        pool.prune_events(60)
        pool.submit("b", min_workers=1, max_workers=1)
        new = pool.events(since_id=seen)
        assert ("submit", "b") in [(e["kind"], e["job"]) for e in new]
    finally:
        pool.close()


@pytest.mark.postgres
def test_a_postgres_ledger_gets_64_bit_event_ids_past_2_to_the_31(pg_url, clock):
    """A serial's sequence stopped at 2**31 - 1: the next event (every grant, release, target
    change logs one) failed. v3 widens the column and the sequence of a ledger from before."""
    a = PoolClient(pg_url, clock=clock)
    a.add_host("h0", 2)
    a.close()
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:  # back to schema 2: a 32-bit serial, as an earlier release made it
        conn.execute(sa.text("ALTER TABLE events ALTER COLUMN id TYPE INTEGER"))
        seq = conn.execute(sa.text("SELECT pg_get_serial_sequence('events', 'id')")).scalar()
        conn.execute(sa.text(f"ALTER SEQUENCE {seq} AS INTEGER"))
        conn.execute(sa.text("DELETE FROM schema_version WHERE version = 3"))
    b = PoolClient(pg_url, clock=clock)
    with engine.begin() as conn:
        conn.execute(sa.text(f"SELECT setval('{seq}', {2**31 - 1})"))
    b.add_host("h1", 2)  # logs an event past 2**31 - 1
    assert b.events()[-1]["id"] == 2**31
    b.close()
    engine.dispose()


@pytest.mark.postgres
def test_a_view_on_the_event_log_that_blocks_schema_3_is_named(pg_url, clock):
    """ALTER ... TYPE BIGINT is refused while a view uses the column: every client start failed
    with a raw NotSupportedError (a review); it is a SpecError naming the ledger and the fix."""
    PoolClient(pg_url, clock=clock).close()
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE events ALTER COLUMN id TYPE INTEGER"))
        conn.execute(sa.text("DELETE FROM schema_version WHERE version = 3"))
        conn.execute(sa.text("CREATE VIEW recent_events AS SELECT id, kind FROM events"))
    with pytest.raises(SpecError, match="events.id can be widened to BIGINT") as err:
        PoolClient(pg_url, clock=clock)
    assert "drop or redefine the views" in str(err.value)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP VIEW recent_events"))
    PoolClient(pg_url, clock=clock).close()  # and then it migrates
    engine.dispose()


def test_a_preempted_job_that_gives_up_every_slot_has_stopped(pool):
    """Told to preempt, a job reported workers=1 with none of its slots (contradictory, but what
    a keeper on another host may send): every slot went and a live lease holding none stayed,
    and request() returned a grant of 0 workers (a probe). Holding nothing, it has stopped."""
    low = grant(pool, "low", min_workers=4, max_workers=4, priority=1)
    pool.submit("high", min_workers=4, max_workers=4, priority=5)
    assert isinstance(pool.request("high"), Wait)
    assert pool.heartbeat("low", low.epoch, workers=4).action.value == "preempt"
    out = pool.heartbeat("low", low.epoch, workers=1, placements=[])
    assert out.action.value == "preempt" and out.workers == 0
    low_row = next(j for j in pool.status()["jobs"] if j["name"] == "low")
    assert low_row["state"] == "waiting" and low_row["lease_expires_in"] is None
    assert isinstance(pool.request("high"), Grant)
    again = pool.request("low")
    assert isinstance(again, Wait)  # not a grant of 0 workers under the old lease
