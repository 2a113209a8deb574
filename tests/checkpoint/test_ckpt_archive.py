"""Local state files are read record by record (archive.py): the result is what torch.load gives,
the digest is the whole file's, and anything unexpected falls back to a whole-file read."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_ops.checkpoint import Checksum, encode_state
from elastic_ops.checkpoint import archive as archive_module
from elastic_ops.checkpoint import store as store_module
from elastic_ops.checkpoint.archive import (
    PROBE_RECORDS,
    Archive,
    archive_decoding_works,
    decode_archive,
    read_archive,
)
from elastic_ops.errors import UnsafeCheckpointError
from tests.checkpoint.builders import StoreTarget, make_model, make_state, small_state, train_steps


def _read(path: Path, algorithm: Checksum = Checksum.XXH3_128) -> tuple[Archive, str] | None:
    with open(path, "rb", buffering=0) as f:
        return read_archive(f, path.stat().st_size, algorithm)


def _read_sized(path: Path, size: int) -> tuple[Archive, str] | None:
    with open(path, "rb", buffering=0) as f:
        return read_archive(f, size, Checksum.XXH3_128)


def _assert_same(got: Any, want: Any, path: str = "") -> None:
    """Equal trees; tensors equal in dtype, shape, strides and values."""
    assert type(got) is type(want), path
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
            want.dtype,
            want.shape,
            want.stride(),
            want.storage_offset(),
        ), path
        assert torch.equal(got, want) or (got.isnan() == want.isnan()).all(), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def _training_state() -> dict[str, Any]:
    model, opt, sched = make_model(width=32)
    train_steps(model, opt, sched, 3)
    base = torch.arange(24, dtype=torch.float64)
    return make_state(
        model,
        opt,
        sched,
        views=[base[:6].view(2, 3), base[4:].view(4, 5).t(), base[::3]],  # one storage, three views
        dtypes=[torch.ones(3, dtype=d) for d in (torch.bfloat16, torch.bool, torch.int8, torch.complex64)],
        scalar=torch.tensor(3.5),
        empty=torch.zeros(0, 4),
        nested=(1, [2.5, "x", None, b"raw"], {"k": torch.tensor([7])}),
    )


def test_probe_records_are_what_torch_load_reads() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in PROBE_RECORDS.items():
            zf.writestr(f"archive/{name}", data)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    t = torch.arange(6.0)
    _assert_same(loaded, {"a": t[:4].view(2, 2), "b": t[2:], "empty": torch.zeros(0), "n": [1, "x", None]})


def test_this_pytorch_decodes_archives() -> None:
    """With the PyTorch in constraints.txt the fast path is on; an upgrade that breaks it shows here."""
    archive_decoding_works.cache_clear()
    assert archive_decoding_works()


def test_a_training_state_reads_as_torch_load_reads_it(tmp_path: Path) -> None:
    state = _training_state()
    path = tmp_path / "state.pt"
    path.write_bytes(encode_state(state))
    archive, digest = _read(path)
    assert len(archive) == path.stat().st_size
    got = decode_archive(archive)
    _assert_same(got, torch.load(path, weights_only=True))
    views = got["views"]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1, "views still share their storage"
    params = [t.untyped_storage().data_ptr() for t in got["model"].values()]
    assert len(set(params)) == len(params), "each storage is its own allocation, as with torch.load"


@pytest.mark.parametrize("algorithm", list(Checksum))
def test_the_digest_is_the_whole_files(tmp_path: Path, algorithm: Checksum) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(encode_state(_training_state()))
    _, digest = _read(path, algorithm)
    assert digest == algorithm.hexdigest(path.read_bytes())


_DTYPES = [torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    dtype = draw(st.sampled_from(_DTYPES))
    t = torch.randint(0, 100, tuple(shape), generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    t = t.to(dtype)
    return t.t() if t.dim() == 2 and draw(st.booleans()) else t


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text(min_size=1, max_size=5), _tensors() | st.integers() | st.none(), max_size=6))
def test_any_tree_of_tensors_reads_as_torch_load_reads_it(tmp_path: Path, state: dict[str, Any]) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(encode_state(state))
    archive, digest = _read(path)
    assert digest == Checksum.XXH3_128.hexdigest(path.read_bytes())
    _assert_same(decode_archive(archive), torch.load(path, weights_only=True))


def test_a_directory_longer_than_the_first_tail_read_is_read_again_from_its_start(tmp_path: Path) -> None:
    state = {f"layer{i}": torch.full((2,), float(i)) for i in range(1500)}  # a ~100 KB directory
    path = tmp_path / "state.pt"
    path.write_bytes(encode_state(state))
    with zipfile.ZipFile(path) as zf:
        assert path.stat().st_size - zf.start_dir > archive_module._TAIL
    archive, digest = _read(path)
    assert digest == Checksum.XXH3_128.hexdigest(path.read_bytes())
    _assert_same(decode_archive(archive), torch.load(path, weights_only=True))


def test_a_file_truncated_while_read_ends_the_read_early(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.pt"
    data = encode_state(_training_state())
    path.write_bytes(data)
    real_plan = archive_module._plan

    def plan_then_truncate(reader, size):  # noqa: ANN001, ANN202
        planned = real_plan(reader, size)
        with open(path, "r+b") as f:
            f.truncate(len(data) // 2)
        return planned

    monkeypatch.setattr(archive_module, "_plan", plan_then_truncate)
    archive, digest = _read_sized(path, len(data))
    assert len(archive) == len(data) // 2  # what the store's size check then reports
    assert digest == Checksum.XXH3_128.hexdigest(data[: len(data) // 2])


def test_files_not_laid_out_as_torch_writes_are_left_to_a_whole_file_read(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a zip file at all" * 100)
    assert _read(garbage) is None
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in PROBE_RECORDS.items():
            zf.writestr(f"archive/{name}", data)
    assert _read(deflated) is None


def test_a_directory_claiming_more_than_the_file_holds_allocates_nothing(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(encode_state(_training_state()))
    real_plan = archive_module._plan

    def plan_with_a_huge_record(reader, size):  # noqa: ANN001, ANN202
        records, start, directory = real_plan(reader, size)
        i = next(i for i, r in enumerate(records) if r.name.startswith("data/"))
        records[i] = archive_module._Record(records[i].name, records[i].header_offset, 1 << 40)
        return records, start, directory

    def no_allocation(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError(f"allocated {args}")

    monkeypatch.setattr(archive_module, "_plan", plan_with_a_huge_record)
    monkeypatch.setattr(archive_module.torch, "empty", no_allocation)
    assert _read(path) is None


def test_a_directory_that_changed_between_its_two_reads_is_not_trusted(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(encode_state(small_state(1)))
    real_plan = archive_module._plan

    def plan_from_other_bytes(reader, size):  # noqa: ANN001, ANN202
        records, start, directory = real_plan(reader, size)
        return records, start, directory[:-1] + bytes([directory[-1] ^ 1])

    monkeypatch.setattr(archive_module, "_plan", plan_from_other_bytes)
    assert _read(path) is None


def test_a_malicious_archive_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):  # noqa: ANN204
            return (open, (str(marker), "w"))

    path = tmp_path / "state.pt"
    torch.save({"model": Exploit()}, path)
    archive, _ = _read(path)
    with pytest.raises(UnsafeCheckpointError, match="safe loader refused"):
        decode_archive(archive, name="state.pt")
    assert not marker.exists()


def test_the_store_reads_local_state_record_by_record_and_falls_back_without(
    target: StoreTarget, monkeypatch
) -> None:
    calls: list[str] = []

    def recording(name: str):  # noqa: ANN202
        real = getattr(store_module, name)

        def decode(data, *, name: str) -> Any:  # noqa: ANN001
            calls.append(real.__name__)
            return real(data, name=name)

        return decode

    for decoder in ("decode_archive", "decode_state"):
        monkeypatch.setattr(store_module, decoder, recording(decoder))
    state = _training_state()
    target.open().save(10, state, epoch=1, spec_hash="h")
    want = torch.load(io.BytesIO(encode_state(state)), weights_only=True)
    store = target.open()
    _assert_same(store.load(store.latest()), want)
    assert calls == (["decode_archive"] if target.kind == "file" else ["decode_state"])

    calls.clear()
    monkeypatch.setattr(store_module, "archive_decoding_works", lambda: False)  # another PyTorch
    store = target.open()
    _assert_same(store.load(store.latest()), want)
    assert calls == ["decode_state"]
