"""The simulator: trace-driven job lengths, the same policies, metrics a user compares."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from elastic_ops.errors import SpecError, UnknownPolicyError
from elastic_ops.pool import policies
from elastic_ops.pool.simulator import SimConfig, simulate, tuned_max_workers
from elastic_ops.pool.workload import (
    SYNTHETIC_BATCH,
    default_traces_dir,
    load_application,
    placement_for,
    read_workload,
    synthetic_workload,
)

from .cli_helper import run

WORKLOAD = Path(__file__).parent / "data" / "tiny-workload.csv"
TRACES = default_traces_dir()
pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason=f"needs the Pollux traces at {TRACES}")
SMALL = SimConfig(slots=16, slots_per_host=4)


def test_job_lengths_come_from_measured_traces():
    app = load_application(str(TRACES), "cifar10")
    # Fixed global batch: more GPUs shrink the per-GPU batch, so a step gets faster but less than linearly.
    t1, t4 = app.step_time(1, 2048), app.step_time(4, 2048)
    assert t4 < t1 < 4 * t4
    assert placement_for(6) == "24" and placement_for(16) == "4444"
    # A larger global batch needs fewer iterations to reach the same metric.
    assert app.iterations(4096) < app.iterations(2048) < app.iterations(128)
    assert 1 <= tuned_max_workers(app, 2048, 64) <= app.max_workers(2048, 64)


def test_static_and_elastic_policies_finish_every_job():
    results = {name: simulate(WORKLOAD, name, SMALL, TRACES) for name in ("static", "fairshare")}
    for r in results.values():
        assert r["jobs"] == 8
        assert 0 < r["utilization"] <= 1.0
        assert r["p99_jct"] >= r["avg_jct"] > 0 and r["makespan"] >= r["p99_jct"] - 240
    assert results["static"]["rescales"] == 0
    assert results["fairshare"]["rescales"] > 0
    # Elastic sharing beats strict FIFO with fixed requests on a contended cluster.
    assert results["fairshare"]["avg_jct"] < results["static"]["avg_jct"]


def test_rescale_cost_is_charged():
    cheap = simulate(WORKLOAD, "fairshare", SimConfig(slots=16, rescale_cost=0), TRACES)
    dear = simulate(WORKLOAD, "fairshare", SimConfig(slots=16, rescale_cost=300), TRACES)
    assert dear["avg_jct"] > cheap["avg_jct"]


def test_the_simulator_calls_the_registered_policy(monkeypatch):
    calls = []
    real = policies.POLICIES["priority"]
    monkeypatch.setitem(policies.POLICIES, "priority", lambda snap: calls.append(snap) or real(snap))
    simulate(WORKLOAD, "priority", SMALL, TRACES)
    assert calls and all(sum(h.slots for h in s.hosts) == 16 for s in calls)


def test_bad_simulation_input():
    with pytest.raises(UnknownPolicyError,
                       match="known policies: fairshare, goodput, priority, static, strict, tiresias"):
        simulate(WORKLOAD, "best", SMALL, TRACES)
    with pytest.raises(SpecError, match="slots=0"):
        SimConfig(slots=0)
    with pytest.raises(SpecError, match="must be an existing CSV"):
        read_workload("/nonexistent.csv")


def test_simulate_cli_json_last_line(capsys):
    rc = run(["simulate", "--workload", str(WORKLOAD), "--slots", "16", "--policy", "all", "--json"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last) == {"static", "tiresias", "fairshare", "goodput", "priority", "strict"}
    assert {"avg_jct", "p99_jct", "makespan", "utilization", "rescales"} <= set(last["fairshare"])


def test_simulate_cli_adaptive_lets_goodput_choose_the_batches(capsys):
    argv = ["simulate", "--workload", str(WORKLOAD), "--slots", "16", "--policy", "goodput", "--json"]
    assert run([*argv, "--adaptive"]) == 0
    adaptive = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert run(argv) == 0
    fixed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert adaptive["batch_changes"] > 0 and fixed["batch_changes"] == 0


def test_synthetic_workloads_sample_the_philly_trace_reproducibly():
    a = synthetic_workload(TRACES / "philly.csv", TRACES, jobs=20, seed=3)
    assert a == synthetic_workload(TRACES / "philly.csv", TRACES, jobs=20, seed=3)
    assert a != synthetic_workload(TRACES / "philly.csv", TRACES, jobs=20, seed=4)
    assert len(a) == 20 and all(0 <= j.submit < 8 * 3600 for j in a)
    assert all(j.application in SYNTHETIC_BATCH and 1 <= j.num_replicas <= 64 for j in a)
    r = simulate(a, "fairshare", SimConfig(slots=32), TRACES)
    assert r["jobs"] == 20


def test_a_preempted_job_ages_from_its_preemption_as_in_the_ledger():
    from elastic_ops.pool.simulator import Simulation

    sim = Simulation(read_workload(WORKLOAD), "priority", SMALL, TRACES)
    job = sim.jobs[0]
    sim.now = 100.0
    sim._start_or_rescale(job, (("h0", 0),))
    sim.now = 500.0
    sim._start_or_rescale(job, ())  # preempted
    (snap_job,) = sim._snapshot([job]).jobs
    assert snap_job.waiting_since == 500.0  # not its submission time: aging starts over


def test_step_times_follow_the_measured_spread():
    app = load_application(str(TRACES), "cifar10")
    # placements.csv: "1111,64,0.14134659767150878": 4 nodes x 1 GPU at per-GPU batch 64
    assert app.step_time(4, 4 * 64, (1, 1, 1, 1)) == pytest.approx(0.14134659767150878)
    assert app.step_time(4, 256, (4,)) == app.step_time(4, 256)  # one node: the packed estimate
    assert app.step_time(4, 256, (1, 3)) == app.step_time(4, 256, (3, 1))  # spelled "13" or "31"
    assert app.step_time(5, 320, (1, 1, 1, 1, 1)) == app.step_time(5, 320)  # not measured: packed
    assert app.step_time(16, 1024, (1,) * 16) != app.step_time(16, 1024)  # 16 nodes, scalability.csv


def place(sim, name: str, slots) -> object:
    job = next(j for j in sim.jobs if j.spec.name == name)
    sim._start_or_rescale(job, tuple(slots))
    return job


@pytest.mark.parametrize("placement", ["actual", "packed"])
def test_a_scattered_job_runs_at_its_spreads_speed_and_a_move_costs_a_relaunch(placement):
    from elastic_ops.pool.simulator import Simulation

    sim = Simulation(read_workload(WORKLOAD), "fairshare", SimConfig(slots=16, placement=placement), TRACES)
    job = place(sim, "cifar10-2", [("n000", i) for i in range(4)])  # 4 GPUs on one host
    packed = job.rate()
    job.penalty = 0.0
    place(sim, "cifar10-2", [("n000", 0), ("n001", 0), ("n002", 0), ("n003", 0)])  # same count, 4 hosts
    spread = 1 / job.app.step_time(4, 4096, (1, 1, 1, 1))
    if placement == "actual":
        assert job.rate() == pytest.approx(spread) and job.rate() != packed
        assert (job.moves, job.penalty) == (1, sim.cfg.rescale_cost)
    else:
        assert job.rate() == packed and (job.moves, job.penalty) == (0, 0.0)
    job.advance(10.0)
    assert job.scattered_gpu_seconds == job.gpu_seconds == 40.0


def test_simulation_reports_scattering_and_the_packed_model_is_still_there():
    actual = simulate(WORKLOAD, "fairshare", SMALL, TRACES)
    packed = simulate(WORKLOAD, "fairshare", dataclasses.replace(SMALL, placement="packed"), TRACES)
    assert 0 < actual["scattered"] <= 1 and actual["placement"] == "actual"
    assert actual["avg_jct"] != packed["avg_jct"]
    with pytest.raises(SpecError, match="placement='tight'"):
        SimConfig(placement="tight")


def test_goodput_sees_only_what_jobs_measured(monkeypatch):
    # the policy's snapshots carry no model for a job before it has run, and afterwards one
    # fitted to the (workers, hosts) it ran at -- never the traces' step times
    from elastic_ops.pool import simulator

    seen = []
    real = simulator.get_policy

    def spy(name):
        decide = real(name)
        return lambda snap: seen.append(snap) or decide(snap)

    monkeypatch.setattr(simulator, "get_policy", spy)
    simulate(WORKLOAD, "goodput", SMALL, TRACES)
    first = {}
    for snap in seen:
        for j in snap.jobs:
            first.setdefault(j.name, j)
            if j.scaling is not None:
                assert j.attained > 0 and j.scaling.measured >= 1
    assert all(j.scaling is None and j.attained == 0 for j in first.values() if not j.held)
    assert any(j.scaling is not None for snap in seen for j in snap.jobs)


def test_tiresias_runs_jobs_at_what_they_asked_for_packed_and_never_rescaled(monkeypatch):
    from elastic_ops.pool import simulator

    sizes: dict[str, set[int]] = {}
    spreads: list[tuple[int, int]] = []
    real = simulator.Simulation._start_or_rescale

    def spy(self, j, held):
        if held:
            sizes.setdefault(j.spec.name, set()).add(len(held))
            spreads.append((len(held), len({h for h, _ in held})))
        real(self, j, held)

    monkeypatch.setattr(simulator.Simulation, "_start_or_rescale", spy)
    r = simulate(WORKLOAD, "tiresias", SMALL, TRACES)
    wl = {w.name: min(w.num_replicas, SMALL.slots) for w in read_workload(WORKLOAD)}
    assert r["rescales"] == 0 and r["jobs"] == len(wl)
    assert all(s == {wl[name]} for name, s in sizes.items())
    # on as few hosts as fit whenever the free slots allow it; never more hosts than GPUs
    assert all(hosts <= n for n, hosts in spreads)
    assert sum(hosts == -(-n // SMALL.slots_per_host) for n, hosts in spreads) >= len(spreads) // 2


def test_tiresias_preempts_the_job_with_the_most_attained_service(monkeypatch):
    from elastic_ops.pool import simulator
    from elastic_ops.pool.workload import WorkloadJob

    # one job fills the cluster; past the threshold a newcomer (queue 0) preempts it at once
    monkeypatch.setattr(simulator, "TIRESIAS_THRESHOLD_GPU_S", 100.0)
    jobs = [WorkloadJob("long", 0.0, "cifar10", 16, 2048), WorkloadJob("new", 200.0, "cifar10", 16, 2048)]
    alone = simulator.Simulation(jobs[:1], "tiresias", SMALL, TRACES)
    alone.run()
    sim = simulator.Simulation(jobs, "tiresias", SMALL, TRACES)
    r = sim.run()
    long, new = sim.jobs
    assert new.started == pytest.approx(200.0) and r["rescales"] == 0
    assert long.finished > alone.jobs[0].finished  # it waited while the newcomer ran


def test_adaptive_jobs_under_goodput_change_their_batch_and_all_finish():
    cfg = dataclasses.replace(SMALL, adaptive=True)
    adaptive = simulate(WORKLOAD, "goodput", cfg, TRACES)
    fixed = simulate(WORKLOAD, "goodput", SMALL, TRACES)
    assert adaptive["jobs"] == fixed["jobs"] == 8
    assert adaptive["batch_changes"] > 0 and fixed["batch_changes"] == 0
    # a policy that does not choose batches runs the same jobs at their own batch
    assert simulate(WORKLOAD, "fairshare", cfg, TRACES) == simulate(WORKLOAD, "fairshare", SMALL, TRACES)


def test_an_adaptive_job_alone_finishes_sooner_than_at_its_fixed_batch():
    """cifar10 at its users' batch of 2048: early in training small batches make more progress
    per sample, late large ones keep many GPUs busy (the traces' gradient statistics)."""
    from elastic_ops.pool.workload import WorkloadJob

    job = [WorkloadJob("cifar10-0", 0.0, "cifar10", 4, 2048)]
    cfg = SimConfig(slots=16, slots_per_host=4)
    fixed = simulate(job, "goodput", cfg, TRACES)["avg_jct"]
    adaptive = simulate(job, "goodput", dataclasses.replace(cfg, adaptive=True), TRACES)
    assert adaptive["avg_jct"] < fixed and adaptive["batch_changes"] > 0


def test_an_iteration_at_its_own_batch_is_worth_one_and_a_larger_one_its_gain():
    app = load_application(str(TRACES), "cifar10")
    assert app.gain(128, 0) == 1.0  # the traces count progress in iterations at their smallest batch
    for epoch in (1, 10, 50):  # (the first epoch's statistics are noisy in the traces)
        assert app.gain(2048, epoch) >= app.gain(1024, epoch) >= 1.0
    ends = app.epoch_iterations(2048)
    assert list(ends) == sorted(ends) and ends[-1] >= app.iterations(2048) * 0.5


def test_simulate_with_tenants_reports_each_tenant(tmp_path, capsys):
    jobs = read_workload(WORKLOAD)
    spec = {"tenants": {"a": {"guaranteed": 8}, "b": {"guaranteed": 8, "weight": 2}},
            "jobs": {j.name: "ab"[k % 2] for k, j in enumerate(jobs)}}
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(spec))
    rc = run(["simulate", "--workload", str(WORKLOAD), "--slots", "16", "--policy", "fairshare",
              "--min-rescale-interval-s", "120", "--tenants", str(path), "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    tenants = result["tenants"]
    assert set(tenants) == {"a", "b"} and sum(t["jobs"] for t in tenants.values()) == len(jobs)
    for t in tenants.values():  # every guarantee given back within one rescale interval
        assert t["max_restore_s"] <= 120 + 1e-6 and t["avg_jct"] > 0
    assert "tenant a" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tenants": {"a": {"guaranteed": -1}}}))
    with pytest.raises(SpecError, match="tenants.a.guaranteed"):
        from elastic_ops.pool.simulator import read_tenants

        read_tenants(bad)
