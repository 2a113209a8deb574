"""Small builders for snapshots and hypothesis strategies over them."""

from __future__ import annotations

from hypothesis import strategies as st

from elastic_ops.pool.model import Host, HostState, Job, PolicyConfig, Preemption, Snapshot


def make_snapshot(hosts=(("h0", 8),), jobs=(), now=1_000.0, **config) -> Snapshot:
    """``hosts``: (name, slots[, state]) tuples; ``jobs``: Job objects or dicts of Job fields."""
    hs = tuple(Host(h[0], h[1], HostState(h[2]) if len(h) > 2 else HostState.UP) for h in hosts)
    js = tuple(j if isinstance(j, Job) else make_job(**j) for j in jobs)
    return Snapshot(hs, js, now, PolicyConfig(**config))


def make_job(name="j", min_workers=1, max_workers=8, priority=1, held=(), **kw) -> Job:
    kw.setdefault("waiting_since", None if held else kw.get("submitted", 0.0))
    return Job(name, min_workers, max_workers, priority, held=tuple(held), **kw)


@st.composite
def snapshots(draw, preemption=None, n_hosts_in=(1, 4), n_jobs_in=(0, 7)) -> Snapshot:
    """Any snapshot: ``n_hosts_in`` and ``n_jobs_in`` bound how many (small by default: the plain path;
    see ``large_snapshots`` for the vectorised one)."""
    n_hosts = draw(st.integers(*n_hosts_in))
    hosts = []
    for i in range(n_hosts):
        state = draw(st.sampled_from([HostState.UP] * 4 + list(HostState)))
        hosts.append(Host(f"h{i}", draw(st.integers(1, 8)), state))
    all_slots = [(h.name, s) for h in hosts for s in range(h.slots)]
    order = draw(st.permutations(all_slots))
    n_jobs = draw(st.integers(*n_jobs_in))
    jobs, cursor = [], 0
    now = 10_000.0
    for i in range(n_jobs):
        lo = draw(st.integers(1, 4))
        hi = draw(st.integers(lo, lo + 8))
        n_held = draw(st.integers(0, max(0, min(hi + 2, len(order) - cursor))))
        held = tuple(sorted(order[cursor : cursor + n_held]))
        cursor += n_held
        waiting = None if held else draw(st.floats(0, now))
        jobs.append(
            Job(
                name=f"job{i}",
                min_workers=lo,
                max_workers=hi,
                priority=draw(st.integers(1, 6)),
                preemptible=draw(st.booleans()),
                avoid_hosts=(avoid := frozenset(draw(st.sets(st.sampled_from([h.name for h in hosts]),
                                                             max_size=2)))),
                leave_hosts=frozenset(draw(st.sets(st.sampled_from(sorted(avoid)), max_size=2)) if avoid
                                      else ()),
                submitted=draw(st.floats(0, now)),
                waiting_since=waiting,
                last_rescale=draw(st.none() | st.floats(now - 200, now)),
                held=held,
            )
        )
    config = PolicyConfig(
        preemption=preemption or draw(st.sampled_from(list(Preemption))),
        min_rescale_interval_s=draw(st.sampled_from([0.0, 60.0])),
        min_gain=draw(st.sampled_from([0.0, 0.25])),
        aging_s=draw(st.sampled_from([0.0, 600.0])),
    )
    return Snapshot(tuple(hosts), tuple(jobs), now, config)


def large_snapshots(preemption=None):
    """Snapshots large enough for the vectorised policies (more than 48 jobs on more than 64
    hosts: ``policies._small`` is false), many jobs waiting."""
    return snapshots(preemption, n_hosts_in=(65, 72), n_jobs_in=(49, 90))


