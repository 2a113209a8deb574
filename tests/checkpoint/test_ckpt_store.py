"""Store behaviour users rely on, on both backends (local directory and a real S3 endpoint)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import multiprocessing as mp
import threading

import pytest
import torch

from elastic_ops.checkpoint import Checksum, encode_state, restore_rng
from elastic_ops.checkpoint import store as store_module
from elastic_ops.errors import (
    CheckpointCorruptError,
    CommitConflictError,
    StaleEpochError,
    UnsafeCheckpointError,
)
from tests.checkpoint.builders import (
    StoreTarget,
    child_open,
    make_model,
    make_state,
    small_state,
    train_steps,
)


def test_resume_from_checkpoint_continues_training_identically(target: StoreTarget) -> None:
    model, opt, sched = make_model(seed=1)
    train_steps(model, opt, sched, 3)
    store = target.open()
    ref = store.save(3, make_state(model, opt, sched), epoch=1, spec_hash="h", metrics={"loss": 0.25})
    train_steps(model, opt, sched, 4)  # the uninterrupted run

    resumed, ropt, rsched = make_model(seed=99)  # different init: everything must come from the checkpoint
    state = target.open().load(target.open().latest(spec_hash="h"))
    resumed.load_state_dict(state["model"])
    ropt.load_state_dict(state["optimizer"])
    rsched.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    train_steps(resumed, ropt, rsched, 4)

    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert state["cursor"] == {"epoch": 0, "offset": 12}
    assert (ref.iteration, ref.epoch, ref.spec_hash, ref.metrics) == (3, 1, "h", {"loss": 0.25})


def test_save_interrupted_before_manifest_is_invisible(target: StoreTarget) -> None:
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")

    class Crash(Exception):
        pass

    def crash_on_commit(key: str, data: bytes) -> bool:
        raise Crash("process died before the manifest was written")

    store.backend.put_if_absent = crash_on_commit  # the data upload happens, the commit does not
    with pytest.raises(Crash):
        store.save(20, small_state(2), epoch=1, spec_hash="h")
    assert any(k.startswith("it-00000020/d-") for k in target.keys()), "the data was written"

    fresh = target.open()
    assert [r.iteration for r in fresh.list()] == [10]
    assert fresh.latest().iteration == 10
    assert fresh.load(fresh.latest())["step"] == 1
    # the orphan does not block a later save of that iteration
    assert fresh.save(20, small_state(2), epoch=1, spec_hash="h").iteration == 20
    assert fresh.load(fresh.latest())["step"] == 2


def _flip_byte(target: StoreTarget, key: str) -> None:
    data = bytearray(target.read(key))
    data[len(data) // 2] ^= 0xFF
    target.write(key, bytes(data))


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_data", "garbage_manifest"])
def test_damaged_latest_falls_back_to_previous(target: StoreTarget, damage: str, caplog) -> None:
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    newest = store.save(20, small_state(2), epoch=1, spec_hash="h")
    data_key = f"it-00000020/{newest.files[0].name}"
    if damage == "flip_byte":
        _flip_byte(target, data_key)
    elif damage == "truncate":
        target.write(data_key, target.read(data_key)[:-10])
    elif damage == "delete_data":
        target.delete(data_key)
    else:
        target.write("it-00000020/manifest.json", b"{not json")

    from tests.recording_metrics import RecordingMetrics

    rec = RecordingMetrics()
    with caplog.at_level(logging.WARNING, logger="elastic_ops.checkpoint"):
        ref = target.open(metrics=rec).latest()
    assert ref.iteration == 10
    assert rec.sent == [("incr", "checkpoint.passed_over", 1, {"why": "damaged"})]
    assert target.open().load(ref)["step"] == 1
    assert any("it-00000020" in r.getMessage() for r in caplog.records), "the warning names the checkpoint"
    if damage == "flip_byte":
        with pytest.raises(CheckpointCorruptError, match="fails verification"):
            target.open().load(newest)


def test_checksum_is_verified_before_any_byte_is_decoded(target: StoreTarget, monkeypatch) -> None:
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    newest = store.save(20, small_state(2), epoch=1, spec_hash="h")
    _flip_byte(target, f"it-00000020/{newest.files[0].name}")
    decoded: list[int] = []

    def recording(real):  # noqa: ANN001, ANN202
        def decode(data, *, name: str) -> object:  # noqa: ANN001
            decoded.append(len(data))
            return real(data, name=name)

        return decode

    # a whole-file buffer (S3) or the records of a local state file (archive.py)
    monkeypatch.setattr(store_module, "decode_state", recording(store_module.decode_state))
    monkeypatch.setattr(store_module, "decode_archive", recording(store_module.decode_archive))
    fresh = target.open()
    with pytest.raises(CheckpointCorruptError, match="fails verification: xxh3-128"):
        fresh.load(newest)
    assert decoded == [], "the damaged bytes never reached the unpickler"
    assert fresh.load(fresh.latest())["step"] == 1 and len(decoded) == 1


def test_sha256_checkpoints_are_written_on_request_and_read_by_default(target: StoreTarget) -> None:
    ref = target.open(checksum="sha256").save(10, small_state(1), epoch=1, spec_hash="h")
    data = target.read(f"it-00000010/{ref.files[0].name}")
    assert ref.files[0].algorithm is Checksum.SHA256
    assert ref.files[0].digest == hashlib.sha256(data).hexdigest()
    manifest = json.loads(target.read("it-00000010/manifest.json"))
    assert (manifest["format_version"], manifest["files"][0]["algorithm"]) == (2, "sha256")
    reader = target.open()  # default xxh3-128: verifies whatever the manifest names
    assert reader.load(reader.latest())["step"] == 1


def test_format_version_1_checkpoint_from_an_earlier_release_loads(target: StoreTarget) -> None:
    """A version-1 checkpoint (sha256 per file) is verified and loaded; damage to it is caught."""
    for iteration, step in ((10, 1), (20, 2)):
        data = encode_state(small_state(step))
        sha = hashlib.sha256(data).hexdigest()
        target.write(f"it-{iteration:08d}/d-old/state.pt", data)
        manifest = {
            "format": "elastic-ops-checkpoint", "format_version": 1, "iteration": iteration, "epoch": 1,
            "spec_hash": "h", "created": 1.0, "metrics": {},
            "files": [{"name": "d-old/state.pt", "sha256": sha, "size": len(data)}],
        }  # fmt: skip
        target.write(f"it-{iteration:08d}/manifest.json", json.dumps(manifest).encode())
    store = target.open()
    ref = store.latest(spec_hash="h")
    assert (ref.iteration, ref.files[0].algorithm) == (20, Checksum.SHA256)
    assert store.load(ref)["step"] == 2
    _flip_byte(target, "it-00000020/d-old/state.pt")
    assert target.open().latest().iteration == 10, "a damaged version-1 checkpoint is skipped"
    # a new save goes on from there in the current format
    new = target.open().save(30, small_state(3), epoch=1, spec_hash="h")
    assert new.files[0].algorithm is Checksum.XXH3_128
    assert target.open().load(target.open().latest())["step"] == 3


def test_stale_epoch_cannot_commit(target: StoreTarget) -> None:
    store = target.open()
    assert store.fence(5) == 5
    with pytest.raises(StaleEpochError) as err:
        store.save(10, small_state(1), epoch=4, spec_hash="h")
    assert (err.value.epoch, err.value.current) == (4, 5)
    assert target.open().latest() is None
    assert not any(k.startswith("it-") for k in target.keys()), "a zombie uploads nothing"

    store.save(10, small_state(1), epoch=7, spec_hash="h")  # a newer lease raises the fence
    assert target.open().current_epoch() == 7
    assert target.open().fence(6) == 7, "the fence never goes down"
    with pytest.raises(StaleEpochError):
        target.open().save(20, small_state(2), epoch=6, spec_hash="h")
    assert [r.iteration for r in target.open().list()] == [10]


def test_same_iteration_twice_conflicts_unless_identical(target: StoreTarget) -> None:
    store = target.open()
    first = store.save(10, small_state(1), epoch=1, spec_hash="h")
    again = target.open().save(10, small_state(1), epoch=2, spec_hash="h")  # idempotent retry
    assert again.files == first.files
    with pytest.raises(CommitConflictError, match="iteration 10 is already committed"):
        target.open().save(10, small_state(5), epoch=2, spec_hash="h")
    assert target.open().load(target.open().latest())["step"] == 1


def test_spec_hash_mismatch_is_skipped(target: StoreTarget) -> None:
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="job-a")
    store.save(20, small_state(2), epoch=1, spec_hash="job-b")
    assert store.latest(spec_hash="job-a").iteration == 10
    assert store.latest(spec_hash="job-b").iteration == 20
    assert store.latest(spec_hash="job-c") is None
    assert store.latest().iteration == 20


@pytest.mark.parametrize(("keep_last", "keep_every"), [(2, None), (1, 30), (3, 20)])
def test_retention_keeps_last_k_and_every_mth(target: StoreTarget, keep_last: int, keep_every) -> None:
    store = target.open(keep_last=keep_last, keep_every=keep_every)
    saved = []
    for it in range(10, 71, 10):
        store.save(it, small_state(it), epoch=1, spec_hash="h")
        store.wait()  # retention runs on the store's background thread
        saved.append(it)
        expected = set(saved[-keep_last:]) | {i for i in saved if keep_every and i % keep_every == 0}
        assert [r.iteration for r in store.list()] == sorted(expected)
    # nothing of the removed checkpoints is left behind
    left = {k.split("/")[0] for k in target.keys() if k.startswith("it-")}
    assert left == {f"it-{i:08d}" for i in expected}


def _racer(uri: str, endpoint_url: str | None, barrier, iteration: int, value: float, out) -> None:
    store = child_open(uri, endpoint_url, keep_last=100)
    barrier.wait()
    try:
        store.save(iteration, small_state(value, n=4096), epoch=1, spec_hash="h")
        out.put((iteration, value, "won"))
    except CommitConflictError:
        out.put((iteration, value, "lost"))
    except Exception as exc:  # reported, so the test shows it
        out.put((iteration, value, repr(exc)))


def test_concurrent_commit_from_two_processes_exactly_one_wins(target: StoreTarget) -> None:
    # a save in the parent first: its hashing threads must not leave forked children hanging
    target.open(keep_last=100).save(1000, small_state(0), epoch=1, spec_hash="h")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    rounds = 4
    for it in range(rounds):
        barrier = ctx.Barrier(2)
        procs = [
            ctx.Process(target=_racer, args=(*target.child_args(), barrier, it, v, out)) for v in (1.0, 2.0)
        ]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
                assert p.exitcode == 0
        finally:  # no racer outlives a failed round
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    results = [out.get(timeout=10) for _ in range(2 * rounds)]
    store = target.open(keep_last=100)
    for it in range(rounds):
        outcome = {v: r for i, v, r in results if i == it}
        assert sorted(outcome.values()) == ["lost", "won"], outcome
        winner = next(v for v, r in outcome.items() if r == "won")
        ref = next(r for r in store.list() if r.iteration == it)
        assert store.load(ref)["step"] == int(winner), "the committed bytes are the winner's"
        # the loser cleaned up: only the winner's data remains under the iteration
        data_keys = [k for k in target.keys() if k.startswith(f"it-{it:08d}/d-")]
        assert data_keys == [f"it-{it:08d}/{ref.files[0].name}"]


def test_save_async_blocks_only_for_encoding_and_commits_a_snapshot(target: StoreTarget) -> None:
    store = target.open()
    state = small_state(1)
    future = store.save_async(10, state, epoch=2, spec_hash="h")
    state["w"].fill_(99.0)  # training goes on and changes the tensors right away
    assert future.result(timeout=60).iteration == 10
    store.close()
    assert target.open().load(target.open().latest())["w"].eq(1.0).all()

    stale = store.save_async(20, small_state(2), epoch=1, spec_hash="h")
    with pytest.raises(StaleEpochError):
        stale.result(timeout=60)
    store.close()
    assert [r.iteration for r in target.open().list()] == [10]


def test_local_writes_start_writeback_early_and_write_every_byte(tmp_path, monkeypatch) -> None:
    """Every 4 MiB the kernel is asked to start writeback of what came since, in whole 64 KiB
    blocks (never the page still being written); a hint that fails (returns -1, as on a file
    system without it) changes nothing: the fsync makes the file durable."""
    from elastic_ops.checkpoint import local

    calls: list[tuple[int, int, int]] = []

    def failing_hint(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((offset, length, flags))
        return -1

    monkeypatch.setattr(local, "_SYNC_FILE_RANGE", failing_hint)
    backend = local.LocalBackend(tmp_path)
    data = bytes(range(256)) * (10 * 4096 + 7)  # ~10 MiB, not a multiple of a piece
    backend.put("a/blob", data)
    assert backend.get("a/blob") == data
    assert [c[0] for c in calls] == [0, 4 << 20] and all(c[1:] == (4 << 20, 2) for c in calls)

    calls.clear()
    assert backend.put_stream("b/blob", lambda f: f.write(data)) == len(data)  # one big write
    assert backend.get("b/blob") == data and calls == [(0, len(data) & ~0xFFFF, 2)]
    assert len(data) % (64 << 10) != 0, "the last, partial block is left to the fsync"


def test_local_reads_hash_each_chunk_as_it_arrives_and_decode_that_buffer(tmp_path) -> None:
    from elastic_ops.checkpoint import decode_state, local

    backend = local.LocalBackend(tmp_path)
    state = {"w": torch.arange(700_000, dtype=torch.float32), "step": 3}  # ~2.8 MB: several chunks
    data = encode_state(state)
    backend.put("it-00000001/d-x/state.pt", data)
    hasher = Checksum.XXH3_128.hasher()
    view = backend.read_hashing("it-00000001/d-x/state.pt", hasher)
    assert bytes(view) == data and hasher.hexdigest() == Checksum.XXH3_128.hexdigest(data)
    back = decode_state(view)  # the verified buffer itself, not bytes
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
    assert backend.read_hashing("it-00000001/d-x/missing.pt", Checksum.SHA256.hasher()) is None


def test_export_hands_over_the_committed_state_as_a_file_torch_load_reads(target: StoreTarget, tmp_path):
    model, opt, sched = make_model()
    train_steps(model, opt, sched, 2)
    state = make_state(model, opt, sched)
    store = target.open()
    ref = store.save(10, state, epoch=1, spec_hash="h")
    out = tmp_path / "work" / "restore.pt"
    out.parent.mkdir()
    store.export(store.latest(spec_hash="h"), out)
    back = torch.load(out, weights_only=True)
    assert torch.equal(back["model"]["0.weight"], state["model"]["0.weight"])
    assert back["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()
    assert store._loaded is None, "the state latest() kept is not held on to"
    assert out.read_bytes() == target.read(f"it-00000010/{ref.files[0].name}"), "the committed bytes"
    if target.kind == "file":
        committed = target.root / f"it-00000010/{ref.files[0].name}"
        assert out.stat().st_ino == committed.stat().st_ino, "a hard link on one file system"


def test_latest_into_places_the_newest_verified_state_without_decoding_it(target, tmp_path, monkeypatch):
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    newest = store.save(20, small_state(2), epoch=1, spec_hash="h")
    out = tmp_path / "restore.pt"
    decoded: list[str] = []

    def recording(name: str):  # noqa: ANN202
        real = getattr(store_module, name)
        return lambda data, *, name: decoded.append(name) or real(data, name=name)

    for decoder in ("decode_state", "decode_archive"):
        monkeypatch.setattr(store_module, decoder, recording(decoder))
    fresh = target.open()
    assert fresh.latest(spec_hash="h", into=out) == newest
    assert torch.load(out, weights_only=True)["step"] == 2 and decoded == [] and fresh._loaded is None
    _flip_byte(target, f"it-00000020/{newest.files[0].name}")  # damaged: the previous one is placed
    assert target.open().latest(spec_hash="h", into=out).iteration == 10
    assert torch.load(out, weights_only=True)["step"] == 1 and decoded == []


def test_export_copies_across_file_systems_and_refuses_damage(tmp_path, monkeypatch) -> None:
    from elastic_ops.checkpoint import local

    store = StoreTarget("file", f"file://{tmp_path}/ckpt", root=tmp_path / "ckpt").open()
    ref = store.save(10, small_state(3), epoch=1, spec_hash="h")
    committed = tmp_path / f"ckpt/it-00000010/{ref.files[0].name}"

    def no_links(src, dst):  # noqa: ANN001, ANN202  # as across file systems
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(local.os, "link", no_links)
    store.export(ref, tmp_path / "copy.pt")
    assert (tmp_path / "copy.pt").read_bytes() == committed.read_bytes()
    assert (tmp_path / "copy.pt").stat().st_ino != committed.stat().st_ino

    monkeypatch.undo()
    data = bytearray(committed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    committed.write_bytes(bytes(data))
    for attempt in ("link", "copy"):
        if attempt == "copy":
            monkeypatch.setattr(local.os, "link", no_links)
        with pytest.raises(CheckpointCorruptError, match="fails verification"):
            store.export(ref, tmp_path / f"damaged-{attempt}.pt")
        assert not (tmp_path / f"damaged-{attempt}.pt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == [], "nothing left behind"
    committed.unlink()
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        store.export(ref, tmp_path / "missing.pt")


def test_latest_without_decoding_names_the_same_checkpoint_and_keeps_nothing(target, monkeypatch):
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    newest = store.save(20, small_state(2), epoch=1, spec_hash="h")
    decoded: list[str] = []
    for decoder in ("decode_state", "decode_archive"):
        monkeypatch.setattr(store_module, decoder, lambda data, *, name: decoded.append(name))
    fresh = target.open()
    assert fresh.latest(spec_hash="h", decode=False) == newest and fresh._loaded is None
    _flip_byte(target, f"it-00000020/{newest.files[0].name}")  # damaged: the previous one, as latest()
    assert target.open().latest(spec_hash="h", decode=False).iteration == 10
    assert target.open().latest(spec_hash="other", decode=False) is None
    assert decoded == []


def test_latest_from_a_local_store_lists_only_the_checkpoints_it_reads(tmp_path, monkeypatch) -> None:
    """``keep_every`` can keep hundreds of checkpoints: finding the newest must not walk them all."""
    local = StoreTarget("file", f"file://{tmp_path}/s", root=tmp_path / "s")
    store = local.open(keep_last=40)
    for i in range(1, 41):
        store.save(i, small_state(i), epoch=1, spec_hash="h")
    store.wait()
    in_flight = tmp_path / "s" / "it-00000041" / "d-0" / "state.pt"  # data written, no manifest yet
    in_flight.parent.mkdir(parents=True)
    in_flight.write_bytes(b"partial")
    gone = "it-00000099"  # removed by another process's retention between the two listings
    listed: list[str] = []
    list_dirs, list_objects = store.backend.list_dirs, store.backend.list
    monkeypatch.setattr(store.backend, "list_dirs", lambda: [*list_dirs(), gone])
    monkeypatch.setattr(
        store.backend, "list", lambda prefix="": listed.append(prefix) or list_objects(prefix)
    )

    ref = store.latest(spec_hash="h")
    assert ref.iteration == 40 and store.load(ref)["step"] == 40
    assert listed == [f"{gone}/", "it-00000041/", "it-00000040/"]
    listed.clear()
    _flip_byte(local, f"it-00000040/{ref.files[0].name}")
    assert store.latest(spec_hash="h", decode=False).iteration == 39  # damaged: the one before
    assert listed[-2:] == ["it-00000040/", "it-00000039/"]
    assert [r.iteration for r in store.list()] == list(range(1, 41))  # list() still sees them all


def test_local_save_lists_only_the_fence_markers_before_it_returns(tmp_path, monkeypatch) -> None:
    """What a save waits for must not grow with the checkpoints kept: it lists the fence
    markers; retention lists the whole store on the store's background thread."""
    local = StoreTarget("file", f"file://{tmp_path}/s", root=tmp_path / "s")
    store = local.open(keep_last=3)
    for i in range(1, 6):
        store.save(i, small_state(i), epoch=1, spec_hash="h")
    store.wait()
    caller, listed = threading.get_ident(), []
    list_objects = store.backend.list
    monkeypatch.setattr(
        store.backend,
        "list",
        lambda prefix="": listed.append((threading.get_ident() == caller, prefix)) or list_objects(prefix),
    )
    store.save(6, small_state(6), epoch=1, spec_hash="h")
    store.wait()
    assert [prefix for on_caller, prefix in listed if on_caller] == ["_fence/"]
    assert [prefix for on_caller, prefix in listed if not on_caller] == ["it-"]
    assert [r.iteration for r in store.list()] == [4, 5, 6]


