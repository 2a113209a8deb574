"""`elastic-ops pool …` against a real ledger file."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from elastic_ops.errors import SpecError
from elastic_ops.pool import PoolClient

from .cli_helper import run


def test_pool_commands_drive_the_ledger(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "add-host", "gpu-0", "8", "--label", "zone=a"]) == 0
    client = PoolClient(sqlite_url)
    client.submit("train", min_workers=1, max_workers=8)
    g = client.request("train")
    assert run(["pool", "set-priority", "train", "7"]) == 0
    assert run(["pool", "set-bounds", "train", "2", "4"]) == 0
    assert run(["pool", "drain", "gpu-0"]) == 0
    capsys.readouterr()

    assert run(["pool", "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    job = st["jobs"][0]
    assert (job["name"], job["priority"], job["max_workers"], job["workers"], job["epoch"]) == (
        "train",
        7,
        4,
        8,
        1,
    )
    assert st["hosts"][0]["state"] == "draining" and st["hosts"][0]["labels"] == {"zone": "a"}

    assert run(["pool", "status"]) == 0
    table = capsys.readouterr().out
    assert "gpu-0" in table and "draining" in table and "train" in table

    assert run(["pool", "events", "--job", "train", "--json"]) == 0
    kinds = [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()]
    assert kinds[:2] == ["submit", "target"] and "grant" in kinds and "config" in kinds
    client.release("train", g.epoch, finished=True)


def test_pool_url_flag_and_clear_errors(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'other.db'}"
    assert run(["pool", "--pool-url", url, "set-priority", "ghost", "3"]) == 2
    assert "elastic-ops: error: unknown job 'ghost'" in capsys.readouterr().err
    assert run(["pool", "--pool-url", url, "configure", "--policy", "nope"]) == 2
    assert "invalid --policy='nope': must be a policy name, one of fairshare" in capsys.readouterr().err


def test_tables_show_control_characters_escaped_not_acted_on():
    from elastic_ops.pool.report import text_table

    table = text_table([["a\x1b[2J\nFAKE ROW", "1"]], ["NAME", "N"])
    lines = table.splitlines()
    assert len(lines) == 2 and lines[1] == "a\\x1b[2J\\nFAKE ROW  1" and "\x1b" not in table


def test_events_for_a_job_without_events_says_so(sqlite_url, monkeypatch, capsys):
    """An unknown (or mistyped) job is not an empty table that looks like success."""
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "add-host", "gpu-0", "8"]) == 0
    capsys.readouterr()
    assert run(["pool", "events", "--job", "trian"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "no events for job 'trian'" in out.err and "pool status" in out.err
    assert run(["pool", "events", "--job", "trian", "--json"]) == 0
    assert capsys.readouterr() == ("", "")  # JSON lines: nothing to parse, nothing on stderr
    assert run(["pool", "events"]) == 0
    assert "host" in capsys.readouterr().out  # the add-host event


def test_prune_events_command(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "add-host", "gpu-0", "8"]) == 0
    capsys.readouterr()
    assert run(["pool", "prune-events", "--older-than-days", "1"]) == 0
    assert capsys.readouterr().out.strip() == "deleted 0 events older than 1 days"
    assert run(["pool", "prune-events", "--older-than-days", "0"]) == 2
    allowed = "must be a finite number of days > 0 and <= 41666.7"
    assert f"--older-than-days=0.0: {allowed}" in capsys.readouterr().err
    assert run(["pool", "prune-events", "--older-than-days", "inf"]) == 2
    assert f"--older-than-days=inf: {allowed}" in capsys.readouterr().err
    assert run(["pool", "prune-events", "--older-than-days", "1e307"]) == 2  # in seconds: inf
    assert f"--older-than-days=1e+307: {allowed}" in capsys.readouterr().err


def test_an_invalid_value_names_the_option_it_came_from(tmp_path, monkeypatch, capsys):
    """The library's parameter (``lease_ttl_s``) is shown as the option the user typed."""
    monkeypatch.delenv("ELASTIC_OPS_POOL_URL", raising=False)
    monkeypatch.delenv("ELASTIC_OPS_API_URL", raising=False)
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    cases = [
        (["pool", "--pool-url", url, "configure", "--lease-ttl-s", "0"], "invalid --lease-ttl-s=0.0"),
        (["pool", "--pool-url", url, "usage", "--hours", "-1"], "invalid --hours=-1.0"),
        (["pool", "--pool-url", url, "add-host", "h", "1", "--label", "x"], "invalid --label='x'"),
        (["pool", "--pool-url", url, "add-host", "h", "1", "--label", "=v"], "invalid --label='=v'"),
        (["pool", "--api-url", "ftp://x", "status"], "invalid --api-url='ftp://x'"),
        (["pool", "--pool-url", "sqlite:///relative.db", "status"], "invalid --pool-url='sqlite:///relative.db'"),
        (["pool", "status"], "missing --pool-url: the ledger's SQLAlchemy URL (or $ELASTIC_OPS_POOL_URL), "
                             "or --api-url"),
        (["simulate", "--synthetic", "0"], "invalid --synthetic=0: must be an integer >= 1"),
        (["simulate", "--synthetic", "3", "--slots-per-host", "0"], "invalid --slots-per-host=0"),
        (["simulate", "--synthetic", "3", "--traces", str(tmp_path)],
         f"invalid --traces='{tmp_path}': a traces folder with the Philly trace (philly.csv)"),
    ]
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not an SQLite database " * 10)
    cases.append((["pool", "--pool-url", f"sqlite:///{junk}", "status"], "is not an SQLite database"))
    for argv, needle in cases:
        assert run(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)