@st.composite
def shuffled_snapshots(draw) -> Snapshot:
    """Like :func:`snapshots`, but with ties (coarse priorities and submission times), hosts,
    jobs and each job's held slots in arbitrary order, and up to 16 jobs on up to 6 hosts, so
    the rank and placement tie-breaks are exercised."""
    n_hosts = draw(st.integers(1, 6))
    names = draw(st.permutations([f"h{i}" for i in range(n_hosts)]))
    hosts = [
        Host(name, draw(st.integers(1, 8)), draw(st.sampled_from([HostState.UP] * 5 + list(HostState))))
        for name in names
    ]
    free = draw(st.permutations([(h.name, s) for h in hosts for s in range(h.slots)]))
    now = 1_000.0
    jobs, cursor = [], 0
    for i in range(draw(st.integers(0, 16))):
        lo = draw(st.integers(0, 4))
        hi = draw(st.integers(max(lo, 1), lo + 10))
        n_held = draw(st.integers(0, max(0, min(hi + 2, len(free) - cursor))))
        held = tuple(free[cursor : cursor + n_held])  # unsorted on purpose
        cursor += n_held
        avoid = frozenset(draw(st.sets(st.sampled_from(list(names) + ["gone"]), max_size=2)))
        leave = frozenset(draw(st.sets(st.sampled_from(sorted(avoid)), max_size=2)) if avoid else ())
        # the ledger allows priorities 1..1000: 1..3 makes ties
        jobs.append(_job(draw, f"job{draw(st.integers(0, 99)):02d}-{i}", lo, hi, held, now, avoid, leave))
    config = _draw_config(draw)
    return Snapshot(tuple(hosts), tuple(draw(st.permutations(jobs))), now, config)


def _job(draw, name, lo, hi, held, now, avoid=frozenset(), leave=frozenset()) -> Job:
    """A job with the rest of its fields drawn: priority 1..3, preemptible or not, coarse
    submission and waiting times, maybe rescaled recently, some held slots being released."""
    return Job(
        name=name,
        min_workers=lo,
        max_workers=hi,
        priority=draw(st.integers(1, 3)),
        preemptible=draw(st.booleans()),
        avoid_hosts=avoid,
        leave_hosts=leave,
        submitted=float(draw(st.integers(0, 3))),
        waiting_since=None if held else float(draw(st.integers(0, 2_000))),
        last_rescale=draw(st.none() | st.sampled_from([now - 100, now - 10])),
        held=held,
        releasing=_releasing(draw, held),
    )


def _releasing(draw, held) -> frozenset:
    """Some of ``held`` being released (a shrink or a move told at an earlier heartbeat)."""
    return frozenset(draw(st.sets(st.sampled_from(held)))) if held else frozenset()


def _draw_config(draw) -> PolicyConfig:
    return PolicyConfig(
        preemption=draw(st.sampled_from(list(Preemption))),
        min_rescale_interval_s=draw(st.sampled_from([0.0, 60.0])),
        min_gain=draw(st.sampled_from([0.0, 0.25])),
        aging_s=draw(st.sampled_from([0.0, 600.0])),
    )


@st.composite
def selector_snapshots(draw) -> Snapshot:
    """Jobs restricted by host selectors (several jobs share a selector, so some hosts are
    spare: no restricted job may use them) and by hosts that failed them, next to jobs that may
    use any host; held slots scattered, some hosts not up."""
    n_hosts = draw(st.integers(2, 6))
    hosts = [
        Host(f"h{i}", draw(st.integers(1, 6)), draw(st.sampled_from([HostState.UP] * 6 + list(HostState))))
        for i in range(n_hosts)
    ]
    kinds = {h.name: draw(st.sampled_from(["a", "b"])) for h in hosts}
    free = draw(st.permutations([(h.name, s) for h in hosts for s in range(h.slots)]))
    now = 1_000.0
    jobs, cursor = [], 0
    for i in range(draw(st.integers(1, 8))):
        lo = draw(st.integers(1, 4))
        hi = draw(st.integers(lo, lo + 6))
        selector = draw(st.sampled_from([None, None, "a", "b"]))
        outside = frozenset(h for h, k in kinds.items() if selector and k != selector)
        failed = frozenset(draw(st.sets(st.sampled_from(sorted(kinds)), max_size=1)))
        n_held = draw(st.integers(0, max(0, min(hi + 1, len(free) - cursor))))
        held = tuple(free[cursor : cursor + n_held])
        cursor += n_held
        jobs.append(_job(draw, f"job{i}", lo, hi, held, now, outside | failed, outside))
    config = _draw_config(draw)
    return Snapshot(tuple(hosts), tuple(jobs), now, config)


def grant(pool, job, **kw):
    """Submit ``job`` (min 1, max 4 unless given) and request it; it must be granted."""
    from elastic_ops.pool import Grant

    pool.submit(job, min_workers=kw.pop("min_workers", 1), max_workers=kw.pop("max_workers", 4), **kw)
    g = pool.request(job)
    assert isinstance(g, Grant), g
    return g
