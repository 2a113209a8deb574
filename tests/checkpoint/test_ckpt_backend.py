"""The ``Backend`` contract: a backend that implements only the six required operations works
under either of the store's strategies (the optional operations' generic versions are enough),
and a backend missing a required one cannot be made."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from elastic_ops.checkpoint import CheckpointStore
from elastic_ops.checkpoint.backend import Backend, ObjectInfo
from tests.checkpoint.builders import small_state


class InMemory(Backend):
    """Objects in a dict: the six required operations and nothing else."""

    def __init__(self, *, remote: bool) -> None:
        self.uri = "memory://test"
        self.remote = remote
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self.objects[key] = bytes(data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._lock:
            if key in self.objects:
                return False
            self.objects[key] = bytes(data)
            return True

    def get(self, key: str, *, size_hint: int | None = None) -> bytes | None:
        with self._lock:
            return self.objects.get(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        with self._lock:
            return [ObjectInfo(k, len(v)) for k, v in self.objects.items() if k.startswith(prefix)]

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self.objects.pop(k, None)

    def delete_if(self, key: str, data: bytes) -> bool:
        with self._lock:
            if self.objects.get(key, data) != data:
                return False
            self.objects.pop(key, None)
            return True


@pytest.mark.parametrize("remote", [True, False])
def test_a_backend_with_only_the_required_operations_saves_finds_loads_and_exports(remote, tmp_path: Path):
    backend = InMemory(remote=remote)
    store = CheckpointStore(backend, keep_last=2)
    for it in (10, 20, 30):
        store.save(it, small_state(it), epoch=1, spec_hash="h")
    torch.save(small_state(40), tmp_path / "state.pt")
    store.save_file(40, tmp_path / "state.pt", epoch=1, spec_hash="h")  # adopt(), where it is used
    store.wait()
    latest = store.latest(spec_hash="h")
    assert latest is not None and latest.iteration == 40 and store.load(latest)["step"] == 40
    assert [r.iteration for r in store.list()] == [30, 40]  # retention ran (list_dirs(), sweep_temp())
    store.export(latest, tmp_path / "out.pt")  # place(), where it is used
    assert torch.load(tmp_path / "out.pt", weights_only=True)["step"] == 40


def test_a_backend_missing_a_required_operation_cannot_be_made():
    class NoDeleteIf(Backend):
        put = put_if_absent = get = list = delete = InMemory.put

    with pytest.raises(TypeError, match="delete_if"):
        NoDeleteIf()