def test_reading_commands_never_create_a_ledger(tmp_path, monkeypatch, capsys):
    """A typo in the ledger's path is an error, not a new empty ledger (and its folders)."""
    missing = tmp_path / "typo" / "pool.db"
    for command in (["status"], ["events"], ["usage"]):
        assert run(["pool", "--pool-url", f"sqlite:///{missing}", *command]) == 2
        assert f"an existing SQLite ledger: {missing} does not exist" in capsys.readouterr().err
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", f"sqlite:///{missing}")
    assert run(["pool", "status"]) == 2
    assert "invalid $ELASTIC_OPS_POOL_URL=" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()
    assert run(["pool", "add-host", "gpu-0", "2"]) == 0  # a changing command creates it
    assert run(["pool", "events"]) == 0
    out = capsys.readouterr().out
    assert "host     gpu-0" in out and "None" not in out  # a host event shows no job fields


@pytest.mark.postgres
def test_reading_commands_never_create_a_ledger_on_postgres(pg_url, capsys):
    """`pool status` on a PostgreSQL URL without a ledger (a typo, Airflow's own database) made the
    ledger's seven tables there (a probe)."""
    assert run(["pool", "--pool-url", pg_url, "status"]) == 2
    assert "an existing pool ledger: this database holds none" in capsys.readouterr().err
    with sa.create_engine(pg_url).connect() as conn:
        assert sa.inspect(conn).get_table_names() == []
    assert run(["pool", "--pool-url", pg_url, "add-host", "gpu-0", "2"]) == 0
    assert run(["pool", "--pool-url", pg_url, "status"]) == 0


@pytest.mark.parametrize("url", ["postgresql://dbuser:p@ssword99@127.0.0.1:5432/test",
                                 "postgresql://dbuser:p@ss:w0rd@127.0.0.1:5432/test"])
def test_a_password_holding_an_at_sign_is_refused_without_showing_it(url, capsys, monkeypatch):
    """It was a driver message quoting the password's tail as a host name, or a ValueError
    traceback (an audit): now one line naming the URL's field and the fix."""
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", url)
    assert run(["pool", "status"]) == 2
    err = capsys.readouterr().err
    assert "percent-encode '@'" in err and "Traceback" not in err
    assert "ssword99" not in err and "w0rd" not in err and "p@ss" not in err
    with pytest.raises(SpecError, match="%40"):
        PoolClient(url)


@pytest.mark.postgres
def test_a_postgres_url_the_ledger_cannot_use_says_why(pg_url, capsys):
    """A search_path naming no schema was a raw ProgrammingError traceback; a bare postgresql://
    (psycopg 3 to SQLAlchemy 2.1, not installed) a ModuleNotFoundError (a probe)."""
    missing = pg_url.rsplit("search_path%3D", 1)[0] + "search_path%3Dno_such_schema_zz"
    assert run(["pool", "--pool-url", missing, "add-host", "gpu-0", "2"]) == 2
    err = capsys.readouterr().err
    assert "invalid --pool-url=" in err and "no schema has been selected" in err and "Traceback" not in err
    bare = pg_url.replace("postgresql+psycopg2://", "postgresql://", 1)
    assert bare != pg_url and PoolClient(bare).engine.dialect.driver == "psycopg2"
    assert run(["pool", "--pool-url", pg_url.replace("+psycopg2", "+pg8000", 1), "status"]) == 2
    assert "a PostgreSQL driver that is installed: pg8000 is not" in capsys.readouterr().err


