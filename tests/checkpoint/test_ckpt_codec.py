"""The codec loads state without executing anything from the checkpoint."""

from __future__ import annotations

import io
import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from elastic_ops.checkpoint import (
    Checksum,
    InvalidStateError,
    capture_rng,
    decode_state,
    encode_state,
    restore_rng,
)
from elastic_ops.checkpoint.codec import encode_state_into
from elastic_ops.checkpoint.manifest import FileEntry, Manifest
from elastic_ops.errors import CheckpointCorruptError, UnsafeCheckpointError
from elastic_ops.runtime.state import load_state
from tests.checkpoint.builders import StoreTarget, make_model, make_state, small_state, train_steps


class _Exploit:
    """Unpickling this runs a shell command (classic pickle code execution)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _malicious_payloads(marker: Path) -> dict[str, bytes]:
    zipped = io.BytesIO()
    torch.save({"model": _Exploit(marker)}, zipped)  # a real torch zip file whose data.pkl calls os.system
    return {
        "torch_zip": zipped.getvalue(),
        "legacy_pickle": pickle.dumps({"model": _Exploit(marker)}, protocol=2),
        "builtins_exec": pickle.dumps(_ExecExploit(marker), protocol=2),
        "pickle_protocol_5": pickle.dumps({"model": _Exploit(marker)}, protocol=5),
    }


class _ExecExploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _plant(target: StoreTarget, evil: bytes) -> None:
    """Iteration 20 holding ``evil`` as its state, with a valid manifest and checksums."""
    entry = FileEntry.of("d-evil/state.pt", evil)
    target.write("it-00000020/d-evil/state.pt", evil)
    target.write(
        "it-00000020/manifest.json",
        Manifest(iteration=20, epoch=1, spec_hash="h", created=0.0, files=(entry,)).to_json(),
    )


PAYLOADS = ["torch_zip", "legacy_pickle", "builtins_exec", "pickle_protocol_5"]


class Exploit(NamedTuple):
    kind: str  # one of PAYLOADS
    data: bytes
    marker: Path  # the file the payload creates if it ever runs


@pytest.fixture(params=PAYLOADS)
def exploit(request: pytest.FixtureRequest, tmp_path: Path) -> Exploit:
    """Each crafted checkpoint in turn."""
    marker = tmp_path / "pwned"
    return Exploit(request.param, _malicious_payloads(marker)[request.param], marker)


def test_the_exploits_are_real(exploit: Exploit) -> None:
    """Guard against a vacuous test: an unrestricted load of each payload does run it."""
    if exploit.kind == "torch_zip":
        torch.load(io.BytesIO(exploit.data), weights_only=False)
    else:
        pickle.loads(exploit.data)
    assert exploit.marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_checkpoint_with_valid_manifest_is_rejected(target: StoreTarget, exploit: Exploit) -> None:
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    # an attacker with write access plants a checkpoint whose manifest and checksums are valid
    _plant(target, exploit.data)

    from tests.recording_metrics import RecordingMetrics

    rec = RecordingMetrics()
    store = target.open(metrics=rec)
    assert store.latest().iteration == 10, "checksums verify, but it cannot be loaded: passed over"
    assert [r.iteration for r in store.refused] == [20]
    assert rec.sent == [("incr", "checkpoint.passed_over", 1, {"why": "refused"})]  # loudly: a metric too
    planted = target.open().list()[-1]
    assert planted.iteration == 20
    with pytest.raises(UnsafeCheckpointError) as err:
        target.open().load(planted)
    assert err.value.retryable is False
    assert isinstance(err.value, CheckpointCorruptError)
    assert not exploit.marker.exists(), "the payload was never executed"


def test_truncated_file_is_corrupt_not_unsafe() -> None:
    with pytest.raises(CheckpointCorruptError) as err:
        decode_state(encode_state(small_state(1))[:-100])
    assert not isinstance(err.value, UnsafeCheckpointError)


def test_real_training_state_round_trips_exactly() -> None:
    model, opt, sched = make_model()
    train_steps(model, opt, sched, 2)
    state = make_state(model, opt, sched, history=[{"it": 1, "loss": 0.5}, {"it": 2, "loss": None}])
    back = decode_state(encode_state(state))
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # tuples, None, bools
    assert back["scheduler"] == state["scheduler"]
    assert back["history"] == state["history"]
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v)


@pytest.mark.parametrize(
    ("state", "path", "kind"),
    [
        ({"rng": {"np": np.zeros(3)}}, "['rng']['np']", "numpy.ndarray"),
        ({"layers": [1, 2, {1, 2}]}, "['layers'][2]", "builtins.set"),
        ({"fn": print}, "['fn']", "builtin_function_or_method"),
        ({"obj": object()}, "['obj']", "builtins.object"),
    ],
)
def test_state_the_safe_loader_would_refuse_is_rejected_at_save(state, path: str, kind: str) -> None:
    with pytest.raises(InvalidStateError) as err:
        encode_state(state)
    assert path in str(err.value) and kind in str(err.value)


def test_capture_and_restore_rng_replays_the_same_draws() -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = decode_state(encode_state({"rng": capture_rng()}))["rng"]

    def draw():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), np.random.normal(), random.random()

    first = draw()
    restore_rng(state)
    assert draw() == first


@pytest.mark.parametrize("algorithm", list(Checksum))
def test_streamed_encoding_writes_the_same_bytes_and_digest_as_encoding_in_memory(
    algorithm: Checksum,
) -> None:
    # a tensor of several write pieces plus small records: the digest covers every byte once, in order
    state = {"big": torch.arange(300_000, dtype=torch.float32), "small": small_state(2)}
    out = io.BytesIO()
    digest, size = encode_state_into(state, out, algorithm)
    assert out.getvalue() == encode_state(state)
    assert (digest, size) == (algorithm.hexdigest(out.getvalue()), len(out.getvalue()))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_malicious_checkpoint_placed_as_a_file_is_refused_and_removed(
    target: StoreTarget, tmp_path: Path, exploit: Exploit
) -> None:
    """latest(into=) and export() hand over the file without decoding it, but check its pickle:
    latest() passes over it (to an older checkpoint, here none), export() refuses it."""
    _plant(target, exploit.data)
    out = tmp_path / "restore.pt"
    store = target.open()
    assert store.latest(spec_hash="h", into=out) is None
    assert [r.iteration for r in store.refused] == [20] and not out.exists()
    with pytest.raises(UnsafeCheckpointError):
        store.export(store.list()[-1], out)
    assert not out.exists() and not exploit.marker.exists()


def _rezip(data: bytes, *, compress: int = zipfile.ZIP_STORED, twice: str | None = None) -> bytes:
    """``data`` (a torch.save archive) rewritten: its records compressed, or one given twice."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", compress) as dst:
        for zi in src.infolist():
            dst.writestr(zi.filename, src.read(zi.filename))
            if zi.filename.endswith(twice or "\0"):
                with pytest.warns(UserWarning, match="Duplicate name"):
                    dst.writestr(zi.filename, pickle.dumps({"which": "second"}, protocol=2))
    return out.getvalue()


