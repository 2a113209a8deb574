"""Simulator input is validated where it enters (no Pollux traces needed: a toy traces folder
stands in): settings, workload rows, the traces folder and the simulate command's options."""

from __future__ import annotations

import pytest

from elastic_ops.errors import SpecError
from elastic_ops.pool.policies import POLICIES
from elastic_ops.pool.simulator import SimConfig, Simulation, simulate
from elastic_ops.pool.workload import WorkloadJob, load_application, read_workload

from .cli_helper import run


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("rescale_cost", float("nan"), ">= 0"),
    ("rescale_cost", float("inf"), ">= 0"),
    ("rescale_cost", -1.0, ">= 0"),
    ("replan_interval", 1e-9, ">= 1"),  # would tick forever
    ("replan_interval", float("nan"), ">= 1"),
    ("min_rescale_interval_s", float("nan"), ">= 0"),
    ("min_gain", float("inf"), ">= 0"),
])
def test_simulation_settings_must_be_finite_and_sane(field, value, allowed):
    with pytest.raises(SpecError, match=f"invalid {field}=.*must be a finite number {allowed}"):
        SimConfig(**{field: value})


@pytest.mark.parametrize("row", [
    "j1,0,cifar10,-3,128",
    "j1,0,cifar10,0,128",
    "j1,0,cifar10,2,-5",
    "j1,nan,cifar10,2,128",
    "j1,0,cifar10,two,128",
])
def test_bad_workload_rows_name_the_file_and_line(tmp_path, row):
    path = tmp_path / "w.csv"
    path.write_text(f"name,time,application,num_replicas,batch_size\nj0,0,cifar10,1,128\n{row}\n")
    with pytest.raises(SpecError, match=f"invalid workload='{path}:3'"):
        read_workload(path)


HEADER = "name,time,application,num_replicas,batch_size\n"


def write_workload_csv(tmp_path, *rows: str):
    path = tmp_path / "w.csv"
    path.write_text(HEADER + "".join(f"{r}\n" for r in rows))
    return path


def toy_traces(root, app="toy"):
    """A traces folder with one application: batch 32 on 1 GPU only, 100 iterations of 0.5 s."""
    folder = root / app
    folder.mkdir(parents=True)
    (folder / "placements.csv").write_text("placement,local_bsz,step_time\n1,32,0.5\n")
    (folder / "scalability.csv").write_text("num_replicas,num_nodes,local_bsz,step_time\n32,8,32,0.5\n")
    (folder / "validation-32.csv").write_text("iteration,metric\n0,0.1\n100,0.9\n")
    return root


def toy_run(tmp_path, *rows: str, **config):
    """Metrics of fairshare over ``rows`` on the toy traces, and how often it re-planned."""
    traces = toy_traces(tmp_path / "traces")
    calls = []
    real = POLICIES["fairshare"]

    def counted(snap):
        calls.append(snap.now)
        if len(calls) > 50:  # re-planning an empty cluster tick after tick: as good as a hang
            raise RuntimeError(f"re-planned {len(calls)} times, last at t={snap.now}")
        return real(snap)

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(POLICIES, "fairshare", counted)
        result = simulate(read_workload(write_workload_csv(tmp_path, *rows)), "fairshare",
                          SimConfig(slots=4, **config), traces)
    return result, calls


def test_a_repeated_job_name_is_refused_naming_the_file_line_and_name(tmp_path):
    # the policies know jobs by name: two of one name crashed fairshare with a KeyError
    path = write_workload_csv(tmp_path, "a,0,toy,1,32", "b,1,toy,1,32", "a,5,toy,1,32")
    with pytest.raises(SpecError, match=rf"invalid workload='{path}:4': job name 'a' is already used on "
                                        r"line 2; names must be unique"):
        read_workload(path)
    twice = [WorkloadJob("a", 0.0, "toy", 1, 32)] * 2  # a list the caller built (no file)
    with pytest.raises(SpecError, match="invalid workload='a': job names must be unique"):
        Simulation(twice, "fairshare", SimConfig(), toy_traces(tmp_path / "traces"))


def test_an_empty_job_name_is_refused(tmp_path):
    with pytest.raises(SpecError, match=rf"invalid workload='{write_workload_csv(tmp_path, ',0,toy,1,32')}:2'"
                                        r".*name is empty"):
        read_workload(tmp_path / "w.csv")


