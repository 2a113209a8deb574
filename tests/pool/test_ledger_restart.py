"""The ledger's PostgreSQL restarted mid-run (issue 22, item 14), on a private PostgreSQL this test
initialises and stops with ``pg_ctl stop -m immediate`` (a crash: no shutdown checkpoint, clients'
connections cut) while a real chunk trains on its lease, as the operator runs it (a LeaseKeeper
heartbeating the grant, feeding the runner its target).

- Back within the lease TTL → the chunk trains on through the failed heartbeats and ends at its
  end on all its workers; a request made during the outage fails as ``LedgerUnavailableError``
  (retryable); after the restart the held slots are nobody else's until released, and the event
  log replays with no slot ever held by two jobs.
- Away past the TTL → the keeper takes the lease for lost, the chunk stops at its next boundary
  with its state committed; once the database is back the leases are expired, the lost try's
  epoch is fenced, the job's retry gets its slots under a new epoch and resumes to the
  uninterrupted model bitwise, again never two holders at once.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_ops.checkpoint import open_store
from elastic_ops.errors import LeaseExpiredError, LedgerUnavailableError
from elastic_ops.operators.lease import LeaseKeeper
from elastic_ops.pool import Grant, PoolClient, Wait
from elastic_ops.runtime import ChunkStatus, run_chunk
from tests.agent.test_node import wait_for
from tests.runtime.builders import make_spec

from .timeline import held_now, replay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # its own PostgreSQL: not the "postgres" mark

PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


class PrivatePostgres:
    """A PostgreSQL cluster of this test alone (trust auth, a free port), run as ``postgres``."""

    def __init__(self) -> None:
        self.bin = Path(PG_BIN[-1])
        self.root = Path(tempfile.mkdtemp(prefix="eo-pg-"))
        self.data = self.root / "data"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *argv: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *argv], check=True, capture_output=True, timeout=120)

    def init(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                          "--auth=trust", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"),
                          "-o", options, "-w", "-t", "60", "start")

    def crash(self) -> None:
        """Immediate shutdown: every connection cut, recovery at the next start."""
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        subprocess.run([*(["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []),
                        str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    if not PG_BIN or (os.geteuid() == 0 and shutil.which("runuser") is None):
        pytest.skip("needs PostgreSQL's server binaries (/usr/lib/postgresql/*/bin) and, as root, runuser")
    server = PrivatePostgres()
    try:
        try:
            server.init()
            server.start()
        except (subprocess.CalledProcessError, OSError, KeyError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            pytest.skip(f"cannot set up a private PostgreSQL: {exc} {detail.decode(errors='replace')[-300:]}")
        yield server
    finally:
        server.remove()


def pool_of_two(url: str, ttl_s: float) -> tuple[PoolClient, Grant, Grant]:
    """One host of 4 slots, taken by jobs ``a`` and ``b`` (2 each); job ``c`` waits for slots."""
    pool = PoolClient(url)
    pool.configure(lease_ttl_s=ttl_s)
    pool.add_host("h0", 4)
    grants = []
    for job in ("a", "b"):
        pool.submit(job, min_workers=2, max_workers=2)
        grant = pool.request(job, new_attempt=True)
        assert isinstance(grant, Grant) and grant.workers == 2, grant
        grants.append(grant)
    pool.submit("c", min_workers=2, max_workers=2)
    assert isinstance(pool.request("c", new_attempt=True), Wait)
    return pool, grants[0], grants[1]


class HeldChunk:
    """Job ``a``'s chunk ``[0, 40)`` trained in a thread on its lease, held at iteration 25 (20
    committed) until :meth:`go`; ``b``'s lease kept by a keeper of its own. Its iterations take
    50 ms, so the runner decides only a few boundaries ahead (a lost lease stops it within them)."""

    def __init__(self, url: str, tmp_path: Path, a: Grant, b: Grant) -> None:
        self.gate = tmp_path / "gate"
        self.spec = make_spec(tmp_path / "a", total_iterations=40, checkpoint_interval=10,
                              params={"hold_at": 25, "hold_file": str(self.gate), "sleep_s": 0.05})
        self.keepers = [LeaseKeeper(PoolClient(url), g.job, g.epoch, g.workers, interval_s=0.5, ttl_s=g.ttl_s,
                                    placements=g.placements, host="h0").start() for g in (a, b)]
        keeper = self.keepers[0]
        self.results: list = []
        self.errors: list[BaseException] = []

        def train() -> None:
            try:
                self.results.append(run_chunk(self.spec, 0, 40, target=keeper.target, epoch=a.epoch,
                                              on_progress=keeper.progressed, on_segment=keeper.applied))
            except BaseException as exc:  # the test checks them
                self.errors.append(exc)

        self.thread = threading.Thread(target=train, daemon=True)
        self.thread.start()
        wait_for("iteration 20 committed", lambda: self.committed() == 20, 120)

    def committed(self) -> int:
        ref = open_store(self.spec.checkpoint).latest(spec_hash=self.spec.spec_hash())
        return -1 if ref is None else ref.iteration

    def go(self):
        self.close()
        assert not self.thread.is_alive() and not self.errors, self.errors
        (result,) = self.results
        return result

    def close(self) -> None:
        """The gate opened, the chunk ended (it stops once its lease is lost), the keepers stopped."""
        self.gate.touch()
        self.thread.join(120)
        for keeper in self.keepers:
            keeper.stop()


def reference(tmp_path: Path) -> str:
    """The model of the same 40 iterations, uninterrupted."""
    spec = make_spec(tmp_path / "ref", total_iterations=40, checkpoint_interval=10)
    return run_chunk(spec, 0, 40, target=lambda i: 2).param_sha256


def assert_never_two_holders(pool: PoolClient) -> dict:
    events = pool.events()
    replay(events)  # fails on a slot granted while another job held it
    return held_now(events)


def test_a_ledger_restarted_within_the_lease_ttl_keeps_the_chunk_training_and_grants_nothing_twice(
    private_postgres, tmp_path
):
    pool, a, b = pool_of_two(private_postgres.url, ttl_s=30.0)
    other = PoolClient(private_postgres.url, create=False)  # a client that has not beaten yet
    with contextlib.closing(HeldChunk(private_postgres.url, tmp_path, a, b)) as chunk:
        private_postgres.crash()
        for call in (lambda: other.request("c"), lambda: other.heartbeat("a", a.epoch, workers=2)):
            with pytest.raises(LedgerUnavailableError) as info:  # a raw driver error from a heartbeat once
                call()
            assert info.value.retryable
        time.sleep(3)  # several heartbeats of both keepers fail meanwhile
        assert not any(k.lost for k in chunk.keepers)
        assert chunk.keepers[0].current().workers == 2
        private_postgres.start()
        result = chunk.go()
    assert result.status == ChunkStatus.COMPLETED and result.iteration == 40
    assert not any(k.lost for k in chunk.keepers)  # the lease lived through the outage
    assert result.param_sha256 == reference(tmp_path)

    assert isinstance(other.request("c"), Wait)  # a's and b's slots are still theirs
    held = assert_never_two_holders(pool)
    assert sorted(held.values()) == ["a", "a", "b", "b"]
    pool.release("a", a.epoch, finished=True)
    grant = other.request("c")
    assert isinstance(grant, Grant) and set(grant.placements) == set(a.placements)
    assert sorted(assert_never_two_holders(pool).values()) == ["b", "b", "c", "c"]


def test_a_ledger_away_past_the_lease_ttl_stops_the_chunk_and_its_slots_go_to_the_next_job_once(
    private_postgres, tmp_path
):
    pool, a, b = pool_of_two(private_postgres.url, ttl_s=4.0)
    with contextlib.closing(HeldChunk(private_postgres.url, tmp_path, a, b)) as chunk:
        private_postgres.crash()
        wait_for("the keepers to take their leases for lost", lambda: all(k.lost for k in chunk.keepers), 60)
        private_postgres.start()
        result = chunk.go()  # the chunk goes on to its next boundary, where the target is 0
    assert result.status == ChunkStatus.PREEMPTED and 25 <= result.iteration < 40
    assert chunk.committed() == result.iteration  # its state at the stop is committed

    retry = PoolClient(private_postgres.url, create=False).request("a", new_attempt=True)  # Airflow's retry
    assert isinstance(retry, Grant) and retry.epoch > a.epoch and retry.workers == 2, retry
    with pytest.raises(LeaseExpiredError):  # the lost try is fenced: its epoch is dead
        pool.heartbeat("a", a.epoch, workers=2)
    assert sorted(assert_never_two_holders(pool).values()) == ["a", "a"]  # b's expired slots: free
    resumed = run_chunk(chunk.spec, result.iteration, 40, target=lambda i: 2, epoch=retry.epoch)
    assert resumed.status == ChunkStatus.COMPLETED and resumed.param_sha256 == reference(tmp_path)
