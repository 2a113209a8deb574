"""Ledger tables and versioned migrations (SQLAlchemy Core; SQLite and PostgreSQL).

``allocations`` has one row per granted slot, keyed by ``(host, slot)``: the database itself
refuses to grant a slot twice. ``pool`` has exactly one row; it holds the policy settings and
is the row every PostgreSQL transaction locks first, which serialises all decisions.

Migrations are an ordered list of ``(version, function)``; :func:`migrate` applies the ones
newer than ``schema_version`` inside one locked transaction, so concurrent first starts are safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    Float,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.exc import DBAPIError

from elastic_ops.errors import SpecError

metadata = MetaData()

schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("applied", Float, nullable=False),
)

pool = Table(
    "pool",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("policy", String(64), nullable=False),
    Column("preemption", String(16), nullable=False),
    Column("lease_ttl_s", Float, nullable=False),
    Column("min_rescale_interval_s", Float, nullable=False),
    Column("min_gain", Float, nullable=False),
    Column("aging_s", Float, nullable=False),
    Column("job_idle_s", Float, nullable=False),
    Column("cooling_s", Float, nullable=False),
    Column("failure_threshold", Integer, nullable=False),
    Column("plan_interval_s", Float, nullable=False, default=0.05, server_default="0.05"),  # v4
    Column("plan_refresh_s", Float, nullable=False, default=5.0, server_default="5.0"),  # v4
    Column("rescale_cost_s", Float, nullable=False, default=30.0, server_default="30.0"),  # v6
)

# v4: the planner's state. ``dirty_seq`` counts changes of the pool's inputs; ``planned_seq`` is
# the last change a committed plan saw; ``planned_at`` (wall clock) when it ended.
planner = Table(
    "planner",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("dirty_seq", BigInteger, nullable=False, default=0),
    Column("planned_seq", BigInteger, nullable=False, default=0),
    Column("planned_at", Float, nullable=False, default=0.0),
    Column("plans", BigInteger, nullable=False, default=0),
    Column("plan_s", Float, nullable=False, default=0.0),
    # the ledger time by which time alone may change the plan (the earliest live lease's expiry,
    # the end of a cooling period), as of the last plan: heartbeats compare it, cheaply
    Column("next_due", Float, nullable=False, default=0.0),
    # the ledger time of the last plan (time-driven rules, aging and rescale intervals, are in
    # the ledger's time: plan_refresh_s counts in it too)
    Column("planned_now", Float, nullable=False, default=0.0),
)

hosts = Table(
    "hosts",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("slots", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("labels", Text, nullable=False, default="{}"),
    Column("state_since", Float, nullable=False),
    Column("failures", Integer, nullable=False, default=0),
)

jobs = Table(
    "jobs",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("min_workers", Integer, nullable=False),
    Column("max_workers", Integer, nullable=False),
    Column("priority", Integer, nullable=False),
    Column("preemptible", Boolean, nullable=False),
    Column("state", String(16), nullable=False),
    Column("submitted", Float, nullable=False),
    Column("waiting_since", Float),
    Column("last_rescale", Float),
    Column("last_seen", Float, nullable=False),
    Column("epoch", Integer, nullable=False, default=0),
    Column("avoid_hosts", Text, nullable=False, default="[]"),
    Column("target", Integer, nullable=False, default=0),
    Column("reason", Text, nullable=False, default=""),
    Column("selector", Text, nullable=False, default="{}", server_default="{}"),  # v2
    # v4: the planner's decision for a job holding slots (JSON [[host, slot], ...]; NULL: keep
    # exactly what it holds), and when a waiting job last asked for a grant (NULL: not asking)
    Column("plan_placements", Text),
    Column("plan_release", Text),
    Column("asked", Float),
    # v7: an adaptive job's batches (JSON {"base", "most", "per_worker", "least",
    # "per_worker_most"}; NULL: its batch is fixed), and the global batch the plan chose for it
    # (0: its own)
    Column("batching", Text),
    Column("plan_batch", Integer, nullable=False, default=0, server_default="0"),
    # v8: the tenant the job belongs to, and the Airflow DAG it comes from (NULL: submitted
    # outside Airflow; the HTTP API then asks for edit permission on the pool)
    Column("tenant", String(255), nullable=False, default="default", server_default="default"),
    Column("dag_id", String(255)),
)

# v8: the teams sharing the pool (elastic_ops.pool.tenants): slots guaranteed, the most they may
# hold (NULL: no limit), their weight in lending idle capacity
tenants = Table(
    "tenants",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("guaranteed", Integer, nullable=False),
    Column("max_slots", Integer),
    Column("weight", Float, nullable=False, default=1.0),
)

leases = Table(
    "leases",
    metadata,
    Column("job", String(255), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("granted", Float, nullable=False),
    Column("expires", Float, nullable=False),
    Column("ended", Float),
    Column("end_reason", String(32)),
    # v4: what the holder measured in its current configuration, summed by its heartbeats (no
    # second row to write per heartbeat); moved to ``observations`` when the configuration
    # changes or the lease ends
    Column("obs_workers", Integer),
    Column("obs_hosts", Integer),
    Column("obs_batch", Integer),
    Column("obs_iterations", BigInteger, nullable=False, default=0, server_default="0"),
    Column("obs_seconds", Float, nullable=False, default=0.0, server_default="0"),
    Column("obs_reports", BigInteger, nullable=False, default=0, server_default="0"),
    Column("obs_first", Float),
    # v7: the gradient statistics the holder's workers last measured (adaptive batch)
    Column("obs_grad_sqr", Float),
    Column("obs_grad_var", Float),
    PrimaryKeyConstraint("job", "epoch"),
)
# the planner and every heartbeat look for overdue live leases: an index of the live ones, not a
# scan of every lease ever granted (v5). Not on ``expires``: each heartbeat moves it, and an
# indexed column makes every renewal a new row version with new index entries (PostgreSQL's HOT
# update, the row rewritten in its page, needs no indexed column to change and room in the page:
# LEASES_FILLFACTOR)
Index("leases_live", leases.c.job, postgresql_where=leases.c.ended.is_(None),
      sqlite_where=leases.c.ended.is_(None))
LEASES_FILLFACTOR = 50

# v4: what each job measured, one row per configuration it ran in (bounded by them): summed
# iterations and training seconds at ``workers`` ranks over ``hosts`` hosts, global ``batch``
# (0: the job's fixed batch)
observations = Table(
    "observations",
    metadata,
    Column("job", String(255), nullable=False),
    Column("workers", Integer, nullable=False),
    Column("hosts", Integer, nullable=False),
    Column("batch", Integer, nullable=False),
    Column("iterations", BigInteger, nullable=False),
    Column("seconds", Float, nullable=False),
    Column("reports", BigInteger, nullable=False),
    Column("first_ts", Float, nullable=False),
    Column("last_ts", Float, nullable=False),
    PrimaryKeyConstraint("job", "workers", "hosts", "batch"),
)

allocations = Table(
    "allocations",
    metadata,
    Column("host", String(255), nullable=False),
    Column("slot", Integer, nullable=False),
    Column("job", String(255), nullable=False, index=True),
    Column("epoch", Integer, nullable=False),
    Column("granted", Float, nullable=False),
    # When the holder was told (in a heartbeat) to give this slot up; NULL while it keeps it.
    Column("releasing", Float),
    PrimaryKeyConstraint("host", "slot"),
)

events = Table(
    "events",
    metadata,
    # 64-bit on PostgreSQL (v3; a serial ran out at 2**31 events); SQLite's rowid already is
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("job", String(255), index=True),
    Column("host", String(255)),
    Column("slots", Text, nullable=False, default="[]"),
    Column("epoch", Integer),
    Column("workers", Integer),
    Column("reason", Text, nullable=False, default=""),
)

DEFAULTS = {
    "policy": "priority",
    "preemption": "graceful",
    "lease_ttl_s": 60.0,
    "min_rescale_interval_s": 0.0,
    "min_gain": 0.0,
    "aging_s": 600.0,
    "job_idle_s": 180.0,
    "cooling_s": 300.0,
    "failure_threshold": 3,
    "plan_interval_s": 0.05,
    "plan_refresh_s": 5.0,
    "rescale_cost_s": 30.0,
}


def _v1(conn: Connection) -> None:
    metadata.create_all(conn, checkfirst=True)
    if conn.execute(select(pool.c.id)).first() is None:
        conn.execute(insert(pool).values(id=1, **DEFAULTS))


def _v2(conn: Connection) -> None:
    """Jobs' host selectors (``{"gpu": "h100"}``; ``{}`` for the jobs there were)."""
    if "selector" not in {c["name"] for c in inspect(conn).get_columns("jobs")}:
        conn.execute(text("ALTER TABLE jobs ADD COLUMN selector TEXT NOT NULL DEFAULT '{}'"))


