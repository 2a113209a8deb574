"""The ledger's database: engines for SQLite and PostgreSQL with the session settings the
pool's transactions rely on, and which database errors mean busy, unreachable or retry."""

from __future__ import annotations

import collections
import hashlib
import os
import re
import weakref
from collections.abc import Mapping
from importlib.util import find_spec
from typing import Any

from sqlalchemy import Select, create_engine, event, func
from sqlalchemy.engine import URL, Connection, Dialect, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.sql.expression import ColumnElement

from elastic_ops.errors import SpecError
from elastic_ops.urls import scrubbed, shown_url

_ENCODE_HINT = "percent-encode '@', ':' and '/' in a user name or password (%40, %3A, %2F)"
NO_LEDGER_HINT = "a ledger is created by its first chunk task, `pool add-host` or `pool configure`"


def make_engine(url: str, *, create: bool = True) -> Engine:
    """An engine for the ledger at ``url``. ``create=False``: an SQLite file must exist already
    (a typo in a path must not make an empty ledger, and its folders, to read from)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is no number (int() of it)
        raise SpecError(
            "url", shown_url(url), "must be an SQLAlchemy URL: sqlite:////abs/pool.db or postgresql+psycopg2://…",
            hint=_ENCODE_HINT,
        ) from None
    if parsed.host is not None and "@" in parsed.host:
        # the password holds an '@': SQLAlchemy's parser ends it at the first one and takes the
        # rest of the password for the host (which the driver's errors would then show)
        raise SpecError("url", shown_url(url), "a URL whose user name and password hold no raw '@'",
                        hint=_ENCODE_HINT)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:" or not os.path.isabs(parsed.database):
            # relative: each process (scheduler, triggerer, agent, CLI) would open its own ledger
            raise SpecError(
                "url", shown_url(url), "an SQLite ledger needs an absolute file path (sqlite:////abs/path/pool.db)"
            )
        if not create and not os.path.exists(parsed.database):
            raise SpecError(
                "url", shown_url(url), f"an existing SQLite ledger: {parsed.database} does not exist",
                hint=NO_LEDGER_HINT,
            )
        os.makedirs(os.path.dirname(os.path.abspath(parsed.database)), exist_ok=True)
        busy_s = SQLITE_BUSY_TIMEOUT_S
        engine = create_engine(parsed, connect_args={"timeout": busy_s})

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn, _rec):  # pragma: no cover - exercised by every sqlite test
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={int(busy_s * 1000)}")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):  # take the write lock up front: no upgrade deadlocks between readers
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if backend == "postgresql":
        if parsed.drivername == "postgresql" and not find_spec("psycopg") and find_spec("psycopg2"):
            # SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; the postgres extra installs psycopg2
            parsed = parsed.set(drivername="postgresql+psycopg2")
        try:
            return _postgres_engine(parsed)
        except ImportError as exc:
            raise SpecError(
                "url", shown_url(url), f"a PostgreSQL driver that is installed: {exc.name or exc} is not",
                hint="use postgresql+psycopg2://… (pip install 'elastic-ops[postgres]' installs psycopg2)",
            ) from None
    raise SpecError(
        "url", shown_url(url), "the pool ledger supports sqlite and postgresql URLs",
        # postgres:// is what Heroku-style DATABASE_URLs and many tools write; SQLAlchemy 1.4+ refuses it
        hint="write postgresql://…: SQLAlchemy has no postgres:// alias" if backend == "postgres" else None,
    )


SQLITE_BUSY_TIMEOUT_S = 30  # waiting longer for SQLite's write lock, retries included: LedgerBusyError
PG_CONNECT_TIMEOUT_S = 10  # an unreachable server: LedgerUnavailableError, not a hang (unless the URL says)
PG_LOCK_TIMEOUT_S = 30  # waiting for the pool's lock longer than this: LedgerBusyError
PG_IDLE_IN_TX_S = 15  # the server ends a transaction left idle this long (its client hung or stopped)


def _postgres_engine(parsed: URL) -> Engine:
    """READ COMMITTED whatever the server's default: every transaction first takes the pool row's
    lock, and under REPEATABLE READ its snapshot would predate the lock wait (it planned from
    stale rows: a raw IntegrityError on the allocation key). A client that stops inside a
    transaction (SIGSTOP, a frozen VM) holds that lock: the server ends its transaction after
    ``PG_IDLE_IN_TX_S``, and the others wait at most ``PG_LOCK_TIMEOUT_S`` for it. Both are set
    for each transaction, so they hold behind a transaction-mode pooler too (the isolation level
    rides in each ``BEGIN``). A URL's own ``connect_timeout`` or ``options=-c …`` for these
    settings wins; the connect timeout is set for the psycopg drivers only (pg8000 names it
    otherwise)."""
    connect_args: dict[str, Any] = {}
    if parsed.get_driver_name() in ("psycopg2", "psycopg") and "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
    options = str(parsed.query.get("options", ""))
    ours = {"lock_timeout": PG_LOCK_TIMEOUT_S, "idle_in_transaction_session_timeout": PG_IDLE_IN_TX_S}
    settings = {name: int(seconds * 1000) for name, seconds in ours.items() if name not in options}
    engine = create_engine(parsed, isolation_level="READ COMMITTED", connect_args=connect_args)

    SESSION_SETTINGS[engine] = settings

    @event.listens_for(engine, "begin")
    def _begin(conn):  # per transaction (SET LOCAL), not per session: a transaction-mode pooler
        # (PgBouncer) runs each transaction on whichever server session is free, where a session
        # SET made at connect time may never have happened
        if conn.get_execution_options().get(INLINE_SETTINGS):
            return  # the transaction sets them itself (see INLINE_SETTINGS)
        _set_session(conn, settings)

    return engine


# An execution option: the transaction's first statement sets the session settings and reads the
# clock itself (``inline_settings``), saving a round trip (the heartbeat's, the hottest call)
INLINE_SETTINGS = "elastic_ops_inline_settings"
SESSION_SETTINGS: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()


def _set_session(conn: Connection, settings: dict[str, int]) -> float:
    parts = [f"set_config('{name}', '{ms}', true)" for name, ms in settings.items()]
    clock = "extract(epoch from clock_timestamp())"
    row = conn.exec_driver_sql("SELECT " + ", ".join([*parts, clock])).first()
    return float(row[-1])


def begin_settings(conn: Connection, engine: Engine) -> float:
    """On a connection of an INLINE_SETTINGS engine, a transaction's first statement: set
    ``engine``'s session settings for it; returns the database's clock."""
    return _set_session(conn, SESSION_SETTINGS.get(engine, {}))


def inline_settings(engine: Engine) -> list[ColumnElement[Any]]:
    """Columns that set ``engine``'s per-transaction settings and read the database's clock
    (its last column): for the first statement of a transaction begun with INLINE_SETTINGS."""
    settings = SESSION_SETTINGS.get(engine, {})
    cols: list[Any] = [func.set_config(name, str(ms), True) for name, ms in settings.items()]
    return [*cols, func.extract("epoch", func.clock_timestamp()).label("db_now")]


_NAMED = re.compile(r"%\((\w+)\)s")
# the prepared statement does not exist / already exists: the session is not the one it was
_POOLED_SESSION = frozenset({"26000", "42P05"})


class FastQuery:
    """A SELECT compiled once for a dialect whose DBAPI takes named parameters (psycopg2), run on
    the DBAPI cursor of a SQLAlchemy connection, inside its transaction: a heartbeat's one
    statement without the ~0.1 ms of CPU SQLAlchemy's execution and result layers add to each
    execute (the heartbeat is the ledger's hottest call). Driver errors become SQLAlchemy's, as
    ``Connection.execute`` makes them (a dropped connection is invalidated and says so)."""

    def __init__(self, stmt: Select[Any], dialect: Dialect) -> None:
        self._compiled = stmt.compile(dialect=dialect)
        self.sql = self._compiled.string
        names = [c.key or f"col{i}" for i, c in enumerate(stmt.selected_columns)]
        self._row = collections.namedtuple("Row", names, rename=True)  # type: ignore[misc]
        self.prepare = True  # off once a connection pooler shows it keeps no session state
        self._prepared: tuple[str, str, tuple[str, ...]] | None = None  # (PREPARE, EXECUTE, names)

    def _prepared_form(
        self, cursor: Any, values: dict[str, Any], given: Mapping[str, Any]
    ) -> tuple[str, str, tuple[str, ...]]:
        """The statement as a server-side prepared one, built once: the parameters the caller
        gives (``given``) as ``$n``, the statement's own constants as literals (each parameter
        sent is a value the driver quotes, per call)."""
        order: list[str] = []

        def bind(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in given:
                return cursor.mogrify("%s", (values[name],)).decode()
            if name not in order:
                order.append(name)
            return f"${order.index(name) + 1}"

        body = _NAMED.sub(bind, self.sql).replace("%%", "%")
        name = "elastic_ops_" + hashlib.sha1(body.encode()).hexdigest()[:16]
        execute = f"EXECUTE {name}({', '.join(['%s'] * len(order))})" if order else f"EXECUTE {name}"
        self._prepared = (f"PREPARE {name} AS {body}", execute, tuple(order))
        return self._prepared

    def rows(self, dbapi: Any, params: dict[str, Any], prepared: set[str] | None = None) -> list[Any]:
        """Run on a bare DBAPI connection (its transaction is the caller's); driver errors raise.
        ``prepared``: the statements this connection's session has prepared (kept with it): the
        statement is prepared on first use, and later runs skip the server's parse and plan
        (more than half the server's time for a heartbeat)."""
        cursor = dbapi.cursor()
        try:
            if prepared is None or not self.prepare:
                cursor.execute(self.sql, self._compiled.construct_params(params))
            else:
                prepare, execute, order = self._prepared or self._prepared_form(
                    cursor, self._compiled.construct_params(params), params)
                try:
                    if prepare not in prepared:
                        cursor.execute(prepare)
                        prepared.add(prepare)
                    cursor.execute(execute, tuple(params[k] for k in order))
                except Exception as exc:
                    if getattr(exc, "pgcode", None) in _POOLED_SESSION:
                        # a transaction-mode pooler (PgBouncer) ran this on another server
                        # session: plain statements from now on
                        self.prepare = False
                    raise
            return [self._row(*r) for r in cursor.fetchall()]
        finally:
            cursor.close()

    def run(self, conn: Connection, params: dict[str, Any]) -> list[Any]:
        values = self._compiled.construct_params(params)
        dbapi = conn.connection.driver_connection
        cursor = None
        try:
            cursor = dbapi.cursor()
            cursor.execute(self.sql, values)
            rows = cursor.fetchall()
            cursor.close()
        except conn.dialect.loaded_dbapi.Error as exc:
            dropped = conn.dialect.is_disconnect(exc, dbapi, cursor)
            if dropped:
                conn.invalidate(exc)
            raise DBAPIError.instance(self.sql, values, exc, conn.dialect.loaded_dbapi.Error,
                                      connection_invalidated=dropped) from exc
        return [self._row(*r) for r in rows]


def fast_queries(
    stmts: tuple[Select[Any], ...], dialect: Dialect,
) -> tuple[Select[Any], ...] | tuple[FastQuery, ...]:
    """``stmts`` as :class:`FastQuery` where the dialect's DBAPI takes named parameters."""
    if dialect.paramstyle not in ("pyformat", "named") or dialect.positional:
        return stmts
    return tuple(FastQuery(s, dialect) for s in stmts)


def first_line(exc: BaseException, url: str | None = None) -> str:
    """The first line of ``exc``'s message, without ``url``'s secrets (a driver's message may
    quote parts of the URL it was given)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = lines[0] if lines else type(exc).__name__
    return (line if url is None else scrubbed(line, url))[:300]


def lock_timeout(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "pgcode", None) == "55P03" or "lock timeout" in str(exc.orig).lower()


def retryable(exc: DBAPIError) -> bool:
    msg = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
    return any(
        m in msg
        for m in ("database is locked", "could not serialize", "deadlock detected", "database is busy")
    )