def test_save_file_commits_a_staged_state_as_it_is(target: StoreTarget, tmp_path, monkeypatch) -> None:
    from elastic_ops.runtime.state import save_atomic

    model, opt, sched = make_model()
    train_steps(model, opt, sched, 2)
    state = make_state(model, opt, sched)
    staged = tmp_path / "ckpt-10.pt"
    save_atomic(state, staged)  # as the training workers stage it
    assert staged.read_bytes() == encode_state(state), "the bytes save() would write"
    store = target.open()
    ref = store.save_file(10, staged, epoch=1, spec_hash="h", metrics={"loss": 0.5})
    assert target.read(f"it-00000010/{ref.files[0].name}") == staged.read_bytes()
    assert ref.metrics == {"loss": 0.5}
    fresh = target.open()
    assert torch.equal(fresh.load(fresh.latest())["model"]["0.weight"], state["model"]["0.weight"])
    if target.kind == "file":
        committed = target.root / f"it-00000010/{ref.files[0].name}"
        assert committed.stat().st_ino == staged.stat().st_ino, "a hard link on one file system"
    # an identical retry through either method is the same checkpoint; other content conflicts
    assert target.open().save(10, state, epoch=1, spec_hash="h", metrics={"loss": 0.5}) == ref
    assert target.open().save_file(10, staged, epoch=1, spec_hash="h", metrics={"loss": 0.5}) == ref
    save_atomic(small_state(9), staged)
    with pytest.raises(CommitConflictError):
        target.open().save_file(10, staged, epoch=1, spec_hash="h", metrics={"loss": 0.5})


