"""Naming and run-time spec building shared by the elastic operators (no Airflow imports).

One elastic training group in one DAG run is one pool job, with its own checkpoint prefix, so
two runs of a DAG never resume each other's checkpoints (a scheduled retraining warm-starts from
the previous run's final model instead, explicitly).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from elastic_ops.errors import SpecError
from elastic_ops.spec import JobSpec, Scaling, check_checkpoint_uri, check_number

if TYPE_CHECKING:
    from elastic_ops.pool import PoolClient

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")
_INT_FIELDS = {
    "total_iterations", "global_batch", "chunk_iterations", "min_workers", "max_workers",
    "priority", "virtual_shards", "micro_batch", "warmup_iterations", "checkpoint_interval",
    "keep_last", "keep_every", "data_seed", "threads_per_worker",
}
_NONE_STRINGS = {"", "none", "null"}


def safe_name(text: str, limit: int = 128) -> str:
    """``text`` reduced to the characters a job name allows, short enough, still unique: a name
    that had to change (characters replaced, or cut) ends in a hash of ``text``, so that two
    that differ only where they were changed (run ids ``a:1`` and ``a+1``) stay two names."""
    name = _UNSAFE.sub("_", text).strip("_.-") or "job"
    if name == text and len(name) <= limit:
        return name
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{name[: limit - 17]}-{digest}"


def job_id(dag_id: str, group_id: str, run_id: str) -> str:
    """The pool job of one elastic training group in one DAG run."""
    return safe_name(f"{dag_id}.{group_id}.{run_id}")


def is_template(value: object) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def coerce_rendered(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Turn rendered template strings back into the types the spec wants ("8" -> 8).

    Jinja renders to strings unless the DAG renders native objects; the trigger form's Params
    are already typed and pass through unchanged.
    """
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, str):
            text = value.strip()
            # "200.0": the form's JSON Schema "integer" admits 200.0, and it renders so; ASCII digits
            # only (int() takes any script's, the CLI and the spec do not)
            if key in _INT_FIELDS and (m := re.fullmatch(r"([+-]?[0-9]+)(\.0+)?", text)):
                value = int(m.group(1))
            elif key == "preemptible" and text.lower() in ("true", "false"):
                value = text.lower() == "true"
            elif key in _INT_FIELDS | {"checkpoint"} and text.lower() in _NONE_STRINGS:
                value = None
        out[key] = value
    return out


def run_checkpoint_uri(root: str, run_id: str) -> str:
    return f"{root.rstrip('/')}/{safe_name(run_id)}"


def runtime_spec(
    fields: Mapping[str, Any],
    *,
    name: str,
    checkpoint_root: str,
    run_id: str,
    num_chunks: int | None = None,
) -> JobSpec:
    """The spec one DAG run trains: rendered fields + the run's job name and checkpoint prefix.

    With ``num_chunks`` fixed at parse time (because ``total_iterations`` is a template), the
    chunk size becomes ``ceil(total_iterations / num_chunks)``.
    """
    data = coerce_rendered(fields)
    data["name"] = name
    # checked as the user gave it, before the run's prefix makes the message harder to read
    root = check_checkpoint_uri("checkpoint", data.get("checkpoint") or checkpoint_root)
    data["checkpoint"] = run_checkpoint_uri(root, run_id)
    total = data.get("total_iterations")
    if num_chunks is not None and isinstance(total, int) and not isinstance(total, bool) and total > 0:
        if num_chunks > total:
            raise SpecError("total_iterations", total, f"must be >= the number of chunk tasks ({num_chunks})")
        data["chunk_iterations"] = math.ceil(total / num_chunks)
    return JobSpec.from_dict(data)


def check_conn_ids(elastic_ops_conn_id: object, aws_conn_id: object = None) -> None:
    """The connection ids an operator is given (not templated: checked when the DAG is parsed)."""
    if not isinstance(elastic_ops_conn_id, str) or not elastic_ops_conn_id.strip():
        raise SpecError("elastic_ops_conn_id", elastic_ops_conn_id, "must be a non-empty connection id")
    if aws_conn_id is not None and (not isinstance(aws_conn_id, str) or not aws_conn_id.strip()):
        raise SpecError("aws_conn_id", aws_conn_id, "must be a non-empty connection id, or None")


def check_seconds(field: str, value: object) -> None:
    """An interval an operator or sensor waits (not templated: checked when the DAG is parsed)."""
    check_number(field, value, minimum=0, exclusive=True, unit=" of seconds")


def chunk_range(spec: JobSpec, index: int) -> tuple[int, int]:
    """The ``[start, end)`` of chunk ``index``; an empty range past the last chunk."""
    ranges = spec.chunk_ranges()
    if index < len(ranges):
        return ranges[index]
    return spec.total_iterations, spec.total_iterations


def register(client: PoolClient, spec: JobSpec, dag_id: str | None = None) -> None:
    """Register (or update) ``spec``'s demand with the pool (``dag_id``: the DAG it comes from)."""
    client.submit(
        spec.name, min_workers=spec.min_workers, max_workers=spec.max_workers,
        priority=spec.priority, preemptible=spec.preemptible, selector=spec.host_selector,
        batching=batching_of(spec), tenant=spec.tenant, dag_id=dag_id,
    )


def batching_of(spec: JobSpec) -> dict[str, int] | None:
    """The batches an adaptive job lets the pool choose from (``PoolClient.submit``'s
    ``batching``; None: a fixed batch): ``global_batch`` to ``max_global_batch`` (the runtime
    rounds a bitwise job's down to whole virtual shards: ``JobSpec.step_batch``)."""
    if spec.scaling is not Scaling.ADAPTIVE:
        return None
    return {"base": spec.global_batch, "most": int(spec.max_global_batch or spec.global_batch),
            "per_worker": 1}