def _v3(conn: Connection) -> None:
    """64-bit event ids on PostgreSQL: a ``serial`` (and its sequence) stops at 2**31 - 1, and a
    busy ledger's next event would fail every call that logs one. SQLite's ids are 64-bit."""
    if conn.dialect.name != "postgresql":
        return
    try:
        with conn.begin_nested():
            conn.execute(text("ALTER TABLE events ALTER COLUMN id TYPE BIGINT"))
    except DBAPIError as exc:  # a view or rule on events.id (a dashboard's) blocks the type change
        raise SpecError(
            "url", "the pool ledger",
            f"a ledger whose events.id can be widened to BIGINT (schema 3): {str(exc.orig).splitlines()[0]}",
            hint="drop or redefine the views that use the ledger's events table, then start again",
        ) from None
    seq = conn.execute(text("SELECT pg_get_serial_sequence('events', 'id')")).scalar()
    if seq:
        conn.execute(text(f"ALTER SEQUENCE {seq} AS BIGINT MAXVALUE 9223372036854775807"))


def _v4(conn: Connection) -> None:
    """The planner (heartbeats renew and read; plans run when inputs change): its state row, the
    jobs' decisions and asks, the planner's settings, observations."""
    names = {c["name"] for c in inspect(conn).get_columns("pool")}
    for col, default in (("plan_interval_s", "0.05"), ("plan_refresh_s", "5.0")):
        if col not in names:
            conn.execute(text(f"ALTER TABLE pool ADD COLUMN {col} FLOAT NOT NULL DEFAULT {default}"))
    names = {c["name"] for c in inspect(conn).get_columns("jobs")}
    for col, kind in (("plan_placements", "TEXT"), ("plan_release", "TEXT"), ("asked", "FLOAT")):
        if col not in names:
            conn.execute(text(f"ALTER TABLE jobs ADD COLUMN {col} {kind}"))
    names = {c["name"] for c in inspect(conn).get_columns("leases")}
    for col, kind in (("obs_workers", "INTEGER"), ("obs_hosts", "INTEGER"), ("obs_batch", "INTEGER"),
                      ("obs_iterations", "BIGINT NOT NULL DEFAULT 0"),
                      ("obs_seconds", "FLOAT NOT NULL DEFAULT 0"),
                      ("obs_reports", "BIGINT NOT NULL DEFAULT 0"), ("obs_first", "FLOAT")):
        if col not in names:
            conn.execute(text(f"ALTER TABLE leases ADD COLUMN {col} {kind}"))
    metadata.create_all(conn, tables=[planner, observations], checkfirst=True)
    if conn.execute(select(planner.c.id)).first() is None:
        # a ledger upgraded in place plans at its first call: its jobs' rows hold no decision yet
        conn.execute(insert(planner).values(id=1, dirty_seq=1, planned_seq=0, planned_at=0.0, plans=0,
                                            plan_s=0.0, next_due=0.0, planned_now=0.0))