def test_save_file_refuses_what_the_safe_loader_refuses_and_stale_writers(target: StoreTarget, tmp_path):
    class Exploit:
        def __reduce__(self):  # noqa: ANN204
            return (open, (str(tmp_path / "pwned"), "w"))

    evil = tmp_path / "evil.pt"
    torch.save({"model": Exploit()}, evil)
    store = target.open()
    with pytest.raises(UnsafeCheckpointError):
        store.save_file(10, evil, epoch=1, spec_hash="h")
    assert target.keys() == [] and not (tmp_path / "pwned").exists(), "nothing written, nothing run"
    store.fence(5)
    staged = tmp_path / "ok.pt"
    torch.save(small_state(1), staged)
    with pytest.raises(StaleEpochError):
        store.save_file(10, staged, epoch=4, spec_hash="h")
    assert [k for k in target.keys() if k.startswith("it-")] == [], "a zombie leaves nothing"


def test_a_crafted_newest_checkpoint_is_passed_over_loudly(
    target: StoreTarget, tmp_path, monkeypatch, caplog
):
    """Valid checksums, content the safe loader refuses (someone with write access to the store
    crafted it): it blocked every resume (an audit). latest() falls back past it, says so, and
    the job may commit that iteration again."""
    from elastic_ops.checkpoint import store as store_module

    class Exploit:
        def __reduce__(self):  # noqa: ANN204
            return (open, (str(tmp_path / "pwned"), "w"))

    store = target.open()
    good = store.save(10, small_state(1), epoch=1, spec_hash="h")
    evil = tmp_path / "evil.pt"
    torch.save({"model": Exploit()}, evil)
    with monkeypatch.context() as m:  # a writer that does not check what it commits
        m.setattr(store_module, "check_decodable", lambda *a, **k: None)
        target.open().save_file(20, evil, epoch=1, spec_hash="h")
    for read in (lambda s: s.latest(), lambda s: s.latest(spec_hash="h", into=tmp_path / "restore.pt")):
        fresh = target.open()
        with caplog.at_level("ERROR"):
            assert read(fresh) == good
        assert [r.iteration for r in fresh.refused] == [20]
        assert "refusing checkpoint" in caplog.text and "it-00000020" in caplog.text
        caplog.clear()
    assert torch.equal(fresh.load(fresh.latest())["w"], small_state(1)["w"])
    again = fresh.save(20, small_state(2), epoch=2, spec_hash="h")  # the retrained iteration commits
    assert target.open().latest() == again
    assert not (tmp_path / "pwned").exists(), "nothing ran"


