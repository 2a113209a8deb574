"""Shared test plumbing. Small builders live next to the tests that use them."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator

import pytest

REQUIRE_SERVICES = os.environ.get("ELASTIC_OPS_REQUIRE_SERVICES") == "1"

try:  # property tests: no per-example deadline (a wall-clock check on a loaded machine), and
    # the same examples on every run (a failure reproduces; CI does not pass by luck)
    from hypothesis import settings

    settings.register_profile("elastic_ops", deadline=None, derandomize=True, database=None)
    settings.load_profile("elastic_ops")
except ImportError:  # a machine that only runs the runtime's CUDA tests
    pass


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip (or, in CI, fail) when a service the test needs is not running."""
    if _reachable(host, port):
        return
    msg = f"needs {name} at {host}:{port} (start it, or see docs/howto/tests.md)"
    if REQUIRE_SERVICES:
        pytest.fail(f"ELASTIC_OPS_REQUIRE_SERVICES=1 and {msg}")
    pytest.skip(msg)


def local_postgres() -> str:
    """A URL to the local PostgreSQL ``test`` database (trust auth), or ``$ELASTIC_OPS_TEST_POSTGRES``'s;
    skips (fails in CI) when its server does not answer."""
    from sqlalchemy.engine import make_url

    url = os.environ.get("ELASTIC_OPS_TEST_POSTGRES", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
    parsed = make_url(url)
    require_service("PostgreSQL", parsed.host or "127.0.0.1", parsed.port or 5432)
    return url


@pytest.fixture
def postgres_url() -> str:
    return local_postgres()


@contextlib.contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """A new database on the local PostgreSQL, dropped afterwards: a URL to it."""
    import sqlalchemy as sa

    base = sa.make_url(local_postgres())
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def redis_url() -> str:
    """A URL to the local Redis (database 0; tests use a namespace of their own)."""
    require_service("Redis", "127.0.0.1", 6379)
    return os.environ.get("ELASTIC_OPS_TEST_REDIS", "redis://127.0.0.1:6379/0")
