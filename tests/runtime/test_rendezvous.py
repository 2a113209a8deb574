"""The segment's rendezvous against an outsider: someone who can connect to the runner's
``TCPStore`` (another local user: it listens on 127.0.0.1) but does not have the segment's key."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch.distributed as dist

from elastic_ops.runtime import rendezvous, run_chunk
from elastic_ops.runtime.launcher import LaunchRequest, loopback_store, worker_env
from elastic_ops.runtime.rendezvous import KEY_ENV, RendezvousForgeryError, SignedStore, new_key
from tests.runtime.builders import RecordingLauncher, make_spec


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_torch_lets_anyone_who_connects_list_and_read_every_key_so_a_prefix_hides_nothing():
    """Why the values are signed rather than hidden behind a secret key prefix (torch 2.13)."""
    server = loopback_store()
    dist.PrefixStore("a-secret-prefix", _client(server.port)).set("addr", "127.0.0.1:4242")
    outsider = _client(server.port)
    assert outsider.list_keys() == ["a-secret-prefix/addr"]
    assert outsider.get("a-secret-prefix/addr") == b"127.0.0.1:4242"


def test_an_outsider_without_the_key_cannot_forge_move_or_replay_a_rendezvous_value():
    server = loopback_store()
    key = new_key()
    rank0, rank1 = SignedStore(_client(server.port), key), SignedStore(_client(server.port), key)
    outsider = _client(server.port)
    rank0.set("rank0/addr", b"127.0.0.1:4242")
    rank0.multi_set(["rank0/a", "rank0/b"], [b"1", b"2"])
    assert rank1.get("rank0/addr") == b"127.0.0.1:4242"
    assert rank1.multi_get(["rank0/a", "rank0/b"]) == [b"1", b"2"]
    assert repr(rank1) == "SignedStore(***)"  # the key in no repr
    assert rank1.clone().get("rank0/addr") == b"127.0.0.1:4242"  # its own connection, same key

    # It can read (gloo's addresses: not secret; `ss -tln` lists the ports anyway) ...
    genuine = outsider.get("rank0/addr")
    assert genuine.endswith(b"127.0.0.1:4242")
    # ... but whatever it writes is refused by the ranks, naming the key, not followed
    outsider.set("rank0/addr", b"10.6.6.6:666")
    with pytest.raises(RendezvousForgeryError, match="'rank0/addr' is not signed by this segment's key"):
        rank1.get("rank0/addr")
    outsider.set("rank1/addr", genuine)  # a genuine value moved to another key
    with pytest.raises(RendezvousForgeryError, match="rank1/addr"):
        rank1.get("rank1/addr")
    outsider.set("rank0/b", b"")  # too short to carry a signature at all
    with pytest.raises(RendezvousForgeryError, match="rank0/b"):
        rank1.multi_get(["rank0/a", "rank0/b"])
    # a value signed for another segment (its key) is no good in this one
    SignedStore(_client(server.port), new_key()).set("rank0/addr", b"127.0.0.1:4242")
    with pytest.raises(RendezvousForgeryError):
        rank1.get("rank0/addr")


def test_the_key_reaches_the_ranks_through_their_environment_only(tmp_path, monkeypatch):
    key = new_key()
    req = LaunchRequest(workers=2, script=None, master_addr="127.0.0.1", master_port=1234, segment=0,
                        log_dir=tmp_path, env={}, rendezvous_key=key)
    assert key not in repr(req)
    assert worker_env(req, 1)[KEY_ENV] == key
    # a worker takes it out of its environment before user code runs, and keeps it
    monkeypatch.setattr(rendezvous, "_taken", None)
    monkeypatch.setenv(KEY_ENV, key)
    assert rendezvous.segment_key() == key
    assert KEY_ENV not in os.environ
    assert rendezvous.segment_key() == key
    monkeypatch.setattr(rendezvous, "_taken", None)
    with pytest.raises(RuntimeError, match="not started by the elastic_ops runner"):
        rendezvous.segment_key()


@pytest.mark.slow
def test_real_workers_sign_their_rendezvous_and_an_outsider_changes_nothing(tmp_path):
    """Two workers train while an outsider, connected to their segment's store, finds only signed
    values and overwrites every key: the group trains on, to the same model as without it."""
    gate = tmp_path / "gate"
    spec = make_spec(tmp_path, params={"hold_at": 3, "hold_file": str(gate)})
    reference = run_chunk(make_spec(tmp_path / "ref"), 0, 30, target=lambda i: 2).param_sha256
    launcher = RecordingLauncher()
    seen: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def outsider() -> None:
        try:
            while not launcher.requests:
                threading.Event().wait(0.01)
            req = launcher.requests[0]
            store = _client(req.master_port)
            # both ranks past their rendezvous (gloo reads its pairs' keys until it is done) and
            # training: each waits at the gate
            for _ in range(6000):
                if all(gate.with_name(f"gate.rank{r}").exists() for r in range(2)):
                    break
                threading.Event().wait(0.01)
            keys = store.list_keys()
            signed = SignedStore(store, req.rendezvous_key)
            for k in keys:
                seen[k] = signed.get(k)  # verifies: the workers signed it with the segment's key
                with pytest.raises(RendezvousForgeryError):
                    SignedStore(store, new_key()).get(k)
                store.set(k, b"forged")
        except BaseException as exc:  # the test's thread: reported below
            errors.append(exc)
        finally:
            gate.write_text("go")

    thread = threading.Thread(target=outsider)
    thread.start()
    result = run_chunk(spec, 0, 30, target=lambda i: 2, launcher=launcher)
    thread.join(timeout=60)
    assert errors == [] and len(seen) >= 2, (errors, seen)
    assert result.param_sha256 == reference