def test_save_file_copies_across_file_systems(tmp_path, monkeypatch) -> None:
    from elastic_ops.checkpoint import local

    staged, real_link = tmp_path / "staged.pt", local.os.link

    def no_links_from_staging(src, dst):  # noqa: ANN001, ANN202  # as if on another file system
        if str(src) == str(staged):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(src, dst)  # the store's own links (manifest, fence) as usual

    monkeypatch.setattr(local.os, "link", no_links_from_staging)
    store = StoreTarget("file", f"file://{tmp_path}/ckpt", root=tmp_path / "ckpt").open()
    staged.write_bytes(encode_state(small_state(4)))
    ref = store.save_file(10, staged, epoch=1, spec_hash="h")
    committed = tmp_path / f"ckpt/it-00000010/{ref.files[0].name}"
    assert committed.read_bytes() == staged.read_bytes()
    assert committed.stat().st_ino != staged.stat().st_ino
    assert store.load(store.latest())["step"] == 4


@pytest.mark.parametrize("content", ["identical", "different"])
def test_a_damaged_checkpoint_is_replaced_when_its_iteration_is_committed_again(target, content) -> None:
    """latest() skips a damaged checkpoint and the job retrains its iteration; the new commit
    must replace it (identical bytes in bitwise mode, different ones in fast mode)."""
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    damaged = store.save(20, small_state(2), epoch=1, spec_hash="h")
    _flip_byte(target, f"it-00000020/{damaged.files[0].name}")
    assert target.open().latest().iteration == 10
    value = 2 if content == "identical" else 3
    ref = store.save(20, small_state(value), epoch=2, spec_hash="h")
    latest = target.open().latest()
    assert latest.iteration == 20 and latest.files == ref.files
    assert target.open().load(latest)["step"] == value
    data = [k for k in target.keys() if k.startswith("it-00000020/d-")]
    assert data == [f"it-00000020/{ref.files[0].name}"]