@pytest.mark.parametrize("layout", ["deflated", "duplicate"])
def test_an_archive_unlike_torch_saves_is_refused_before_anything_is_inflated(
    target: StoreTarget, tmp_path: Path, layout: str
) -> None:
    """A DEFLATEd record of zeros: 8 MB of state in ~10 KB of file (a probe reached 1000x, 1 GB
    in memory); a record given twice: two readers decoding two states from one verified file."""
    plain = encode_state({"m": torch.zeros(2_000_000)})
    if layout == "deflated":
        evil = _rezip(plain, compress=zipfile.ZIP_DEFLATED)
    else:
        evil = _rezip(plain, twice="data.pkl")
    if layout == "deflated":
        assert len(evil) < len(plain) / 100
    store = target.open()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    _plant(target, evil)
    ref = target.open().latest(decode=False)
    assert ref.iteration == 20, "checksums verify, so it is the latest"
    says = "is compressed" if layout == "deflated" else "appears twice"
    with pytest.raises(CheckpointCorruptError, match=says):
        target.open().load(ref)
    with pytest.raises(CheckpointCorruptError, match=says):
        decode_state(evil)
    (tmp_path / "state.pt").write_bytes(evil)
    with pytest.raises(CheckpointCorruptError, match=says):  # the runtime's restore of a staged file
        load_state(tmp_path / "state.pt")