@pytest.mark.parametrize("time", ["1e300", "1e16", "1000000001"])
def test_an_arrival_past_the_simulators_clock_range_is_refused(tmp_path, time):
    path = write_workload_csv(tmp_path, f"a,{time},toy,1,32")
    with pytest.raises(SpecError, match=rf"invalid workload='{path}:2'.*time '{time}' is not a number of "
                                        r"seconds from 0 to 1,000,000,000"):
        read_workload(path)
    late = [WorkloadJob("a", float(time), "toy", 1, 32)]  # a list the caller built (no file)
    with pytest.raises(SpecError, match="invalid workload='a': submit must be a number of seconds from 0"):
        Simulation(late, "fairshare", SimConfig(), toy_traces(tmp_path / "traces"))


def test_a_far_arrival_is_reached_in_a_few_steps_and_timed_exactly(tmp_path):
    # 100 iterations of 0.5 s, plus the 30 s start: 80 s whenever the job arrives
    near, _ = toy_run(tmp_path / "near", "a,0,toy,1,32")
    far, calls = toy_run(tmp_path / "far", "a,0,toy,1,32", "b,1e9,toy,1,32")
    assert near["avg_jct"] == 80.0
    assert far["avg_jct"] == 80.0  # a tolerance of 1e-6 of the clock ended b at its first tick (60 s)
    assert far["makespan"] == 1e9 + 80.0
    assert len(calls) < 10, calls  # not a re-plan every 60 s of an empty cluster up to t=1e9


def test_tick_only_replanning_keeps_its_ticks_across_an_idle_cluster(tmp_path):
    # ticks at 0, 60, 120, …: a job arriving at 30 waits for the tick at 60 (not planned at 30)
    result, calls = toy_run(tmp_path, "a,30,toy,1,32", replan_on_events=False)
    assert calls[0] == 60.0
    assert result["avg_jct"] == 30.0 + 80.0


def test_a_workload_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "w.csv"
    path.write_bytes(HEADER.encode() + b"a,0,toy,1,32\n\xff\xfe,1,toy,1,32\n")
    with pytest.raises(SpecError, match=rf"invalid workload='{path}:3': must be a UTF-8 text CSV; "
                                        r"byte 0xff is not UTF-8"):
        read_workload(path)
    path.write_bytes(b"\xef\xbb\xbf" + HEADER.encode() + b"a,0,toy,1,32\n")  # a spreadsheet's BOM
    assert [j.name for j in read_workload(path)] == ["a"]


@pytest.mark.parametrize(("damage", "says"), [
    (lambda app: (app / "placements.csv").unlink(), "toy has no placements.csv"),
    (lambda app: (app / "scalability.csv").write_text("num_replicas,step_time\n"),
     r"toy has an unreadable scalability.csv \(no column num_nodes, local_bsz\)"),
    (lambda app: (app / "placements.csv").write_text("placement,local_bsz,step_time\n"),
     "toy has an empty placements.csv"),
    (lambda app: (app / "validation-32.csv").unlink(), r"toy has no validation-<batch>.csv"),
    (lambda app: (app / "validation-32.csv").write_bytes(b"iteration,metric\n0,\xff\n"),
     "toy has an unreadable validation-32.csv"),
])
def test_an_incomplete_traces_folder_is_named_with_what_it_lacks(tmp_path, damage, says):
    traces = toy_traces(tmp_path / "traces")
    damage(traces / "toy")
    with pytest.raises(SpecError, match=rf"invalid traces='{traces}': Pollux application traces: {says}"):
        load_application(str(traces), "toy")