def test_of_two_writers_replacing_one_damaged_checkpoint_exactly_one_commits(target) -> None:
    """Writers a and b both find iteration 20 damaged. b replaces it and commits while a is
    still verifying the damaged one: a must not remove b's manifest (it was removing whatever
    stood there, so both were told they committed and b's checkpoint was orphaned)."""
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    damaged = store.save(20, small_state(2), epoch=1, spec_hash="h")
    _flip_byte(target, f"it-00000020/{damaged.files[0].name}")
    a, b = target.open(), target.open()
    real_delete_if, won = a.backend.delete_if, []

    def b_commits_first(key: str, data: bytes) -> bool:  # b gets in between a's check and delete
        if not won:
            won.append(b.save(20, small_state(5), epoch=2, spec_hash="h"))
        return real_delete_if(key, data)

    a.backend.delete_if = b_commits_first
    with pytest.raises(CommitConflictError):
        a.save(20, small_state(6), epoch=2, spec_hash="h")
    latest = target.open().latest()
    assert latest.iteration == 20 and latest.files == won[0].files
    assert target.open().load(latest)["step"] == 5
    data = [k for k in target.keys() if k.startswith("it-00000020/d-")]
    assert data == [f"it-00000020/{won[0].files[0].name}"]  # a's data removed, b's kept


