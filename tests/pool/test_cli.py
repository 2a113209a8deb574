"""`elastic-ops pool …` against a real ledger file."""

from __future__ import annotations

import json

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
    assert "known policies" in capsys.readouterr().err


def test_prune_events_command(sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_POOL_URL", sqlite_url)
    assert run(["pool", "add-host", "gpu-0", "8"]) == 0
    capsys.readouterr()
    assert run(["pool", "prune-events", "--older-than-days", "1"]) == 0
    assert capsys.readouterr().out.strip() == "deleted 0 events older than 1 days"
    assert run(["pool", "prune-events", "--older-than-days", "0"]) == 2
    assert "--older-than-days=0.0: must be a positive, finite number of days" in capsys.readouterr().err
    assert run(["pool", "prune-events", "--older-than-days", "inf"]) == 2
    assert "--older-than-days=inf: must be a positive, finite number of days" in capsys.readouterr().err