def test_an_application_is_a_plain_name_quoted_as_written(tmp_path):
    toy_traces(tmp_path)  # tmp_path/toy: outside the traces folder below
    traces = toy_traces(tmp_path / "traces", app="cifar10")
    path = write_workload_csv(tmp_path, "a,0,../toy,1,32")
    with pytest.raises(SpecError, match=rf"invalid workload='{path}:2'.*application '\.\./toy' is not a "
                                        r"plain name"):
        read_workload(path)
    for name in ("../toy", "/etc", "", "cifar10/"):  # a list the caller built goes through here
        with pytest.raises(SpecError, match=f"invalid application={name!r}: must be a plain name"):
            load_application(str(traces), name)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--min-rescale-interval-s", "-5"], "invalid --min-rescale-interval-s=-5.0: must be a finite number"),
    (["--min-rescale-interval", "-5"], "invalid --min-rescale-interval-s=-5.0"),
    (["--rescale-cost", "-1"], "invalid --rescale-cost=-1.0"),
    (["--replan-interval", "0"], "invalid --replan-interval=0.0"),
    (["--min-gain", "nan"], "invalid --min-gain=nan"),
    (["--policy", "bogus"], "invalid --policy='bogus': must be one of static, tiresias, fairshare, goodput, "
                            "priority, strict, or all"),
])
def test_simulate_errors_name_the_option(tmp_path, capsys, argv, needle):
    workload = write_workload_csv(tmp_path, "a,0,toy,1,32")
    assert run(["simulate", "--workload", str(workload), "--traces", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_simulate_names_where_a_broken_traces_folder_came_from(tmp_path, capsys, monkeypatch):
    traces = toy_traces(tmp_path / "traces")
    (traces / "toy" / "placements.csv").unlink()
    workload = str(write_workload_csv(tmp_path, "a,0,toy,1,32"))
    assert run(["simulate", "--workload", workload, "--traces", str(traces), "--policy", "static"]) == 2
    assert f"invalid --traces='{traces}': Pollux application traces: toy has no placements.csv" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("ELASTIC_OPS_TRACES", str(traces))
    assert run(["simulate", "--workload", workload, "--policy", "static"]) == 2
    assert f"invalid $ELASTIC_OPS_TRACES='{traces}'" in capsys.readouterr().err


def test_a_batch_beyond_what_the_traces_measured_is_refused_naming_the_job(tmp_path):
    """Step times past the largest measured batch are extrapolated without bound: a batch of
    1e11 kept the simulator busy far past any limit (a probe stopped it after 20 s)."""
    with pytest.raises(SpecError, match=r"invalid batch_size=99999999999: job 'a': at most 32, the largest "
                                        r"batch the toy traces measured"):
        toy_run(tmp_path, "a,0,toy,1,99999999999")
    result, _ = toy_run(tmp_path / "ok", "a,0,toy,1,32")
    assert result["avg_jct"] > 0


def test_a_traces_folder_without_applications_says_so_not_blaming_the_workload(tmp_path, capsys, monkeypatch):
    """The folder above the right one (``…/pollux`` for ``…/pollux/traces``), a missing one, or the
    default beside a checkout that has none: it was ``invalid application='toy': no traces folder
    …/toy``, blaming the workload's application and naming neither --traces nor where the folder
    came from."""
    toy_traces(tmp_path / "pollux" / "traces")
    workload = str(write_workload_csv(tmp_path, "a,0,toy,1,32"))
    above = tmp_path / "pollux"
    assert run(["simulate", "--workload", workload, "--traces", str(above), "--policy", "static"]) == 2
    assert (f"invalid --traces='{above}': a folder of Pollux application traces, one folder per application "
            "(cifar10, bert, …): holds none (no folder in it has a placements.csv)") in (
        capsys.readouterr().err
    )
    missing = tmp_path / "nope"
    assert run(["simulate", "--workload", workload, "--traces", str(missing), "--policy", "static"]) == 2
    err = capsys.readouterr().err
    assert f"invalid --traces='{missing}': a folder of Pollux application traces" in err
    assert ": does not exist (hint: e.g. ../shared/traces/pollux/traces)" in err
    monkeypatch.setenv("ELASTIC_OPS_TRACES", str(missing))
    assert run(["simulate", "--workload", workload, "--policy", "static"]) == 2
    assert f"invalid $ELASTIC_OPS_TRACES='{missing}'" in capsys.readouterr().err
    monkeypatch.delenv("ELASTIC_OPS_TRACES")
    monkeypatch.setattr("elastic_ops.pool.simulator.default_traces_dir", lambda: missing)
    assert run(["simulate", "--workload", workload, "--policy", "static"]) == 2
    assert "(hint: the default, beside the checkout; pass --traces DIR or set $ELASTIC_OPS_TRACES)" in (
        capsys.readouterr().err
    )


def test_an_application_the_traces_lack_names_the_job_and_the_ones_they_have(tmp_path):
    traces = toy_traces(tmp_path / "traces")
    toy_traces(traces, app="bert")
    with pytest.raises(SpecError, match=rf"invalid application='cifar': job 'a': not in the traces folder "
                                        rf"{traces}, which has bert, toy"):
        simulate(read_workload(write_workload_csv(tmp_path, "a,0,cifar,1,32")), "fairshare",
                 SimConfig(slots=4), traces)