@contextlib.contextmanager
def save_held_before_its_manifest(target: StoreTarget, writer, iteration: int):
    """``writer`` saves ``iteration`` in a thread, held after its data and before its manifest
    for the ``with`` block (another writer's retention then sees data without a manifest)."""
    release = threading.Event()
    real_put = writer.backend.put_if_absent

    def manifest_later(key: str, data: bytes) -> bool:
        if key.endswith(f"it-{iteration:08d}/manifest.json"):
            release.wait(60)
        return real_put(key, data)

    writer.backend.put_if_absent = manifest_later
    saving = threading.Thread(target=lambda: writer.save(iteration, small_state(iteration), epoch=1,
                                                         spec_hash="h"))
    saving.start()
    try:
        for _ in range(1200):  # up to 60 s on a loaded machine
            if any(k.startswith(f"it-{iteration:08d}/d-") for k in target.keys()):
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError(f"the writer never wrote the data of {iteration}: the race was not set up")
        yield
    finally:
        release.set()
        saving.join(60)


def test_retention_never_removes_the_data_of_a_save_still_in_flight(target: StoreTarget) -> None:
    """Writer a's save of 30 has written its data, not yet its manifest, when writer b commits
    40 and plans retention from a listing that shows 30 as data without a manifest."""
    a, b = target.open(keep_last=3), target.open(keep_last=3)
    b.save(20, small_state(2), epoch=1, spec_hash="h")
    with save_held_before_its_manifest(target, a, 30):
        b.save(40, small_state(4), epoch=1, spec_hash="h")
        b.wait()  # b's retention has run
    store = target.open(keep_last=3)
    assert [r.iteration for r in store.list()] == [20, 30, 40]
    assert store.load(next(r for r in store.list() if r.iteration == 30))["step"] == 30


def test_a_reader_whose_checkpoint_retention_removed_finds_the_newer_one(tmp_path, monkeypatch) -> None:
    """keep_last=1: another writer commits 20 (and removes 10) while this reader reads 10."""
    from elastic_ops.checkpoint import open_store

    writer = open_store(f"file://{tmp_path}", keep_last=1)
    writer.save(10, small_state(1), epoch=1, spec_hash="h")
    writer.wait()
    reader = open_store(f"file://{tmp_path}", keep_last=1)
    real = store_module.CheckpointStore._read_manifest
    raced = []

    def racing(self, iteration, sizes, *, quiet):
        m = real(self, iteration, sizes, quiet=quiet)
        if self is reader and iteration == 10 and not raced:
            raced.append(True)
            writer.save(20, small_state(2), epoch=1, spec_hash="h")
            writer.wait()  # 10 is gone now
        return m

    monkeypatch.setattr(store_module.CheckpointStore, "_read_manifest", racing)
    ref = reader.latest(spec_hash="h")
    assert raced and ref is not None and ref.iteration == 20 and reader.load(ref)["step"] == 2


def test_retention_leaves_a_young_save_below_the_kept_window_alone(target: StoreTarget) -> None:
    """Writer a's save of 5 (kept: keep_every=5) has its data written when writer b commits 30
    and 40 with keep_last=2: 5 lies below the window, has no manifest yet, and retention's
    check-then-delete removed its data just before a committed; a's save() returned a checkpoint
    that could not be loaded (a probe). Data newer than ORPHAN_AGE_S is never an orphan."""
    a, b = target.open(keep_last=2, keep_every=5), target.open(keep_last=2, keep_every=5)
    with save_held_before_its_manifest(target, a, 5):
        for it in (30, 40):
            b.save(it, small_state(it), epoch=1, spec_hash="h")
            b.wait()  # b's retention has run
    store = target.open(keep_last=2, keep_every=5)
    assert [r.iteration for r in store.list()] == [5, 30, 40]
    assert store.load(next(r for r in store.list() if r.iteration == 5))["step"] == 5


