"""What the job view reads from Airflow's own metadata: a DAG run's chunk tasks, each try of
them, and the result each committed chunk returned (its XCom). Read in the api-server, which
holds the metadata database's session; nothing here writes."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from elastic_ops.utils.jobs import job_id

CHUNK_TASK = re.compile(r"^(?P<group>.+)\.chunk_(?P<index>\d+)_of_(?P<count>\d+)$")
MAX_CHUNKS = 1000  # a run's chunk tasks read at most (a job has a few dozen)


@dataclasses.dataclass(frozen=True)
class TryInfo:
    """One try of a chunk task, as Airflow recorded it."""

    try_number: int
    state: str
    hostname: str
    start: float | None
    end: float | None


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """One chunk task of a run: its tries (oldest first) and, once committed, its result
    (``ChunkTaskResult.to_dict()``)."""

    task_id: str
    group: str
    index: int  # 1-based, as in the task id
    count: int
    state: str
    tries: tuple[TryInfo, ...]
    result: Mapping[str, Any] | None
    total_iterations: int | None = None  # the job's, as the task's rendered spec says

    @property
    def end_ts(self) -> float | None:
        return self.tries[-1].end if self.tries else None


def jobs_of(dag_id: str, run_id: str, chunks: list[ChunkInfo]) -> dict[str, list[ChunkInfo]]:
    """The run's pool jobs (one per elastic training group) and their chunks, in order."""
    out: dict[str, list[ChunkInfo]] = {}
    for c in sorted(chunks, key=lambda c: (c.group, c.index)):
        out.setdefault(job_id(dag_id, c.group, run_id), []).append(c)
    return out


def progress_of(chunks: list[ChunkInfo]) -> list[tuple[float, int]]:
    """Completed iterations over time, from the committed chunks' results."""
    from elastic_ops.timeline import progress_from_results

    done = [c for c in chunks if c.result]
    ends = {int(c.result["chunk_index"]): c.end_ts for c in done if c.end_ts is not None
            and "chunk_index" in c.result}
    return progress_from_results([c.result for c in done], ends)


def _ts(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def read_run(dag_id: str, run_id: str) -> list[ChunkInfo]:
    """The chunk tasks of one DAG run, from Airflow's metadata database."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        tis = session.execute(
            select(TaskInstance.task_id, TaskInstance.try_number, TaskInstance.state, TaskInstance.hostname,
                   TaskInstance.start_date, TaskInstance.end_date)
            .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id,
                   TaskInstance.task_id.like("%.chunk_%"))
            .limit(MAX_CHUNKS)).all()
        history = session.execute(
            select(TaskInstanceHistory.task_id, TaskInstanceHistory.try_number, TaskInstanceHistory.state,
                   TaskInstanceHistory.hostname, TaskInstanceHistory.start_date, TaskInstanceHistory.end_date)
            .where(TaskInstanceHistory.dag_id == dag_id, TaskInstanceHistory.run_id == run_id,
                   TaskInstanceHistory.task_id.like("%.chunk_%"))
            .order_by(TaskInstanceHistory.try_number).limit(MAX_CHUNKS * 10)).all()
        totals = _totals(session, [dag_id], [run_id])
        xcoms = session.execute(
            select(XComModel.task_id, XComModel.value)
            .where(XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.key == "return_value",
                   XComModel.task_id.like("%.chunk_%"))
            .limit(MAX_CHUNKS)).all()
    results = {}
    for row in xcoms:
        value = XComModel.deserialize_value(row)
        if isinstance(value, Mapping):
            results[row.task_id] = value
    tries: dict[str, list[TryInfo]] = {}
    for row in [*history, *tis]:
        if row.try_number:
            tries.setdefault(row.task_id, []).append(TryInfo(
                int(row.try_number), str(row.state or "none"), str(row.hostname or ""),
                _ts(row.start_date), _ts(row.end_date)))
    chunks = []
    for ti in tis:
        m = CHUNK_TASK.match(ti.task_id)
        if not m:
            continue
        mine = {t.try_number: t for t in tries.get(ti.task_id, [])}  # the live row wins its number
        chunks.append(ChunkInfo(ti.task_id, m["group"], int(m["index"]), int(m["count"]),
                                str(ti.state or "none"), tuple(mine[k] for k in sorted(mine)),
                                results.get(ti.task_id), totals.get((dag_id, run_id))))
    return chunks


def _total(rendered: Any) -> int | None:
    """``total_iterations`` from a chunk task's rendered fields (a rendered template is text)."""
    try:
        fields = rendered["spec_fields"]
        if isinstance(fields, str):  # a field Airflow could not keep as JSON is kept as its text
            fields = json.loads(fields)
        value = fields["total_iterations"]
        return int(value) if str(value).isdigit() else None
    except (KeyError, TypeError, ValueError):
        return None


def _totals(session: Any, dag_ids: list[str], run_ids: list[str]) -> dict[tuple[str, str], int]:
    """(DAG id, run id) -> the job's total iterations, from its chunk tasks' rendered fields."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields as Rtif
    from sqlalchemy import select

    rows = session.execute(
        select(Rtif.dag_id, Rtif.run_id, Rtif.rendered_fields)
        .where(Rtif.dag_id.in_(dag_ids), Rtif.run_id.in_(run_ids), Rtif.task_id.like("%.chunk_%"))
        .limit(MAX_CHUNKS)).all()
    out: dict[tuple[str, str], int] = {}
    for row in rows:
        total = _total(row.rendered_fields)
        if total is not None:
            out.setdefault((row.dag_id, row.run_id), total)
    return out


def totals_of(refs: Mapping[str, tuple[str, str]]) -> dict[str, int]:
    """Job name -> total iterations, for jobs given as (DAG id, run id)."""
    from airflow.utils.session import create_session

    if not refs:
        return {}
    with create_session() as session:
        found = _totals(session, sorted({d for d, _ in refs.values()}), sorted({r for _, r in refs.values()}))
    return {job: found[ref] for job, ref in refs.items() if ref in found}


RECENT = 500  # chunk tasks looked at for the pool view's links (the newest)


def recent_jobs() -> dict[str, tuple[str, str]]:
    """Pool job name -> (DAG id, run id), from the newest chunk tasks: the pool view links each
    job to its run's job view."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(TaskInstance.dag_id, TaskInstance.run_id, TaskInstance.task_id)
            .where(TaskInstance.task_id.like("%.chunk_%"))
            .order_by(TaskInstance.start_date.desc().nulls_last()).limit(RECENT)).all()
    out: dict[str, tuple[str, str]] = {}
    for row in rows:
        m = CHUNK_TASK.match(row.task_id)
        if m:
            out.setdefault(job_id(row.dag_id, m["group"], row.run_id), (row.dag_id, row.run_id))
    return out
