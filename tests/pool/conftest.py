"""Pool test plumbing: a ledger URL on SQLite and on PostgreSQL (isolated schema), a driven clock."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def pg_schema_url(base: str):
    """Create a fresh schema and return (url whose search_path is that schema, cleanup)."""
    schema = f"pool_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(base)
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in base else "?"
    url = f"{base}{sep}options=-csearch_path%3D{schema}"

    def cleanup() -> None:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()

    return url, cleanup


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'pool.db'}"


@pytest.fixture
def pg_url(postgres_url):
    url, cleanup = pg_schema_url(postgres_url)
    yield url
    cleanup()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request) -> str:
    """The same test on both databases."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")