def commit_20_and_30(root):
    """A local store keeping 1 checkpoint, after committing 20 then 30 (two retention passes)."""
    from elastic_ops.checkpoint import open_store

    store = open_store(f"file://{root}", keep_last=1)
    for it in (20, 30):
        store.save(it, small_state(it), epoch=1, spec_hash="h")
        store.wait()
    return store


def test_retention_removes_data_a_killed_writer_left_once_it_is_old(tmp_path) -> None:
    """Data without a manifest (a writer killed between its data and its manifest) goes once it
    is ORPHAN_AGE_S older than the store's newest object."""
    import os
    import time

    from elastic_ops.checkpoint.store import ORPHAN_AGE_S

    old = tmp_path / "it-00000010" / "d-killed" / "state.pt"
    young = tmp_path / "it-00000012" / "d-killed" / "state.pt"
    for path in (old, young):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x" * 100)
    long_ago = time.time() - ORPHAN_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    store = commit_20_and_30(tmp_path)
    assert not (tmp_path / "it-00000010").exists()
    assert young.exists()  # may be a save in flight
    assert [r.iteration for r in store.list()] == [30]


def test_a_directory_another_writer_prunes_meanwhile_is_made_again(tmp_path, monkeypatch) -> None:
    """A stale writer cleaning up removed the empty it-… directory between a live writer's check
    and its mkdir of d-… inside: the live save failed, not retryable (a probe: 24 of 3000)."""
    from pathlib import Path

    from elastic_ops.checkpoint import local, open_store

    real_mkdir, raced = Path.mkdir, []

    def racing_mkdir(self, *args, **kwargs):
        if self.name.startswith("d-") and not raced:
            raced.append(self)
            self.parent.rmdir()  # pruned, empty, by the other writer
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(local.Path, "mkdir", racing_mkdir)
    store = open_store(f"file://{tmp_path}")
    store.save(7, small_state(7), epoch=1, spec_hash="h")
    assert raced and store.load(store.latest())["step"] == 7


def test_retention_removes_what_a_killed_local_writer_left(tmp_path) -> None:
    """A save killed mid-write leaves a hidden temporary file that listings never show."""
    import os
    import time


    old = tmp_path / "it-00000010" / "d-killed" / ".tmp-0123"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"x" * 1000)
    fresh = tmp_path / "it-00000015" / "d-writing" / ".tmp-4567"  # may be a save in flight
    fresh.parent.mkdir(parents=True)
    fresh.write_bytes(b"y")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    store = commit_20_and_30(tmp_path)
    assert not (tmp_path / "it-00000010").exists()
    assert fresh.exists()
    assert [r.iteration for r in store.list()] == [30]


def test_a_new_local_checkpoint_directory_is_made_durable(tmp_path, monkeypatch) -> None:
    """The directory entries of a new it-…/d-… are fsync'd too, not only the files in them."""
    from elastic_ops.checkpoint import local, open_store

    synced = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda path: synced.append(path) or real(path))
    open_store(f"file://{tmp_path}").save(10, small_state(1), epoch=1, spec_hash="h")
    assert tmp_path in synced and tmp_path / "it-00000010" in synced


@pytest.mark.parametrize("plant", ["manifest -> /dev/zero", "state -> a FIFO", "state -> a file outside"])
def test_links_and_fifos_planted_in_a_local_store_are_no_checkpoint(tmp_path, plant) -> None:
    """Reading through them hung (a FIFO), ran out of memory (/dev/zero) or loaded a file from
    outside the store; they are now invisible, and latest() falls back past them."""
    import os

    from elastic_ops.checkpoint import open_store

    root = tmp_path / "store"
    store = open_store(f"file://{root}")
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    store.save(20, small_state(2), epoch=1, spec_hash="h")
    it20 = root / "it-00000020"
    [state] = it20.rglob("state.pt")
    manifest = json.loads((it20 / "manifest.json").read_text())
    if plant.startswith("manifest"):
        (it20 / "manifest.json").unlink()
        (it20 / "manifest.json").symlink_to("/dev/zero")
    else:
        outside = tmp_path / "outside.pt"
        if plant.endswith("FIFO"):
            os.mkfifo(outside)
            data = b""
        else:
            data = state.read_bytes()  # the same bytes: only where they lie differs
            outside.write_bytes(data)
        state.unlink()
        state.symlink_to(outside)
        for f in manifest["files"]:
            f["size"] = len(data)
            f["digest"] = Checksum(f["algorithm"]).hexdigest(data)
        (it20 / "manifest.json").write_text(json.dumps(manifest))
    done: list = []
    reader = threading.Thread(target=lambda: done.append(open_store(f"file://{root}").latest()), daemon=True)
    reader.start()
    reader.join(60)
    assert done, "latest() hung on what was planted"
    assert done[0].iteration == 10


