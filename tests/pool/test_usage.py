"""Slot-hours per job and host, replayed from the event log: exact for a scripted timeline,
never more than a host's slots can give, and the same through the CLI."""

from __future__ import annotations

import json
import random

import pytest

from elastic_ops.errors import SpecError
from elastic_ops.pool import PoolClient
from elastic_ops.pool.usage import usage

from .cli_helper import run


def scripted(url: str, clock) -> PoolClient:
    """h1 (4 slots), h2 (2); job a holds h1's 4 slots for an hour, job b h2's 2 from the half hour
    on; the ledger's clock stops at 1.5 h."""
    pool = PoolClient(url, clock=clock, lease_ttl_s=86_400)  # the most: no lease expires here
    pool.add_host("h1", 4)
    pool.add_host("h2", 2)
    t0 = clock.t
    pool.submit("a", min_workers=4, max_workers=4)
    epoch = pool.request("a").epoch
    clock.t = t0 + 1800
    pool.submit("b", min_workers=2, max_workers=2)
    pool.request("b")
    clock.t = t0 + 3600
    pool.release("a", epoch, finished=True)
    clock.t = t0 + 5400
    return pool


def test_slot_hours_follow_the_event_log(sqlite_url, clock):
    u = scripted(sqlite_url, clock).usage()
    assert u["hours"] == pytest.approx(1.5)
    assert {j["job"]: j["slot_hours"] for j in u["jobs"]} == {"a": 4.0, "b": 2.0}
    assert {h["host"]: (h["slot_hours"], h["utilization"]) for h in u["hosts"]} == {
        "h1": (4.0, pytest.approx(4 / 6, abs=1e-4)), "h2": (2.0, pytest.approx(2 / 3, abs=1e-4))}
    alone = PoolClient(sqlite_url, clock=clock).usage(job="b")  # b's events only, from its first
    assert alone["jobs"] == [{"job": "b", "slot_hours": 2.0}] and alone["hours"] == 1.0
    assert [h["host"] for h in alone["hosts"]] == ["h2"]
    last = scripted(sqlite_url.replace("pool.db", "pool2.db"), clock).usage(hours=0.5)  # the last half hour
    assert {j["job"]: j["slot_hours"] for j in last["jobs"]} == {"b": 1.0} and last["hours"] == 0.5
    with pytest.raises(SpecError, match="hours"):
        PoolClient(sqlite_url).usage(hours=0)


def test_the_cli_prints_the_same_numbers(sqlite_url, clock, monkeypatch, capsys):
    pool = scripted(sqlite_url, clock)
    expected = pool.usage()
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    monkeypatch.setattr(PoolClient, "usage", lambda self, hours=None: expected)  # the ledger's clock moved on
    assert run(["pool", "usage", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected
    assert run(["pool", "usage"]) == 0
    table = capsys.readouterr().out
    assert "6 slot-hours over 1.5 hours" in table and "66.7%" in table


@pytest.mark.parametrize("seed", range(8))
def test_no_host_gives_more_slot_hours_than_it_has(sqlite_url, clock, seed):
    rng = random.Random(seed)
    pool = PoolClient(sqlite_url, clock=clock, aging_s=0.0, lease_ttl_s=30.0)
    sizes = {f"n{i}": rng.randint(1, 4) for i in range(3)}
    for name, n in sizes.items():
        pool.add_host(name, n)
    t0 = clock.t
    for _ in range(60):
        job = f"j{rng.randrange(4)}"
        if rng.random() < 0.5:
            pool.submit(job, min_workers=1, max_workers=rng.randint(1, 6), priority=rng.randint(1, 5))
            pool.request(job)
        else:
            live = {j["name"]: j for j in pool.status()["jobs"] if j["workers"]}
            if job in live:
                if rng.random() < 0.6:
                    pool.heartbeat(job, live[job]["epoch"], workers=live[job]["workers"])
                else:
                    pool.release(job, live[job]["epoch"], finished=rng.random() < 0.5)
        clock.advance(rng.uniform(0, 40))  # sometimes past the TTL: leases expire
    u = pool.usage()
    span = (clock.t - t0) / 3600
    for h in u["hosts"]:
        assert h["slot_hours"] <= sizes[h["host"]] * span + 1e-3  # figures are rounded to 1e-4
    jobs, hosts = sum(j["slot_hours"] for j in u["jobs"]), sum(h["slot_hours"] for h in u["hosts"])
    assert jobs == pytest.approx(hosts, abs=1e-3) and jobs > 0


def test_a_slot_is_counted_for_its_holder_only():
    events = [
        {"ts": 0, "kind": "grant", "job": "a", "slots": [("h", 0)]},
        {"ts": 10, "kind": "release", "job": "b", "slots": [("h", 0)]},  # not b's: ignored
        {"ts": 20, "kind": "release", "job": "a", "slots": [("h", 0)]},
        {"ts": 30, "kind": "grant", "job": "b", "slots": [("h", 0)]},
    ]
    u = usage(events, since=5, until=40)
    assert u.jobs == {"a": 15.0, "b": 10.0} and u.hosts == {"h": 25.0}