def test_pool_planner_runs_plans_until_stopped(sqlite_url, tmp_path):
    """The planner service: started as a process, it plans what is due with nobody else calling
    (an expired lease's slots return), and stops cleanly on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pool = PoolClient(sqlite_url, lease_ttl_s=1, plan_refresh_s=3600)
    pool.add_host("h0", 2)
    pool.submit("gone", min_workers=1, max_workers=2)
    pool.request("gone")  # granted; its holder never heartbeats
    env = {**os.environ, "ELASTIC_OPS_POOL_URL": sqlite_url}
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ops.cli", "pool", "planner", "--poll-s", "0.05"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(e["kind"] == "expiry" for e in pool.events("gone")):
            assert time.monotonic() < deadline, "the planner never expired the lease"
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "planning whenever a plan is due" in err and "planner stopped after" in err
    with sa.create_engine(sqlite_url).connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM allocations")).scalar() == 0


def test_pool_planner_once_and_its_errors(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "planner", "--once"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["planned_seq"] == state["dirty_seq"] and state["plans"] >= 1
    assert run(["pool", "planner", "--poll-s", "0"]) == 2
    assert "invalid --poll-s=0" in capsys.readouterr().err
    assert run(["pool", "configure", "--plan-interval-s", "0.2"]) == 0
    assert json.loads(capsys.readouterr().out)["plan_interval_s"] == 0.2


def test_changing_commands_print_what_changed_unless_quiet(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "add-host", "gpu-0", "8", "--label", "zone=a"]) == 0
    assert capsys.readouterr().out == "host gpu-0: added, 8 slots, up, labels zone=a\n"
    client = PoolClient(sqlite_url)
    client.submit("train", min_workers=1, max_workers=8)
    client.request("train")

    def said(*argv: str) -> str:
        assert run(["pool", *argv]) == 0
        return capsys.readouterr().out

    assert said("set-priority", "train", "7") == "job train: priority 1 -> 7\n"
    assert said("set-bounds", "train", "2", "4") == "job train: workers 1..8 -> 2..4, target 8 -> 4 workers\n"
    assert said("set-preemptible", "train", "false") == "job train: preemptible true -> false\n"
    assert said("drain", "gpu-0") == ("host gpu-0: state up -> draining; no new grants, the 8 slots in use "
                                      "move off at their jobs' next iteration boundary\n")
    assert said("add-host", "gpu-0", "10") == ("host gpu-0: state draining -> up, slots 8 -> 10, "
                                               "labels zone=a -> none\n")
    assert said("set-priority", "train", "7") == "job train: unchanged\n"
    assert said("set-priority", "train", "5", "--quiet") == ""
    assert said("drain", "gpu-0", "-q") == "" and client.status()["hosts"][0]["state"] == "draining"


def test_events_last_since_kind(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    for i in range(3):
        assert run(["pool", "add-host", f"h{i}", "2", "-q"]) == 0
    client = PoolClient(sqlite_url)
    client.submit("train", min_workers=1, max_workers=2)
    client.request("train")
    capsys.readouterr()

    def events(*argv: str) -> list[dict]:
        assert run(["pool", "events", "--json", *argv]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    everything = events()
    assert [e["id"] for e in events("--last", "2")] == [e["id"] for e in everything[-2:]]
    assert {e["kind"] for e in events("--kind", "host")} == {"host"}
    assert {e["kind"] for e in events("--kind", "grant,submit")} == {"grant", "submit"}
    assert len(events("--kind", "host", "--last", "1")) == 1
    assert events("--since", "1h") == everything and events("--since", "2999-01-01T00:00") == []
    assert events("--since", "2000-01-01T00:00+02:00") == everything

    assert run(["pool", "events", "--kind", "grnt"]) == 2
    assert "invalid --kind='grnt': an event kind, one of submit" in capsys.readouterr().err
    assert run(["pool", "events", "--since", "yesterday"]) == 2
    err = capsys.readouterr().err
    assert "invalid --since='yesterday': a duration back from now (90s, 30m, 2h, 1d)" in err
    assert run(["pool", "events", "--last", "0"]) == 2
    assert "invalid --last=0" in capsys.readouterr().err


def test_events_follow_prints_new_events_until_ctrl_c(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "add-host", "h0", "2", "-q"]) == 0
    capsys.readouterr()
    polls: list[float] = []

    def poll(seconds: float) -> None:  # the first wait: a host arrives; the second: Ctrl-C
        polls.append(seconds)
        if len(polls) == 1:
            PoolClient(sqlite_url).add_host("h1", 2)
        else:
            raise KeyboardInterrupt

    monkeypatch.setattr("time.sleep", poll)
    assert run(["pool", "events", "--follow", "--kind", "host"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "h0" in lines[0] and "h1" in lines[1] and "added: 2 slots" in lines[1]


def test_tenant_commands(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "add-host", "gpu-0", "8"]) == 0
    assert run(["pool", "add-tenant", "vision", "--guaranteed", "4", "--max", "6"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "tenant vision: added guaranteed 4, max 6, weight 1 (in use 0, borrowed 0, lent 0)")
    client = PoolClient(sqlite_url)
    client.submit("v", min_workers=1, max_workers=6, tenant="vision")
    client.request("v")
    assert run(["pool", "status"]) == 0
    out = capsys.readouterr().out
    assert "TENANT  GUARANTEED  MAX  WEIGHT  IN USE  BORROWED  LENT  JOBS" in out
    assert "vision  4           6    1       6       2         0     1" in out
    assert run(["pool", "usage"]) == 0
    assert "TENANT  GUARANTEED  USED  BORROWED  LENT" in capsys.readouterr().out
    assert run(["pool", "add-tenant", "vision", "--guaranteed", "8", "--max", "6"]) == 2
    assert "invalid --max=6: must be an integer between 8" in capsys.readouterr().err
    client.finish("v")
    assert run(["pool", "remove-tenant", "vision"]) == 0
    assert capsys.readouterr().out.strip() == "tenant vision: removed"