def test_loading_what_latest_found_in_an_empty_store_says_so(tmp_path) -> None:
    """``store.load(store.latest())`` on an empty store was an AttributeError on ``None``."""
    from elastic_ops.checkpoint import open_store
    from elastic_ops.errors import CheckpointNotFoundError

    store = open_store(f"file://{tmp_path}/empty")
    with pytest.raises(CheckpointNotFoundError, match=r"not None: no committed checkpoint under file://"):
        store.load(store.latest())
    with pytest.raises(CheckpointNotFoundError, match=r"needs a CheckpointRef .*not 'it-3'"):
        store.load("it-3")


@pytest.mark.parametrize("link", ["to a directory outside", "to an older checkpoint's directory"])
def test_a_linked_iteration_directory_is_never_written_through(tmp_path, link) -> None:
    """A symbolic link planted as a checkpoint's directory was followed by save(): the commit
    landed outside the store (save() returned, latest() never saw it) or, linked to an older
    checkpoint's directory, the manifest met there was taken for damage and that checkpoint was
    replaced: both checkpoints were lost. The link is now refused before anything is written."""
    import os

    from elastic_ops.checkpoint import open_store
    from elastic_ops.errors import StoragePermanentError

    root = tmp_path / "store"
    store = open_store(f"file://{root}")
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside if link.endswith("outside") else "it-00000010", root / "it-00000020")
    before = sorted(p.relative_to(root) for p in (root / "it-00000010").rglob("*"))
    with pytest.raises(StoragePermanentError, match=r"it-00000020 is a symbolic link"):
        store.save(20, small_state(2), epoch=1, spec_hash="h")
    with pytest.raises(StoragePermanentError, match=r"it-00000020 is a symbolic link"):
        store.save_async(20, small_state(2), epoch=1, spec_hash="h").result()
    store.wait()
    assert list(outside.iterdir()) == []
    assert sorted(p.relative_to(root) for p in (root / "it-00000010").rglob("*")) == before
    ref = open_store(f"file://{root}").latest()
    assert ref is not None and ref.iteration == 10


def test_a_full_disk_mid_save_is_reported_as_such(tmp_path, monkeypatch) -> None:
    """ENOSPC while torch.save wrote the state came out as torch's own RuntimeError
    ("[enforce fail at inline_container.cc] unexpected pos ..."), which its zip writer raised
    while closing over the OSError: no "disk full", not a StoragePermanentError."""
    import errno

    from elastic_ops.checkpoint import local as local_module
    from elastic_ops.checkpoint import open_store
    from elastic_ops.errors import StoragePermanentError

    store = open_store(f"file://{tmp_path}")
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    write = local_module._EarlyWriteback.write

    def full(self, data):
        if self._written + len(data) > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, data)

    monkeypatch.setattr(local_module._EarlyWriteback, "write", full)
    with pytest.raises(StoragePermanentError, match=r"disk full writing .*/it-00000020/d-\w+/state\.pt"):
        store.save(20, {"w": torch.zeros(10_000)}, epoch=1, spec_hash="h")
    monkeypatch.undo()
    store.wait()
    assert [r.iteration for r in open_store(f"file://{tmp_path}").list()] == [10]
    assert open_store(f"file://{tmp_path}").latest().iteration == 10


def test_a_fence_raised_while_a_save_uploads_and_seen_before_its_commit_refuses_it(target) -> None:
    """A writer whose epoch was above the fence it listed raises the fence itself; that call
    lists again, and when it found a higher fence (a new owner fenced meanwhile) the save still
    committed, over the fence it had just seen."""
    old, new = target.open(), target.open()
    old.fence(2)
    markers = old._fence_markers
    raised: list[int] = []

    def then_the_new_owner_fences(objects=None):
        out = markers(objects)
        if not raised:
            raised.append(new.fence(4))
        return out

    old._fence_markers = then_the_new_owner_fences  # type: ignore[method-assign]
    with pytest.raises(StaleEpochError) as err:
        old.save(7, small_state(1), epoch=3, spec_hash="h")
    assert raised == [4] and (err.value.epoch, err.value.current) == (3, 4)
    old.wait()
    assert target.open().latest() is None
    assert not any(k.startswith("it-") for k in target.keys()), "a zombie leaves nothing"


@pytest.mark.parametrize("planted", ["link_to_dev_zero", "dangling_link", "fifo", "folder"])
def test_a_manifest_that_is_no_regular_file_does_not_block_recommitting(tmp_path, planted, caplog):
    """It was `CommitConflictError: ... its manifest kept changing under this writer` for good
    (an audit), against "a retrained iteration is never blocked by the broken copy"."""
    import os

    from elastic_ops.checkpoint import open_store

    store = open_store(f"file://{tmp_path}/ck")
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    where = tmp_path / "ck" / "it-00000020"
    where.mkdir()
    manifest = where / "manifest.json"
    if planted == "link_to_dev_zero":
        manifest.symlink_to("/dev/zero")
    elif planted == "dangling_link":
        manifest.symlink_to(tmp_path / "nowhere")
    elif planted == "fifo":
        os.mkfifo(manifest)
    else:
        (manifest / "inside").mkdir(parents=True)
    assert store.latest().iteration == 10, "what was planted is no checkpoint"
    with caplog.at_level("WARNING"):
        ref = store.save(20, small_state(2), epoch=1, spec_hash="h")
    assert "was no stored object" in caplog.text
    assert open_store(f"file://{tmp_path}/ck").latest() == ref
    assert manifest.is_file() and not manifest.is_symlink()