def _v5(conn: Connection) -> None:
    """Renewals rewrite the lease in place: the live-lease index on ``job`` (not ``expires``,
    which v4 indexed), and on PostgreSQL room in each page for the new row version."""
    names = {i["name"] for i in inspect(conn).get_indexes("leases")}
    if "leases_live_expires" in names:
        conn.execute(text("DROP INDEX leases_live_expires"))
    if "leases_live" not in names:
        next(i for i in leases.indexes if i.name == "leases_live").create(conn)
    if conn.dialect.name == "postgresql":
        # rows already written get the room as they are rewritten (no table rewrite, no long lock)
        conn.execute(text(f"ALTER TABLE leases SET (fillfactor = {LEASES_FILLFACTOR})"))


def _v6(conn: Connection) -> None:
    """``rescale_cost_s``: the stall the goodput policy weighs a rescale against."""
    if "rescale_cost_s" not in {c["name"] for c in inspect(conn).get_columns("pool")}:
        conn.execute(text("ALTER TABLE pool ADD COLUMN rescale_cost_s FLOAT NOT NULL DEFAULT 30.0"))


def _v7(conn: Connection) -> None:
    """Adaptive batch: a job's batches and the plan's choice; a lease's gradient statistics."""
    names = {c["name"] for c in inspect(conn).get_columns("jobs")}
    for col, kind in (("batching", "TEXT"), ("plan_batch", "INTEGER NOT NULL DEFAULT 0")):
        if col not in names:
            conn.execute(text(f"ALTER TABLE jobs ADD COLUMN {col} {kind}"))
    names = {c["name"] for c in inspect(conn).get_columns("leases")}
    for col in ("obs_grad_sqr", "obs_grad_var"):
        if col not in names:
            conn.execute(text(f"ALTER TABLE leases ADD COLUMN {col} FLOAT"))


def _v8(conn: Connection) -> None:
    """Tenants: their table, each job's tenant (``default`` for the jobs there were) and DAG."""
    names = {c["name"] for c in inspect(conn).get_columns("jobs")}
    if "tenant" not in names:
        conn.execute(text("ALTER TABLE jobs ADD COLUMN tenant VARCHAR(255) NOT NULL DEFAULT 'default'"))
    if "dag_id" not in names:
        conn.execute(text("ALTER TABLE jobs ADD COLUMN dag_id VARCHAR(255)"))
    metadata.create_all(conn, tables=[tenants], checkfirst=True)


MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [
    (1, _v1), (2, _v2), (3, _v3), (4, _v4), (5, _v5), (6, _v6), (7, _v7), (8, _v8),
]
LATEST = MIGRATIONS[-1][0]


def applied_versions(conn: Connection) -> set[int]:
    if not inspect(conn).has_table("schema_version"):
        return set()
    return set(conn.execute(select(schema_version.c.version)).scalars())


def current_version(conn: Connection) -> int:
    return max(applied_versions(conn), default=0)


def migrate(conn: Connection) -> int:
    """Apply the migrations this ledger lacks, in order, in the caller's (locked) transaction;
    return the new version. Each step is idempotent (it checks what is there), so a ledger
    missing any one of them (restored from a partial backup, edited by hand) gets it."""
    if conn.dialect.name == "postgresql":
        # Serialise concurrent first starts (the pool row may not exist yet to lock).
        conn.execute(text("SELECT pg_advisory_xact_lock(7720331)"))
    done = applied_versions(conn)
    for v, step in MIGRATIONS:
        if v not in done:
            step(conn)
            conn.execute(insert(schema_version).values(version=v, applied=time.time()))
    return LATEST
