"""``elastic_training(...)``: one call in a DAG → a task group register → chunk × N → finalize,
and an ``end_job`` teardown.

Every argument is validated when the DAG is parsed (a bad value raises ``SpecError`` naming the
field, the value and what is allowed). Worker bounds, priority, checkpoint, total iterations and
any spec field not in ``_STATIC`` may be Jinja templates (e.g. ``"{{ params.max_workers }}"`` from
the trigger form); those are validated again when the task renders them. The number of chunk
tasks is fixed at parse time: it is ``ceil(total_iterations / chunk_iterations)``, or
``num_chunks`` when ``total_iterations`` is a template.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from airflow.sdk import Asset, TaskGroup
from airflow.sdk.definitions._internal.contextmanager import DagContext
from airflow.sdk.definitions._internal.node import validate_group_key

from elastic_ops.errors import SpecError
from elastic_ops.hooks.elastic_ops import CHECKPOINT_DIR, DEFAULT_CONN_ID, airflow_home
from elastic_ops.operators.chunk import WARM_START_PREVIOUS, ElasticChunkOperator, check_tracking
from elastic_ops.operators.lifecycle import (
    ElasticEndJobOperator,
    ElasticFinalizeOperator,
    ElasticRegisterOperator,
)
from elastic_ops.spec import MAX_CHUNKS, Device, JobSpec, Scaling, check_checkpoint_uri
from elastic_ops.tracking.api import Tracking
from elastic_ops.utils.jobs import is_template, safe_name

# Fields that cannot be templates: they decide the task structure or the training trajectory.
_STATIC = ("entrypoint", "chunk_iterations", "global_batch", "consistency", "data_seed", "strategy",
           "servers")
# Fields a template can give only where the DAG renders native objects (Jinja renders a string)
_STRUCTURED = {"params": "mapping", "host_selector": "mapping", "stop_when": "mapping",
               "script_args": "list"}


def _placeholder(field: str, fields: dict[str, Any], num_chunks: int | None) -> Any:
    """A valid stand-in for a templated field, so the other fields can be checked at parse time."""
    concrete = lambda k, d: d if is_template(fields.get(k)) or fields.get(k) is None else fields[k]  # noqa: E731
    if field == "max_workers":
        return max(1, concrete("min_workers", 1))
    if field == "total_iterations":
        return max(num_chunks or 1, 1) * max(1, concrete("chunk_iterations", 1))
    # the field's default (keep_last 3, params {}, device 'cpu', …): None was no valid stand-in for
    # most, and the parse failed as "invalid keep_last=None", quoting no value the user gave
    spec_field = next((f for f in dataclasses.fields(JobSpec) if f.name == field), None)
    if spec_field is None:
        return None  # not a spec field: the spec names it as unknown
    if spec_field.default_factory is not dataclasses.MISSING:
        return spec_field.default_factory()
    return None if spec_field.default is dataclasses.MISSING else spec_field.default


# a templated field of few values: every value it may render to is a stand-in (its default first)
_CHOICES: dict[str, tuple[Any, ...]] = {
    "scaling": tuple(m.value for m in Scaling), "device": tuple(m.value for m in Device),
    "preemptible": (True, False),
}


def _check_with_stand_ins(concrete: dict[str, Any], templated: list[str]) -> JobSpec:
    """The spec of ``concrete``, where each templated field holds its stand-in; a field of few
    values (scaling, device, preemptible) is tried with each, so that a rule between it and a
    value given outright (``warmup_iterations`` needs a scaling other than ``fixed``) refuses
    the DAG only if no value the template can render to passes. The error of the defaults says
    which stand-ins it was checked with."""
    varied = [f for f in templated if f in _CHOICES]
    errors: list[SpecError] = []
    for values in itertools.product(*(_CHOICES[f] for f in varied)):  # the defaults' first
        try:
            return JobSpec.from_dict(concrete | dict(zip(varied, values, strict=True)))
        except SpecError as exc:
            errors.append(exc)
    first = errors[0]
    stand_ins = [f for f in templated if f not in ("max_workers", "total_iterations")]
    if not stand_ins:
        raise first
    shown = ", ".join(f"{f}={getattr(concrete[f], 'value', concrete[f])!r}" for f in stand_ins)  # an enum's
    raise type(first)(
        first.field, first.value, first.allowed,
        hint="; ".join(h for h in (first.hint, f"checked at parse time with {shown} in place of the "
                                   + ("template" if len(stand_ins) == 1 else "templates")) if h),
    ) from None


def validate_fields(fields: dict[str, Any], num_chunks: int | None) -> tuple[JobSpec, int]:
    """Parse-time check of the spec fields; returns the (placeholder-filled) spec and chunk count."""
    for field in _STATIC:
        if is_template(fields.get(field)):
            raise SpecError(field, fields[field], "cannot be a template: it is fixed when the DAG is parsed")
    templated = [k for k, v in fields.items() if is_template(v)]
    if "total_iterations" in templated and num_chunks is None:
        raise SpecError(
            "num_chunks", None,
            "is required when total_iterations is a template (the chunk tasks are created at parse time)",
        )
    if num_chunks is not None and (isinstance(num_chunks, bool) or not isinstance(num_chunks, int)
                                   or num_chunks < 1):
        raise SpecError("num_chunks", num_chunks, "must be an integer >= 1")
    if num_chunks is not None and num_chunks > MAX_CHUNKS:
        raise SpecError("num_chunks", num_chunks, f"must be <= {MAX_CHUNKS} (one Airflow task each)")
    if num_chunks is not None and fields.get("chunk_iterations") is not None:
        raise SpecError(
            "chunk_iterations", fields["chunk_iterations"],
            f"cannot be combined with num_chunks ({num_chunks})",
            hint="give one of them: num_chunks decides the chunk size when total_iterations is a template",
        )
    concrete = dict(fields)
    for field in templated:
        concrete[field] = _placeholder(field, fields, num_chunks)
    if num_chunks is not None:
        concrete.pop("chunk_iterations", None)
    spec = _check_with_stand_ins(concrete, templated)
    if num_chunks is None:
        return spec, spec.num_chunks
    if "total_iterations" not in templated and num_chunks > spec.total_iterations:
        raise SpecError("num_chunks", num_chunks, f"must be <= total_iterations ({spec.total_iterations})")
    if "total_iterations" not in templated:
        return spec, math.ceil(spec.total_iterations / math.ceil(spec.total_iterations / num_chunks))
    return spec, num_chunks


def _check_warm_start(value: object) -> None:
    if value is None or value == WARM_START_PREVIOUS:
        return
    allowed = f"must be a checkpoint URI (as the spec's checkpoint) or {WARM_START_PREVIOUS!r}"
    if not isinstance(value, str) or is_template(value):
        raise SpecError("warm_start", value, allowed + ", not a template")
    try:
        check_checkpoint_uri("warm_start", value)
    except SpecError as exc:
        raise SpecError("warm_start", value, allowed, hint=exc.allowed) from None


# what the group sets on each chunk task itself (a chunk_kwargs key among them was a raw
# "got multiple values" TypeError)
GROUP_SET = ("task_id", "chunk_index", "warm_start", "spec_fields", "group_id", "num_chunks",
             "elastic_ops_conn_id", "aws_conn_id", "tracking")


def _check_chunk_kwargs(chunk_kwargs: object) -> None:
    if chunk_kwargs is None:
        return
    if not isinstance(chunk_kwargs, dict):
        raise SpecError("chunk_kwargs", chunk_kwargs, "must be a dict of BaseOperator arguments "
                        "(e.g. {'retries': 5, 'pool': 'gpu'})")
    for key in GROUP_SET:
        if key in chunk_kwargs:
            raise SpecError(f"chunk_kwargs[{key!r}]", chunk_kwargs[key], "is set by elastic_training itself",
                            hint=None if key in _INTERNAL else f"pass {key}= to elastic_training")
    retries = chunk_kwargs.get("retries")
    if isinstance(retries, int) and not isinstance(retries, bool) and retries < 0:
        raise SpecError("chunk_kwargs['retries']", retries, "must be >= 0")


_INTERNAL = ("task_id", "chunk_index", "spec_fields", "group_id")
TENANT_TAG = "tenant:"  # a DAG tag naming the tenant of its elastic jobs (tenant= overrides it)


def elastic_training(
    task_id: str,
    trainable: str,
    total_iterations: int | str,
    chunk_iterations: int | None = None,
    min_workers: int | str = 1,
    max_workers: int | str = 1,
    priority: int | str = 1,
    checkpoint: str | None = None,
    *,
    global_batch: int = 64,
    num_chunks: int | None = None,
    warm_start: str | None = None,
    model_asset: Asset | None = None,
    elastic_ops_conn_id: str = DEFAULT_CONN_ID,
    aws_conn_id: str | None = "aws_default",
    chunk_kwargs: dict[str, Any] | None = None,
    tracking: Tracking | None = None,
    **spec: Any,
) -> TaskGroup:
    """Build the task group that trains ``trainable`` elastically.

    :param trainable: ``"package.module:TrainableClass"`` (or a script path).
    :param checkpoint: ``file://…`` or ``s3://bucket/prefix``; each DAG run trains under its own
        ``<checkpoint>/<run_id>`` prefix. Default:
        ``file://$AIRFLOW_HOME/elastic_ops_checkpoints/<dag_id>/<task_id>``.
    :param num_chunks: the number of chunk tasks, instead of ``chunk_iterations`` (required when
        ``total_iterations`` is a template; giving both is an error).
    :param warm_start: a checkpoint URI, or ``"previous"``: the model of the latest event of
        ``model_asset`` (scheduled retraining continues from the last run's final model).
    :param model_asset: the Asset finalize emits (default: named after the DAG and group).
    :param chunk_kwargs: extra ``BaseOperator`` arguments for the chunk tasks (retries, pool, …).
    :param tracking: record the job in an experiment tracker, e.g.
        ``elastic_ops.tracking.MlflowTracking(experiment="digits")`` (docs/howto/mlflow.md).
    :param spec: any other ``JobSpec`` field (consistency, params, preemptible, data_seed,
        tenant, …). Without ``tenant``, a DAG tag ``tenant:NAME`` names it (else ``default``).
    """
    try:  # the group's id (Airflow's TypeError or ValueError otherwise, from safe_name or TaskGroup)
        validate_group_key(task_id)
    except (TypeError, ValueError):
        raise SpecError("task_id", task_id, "must be 1-200 letters, digits, '_' or '-' (the task group's "
                        "id)") from None
    dag = DagContext.get_current()
    dag_id = dag.dag_id if dag is not None else "no_dag"
    fields: dict[str, Any] = {
        "name": safe_name(task_id), "entrypoint": trainable, "total_iterations": total_iterations,
        "chunk_iterations": chunk_iterations, "min_workers": min_workers, "max_workers": max_workers,
        "priority": priority, "checkpoint": checkpoint, "global_batch": global_batch, **spec,
    }
    if "name" in spec:
        raise SpecError("name", spec["name"], "is set by elastic_training: <dag_id>.<task_id>.<run_id>")
    if "tenant" not in spec and dag is not None:  # the DAG's tag `tenant:NAME` names the team
        tagged = sorted(t.split(":", 1)[1] for t in (getattr(dag, "tags", None) or ())
                        if isinstance(t, str) and t.startswith(TENANT_TAG))
        if len(tagged) > 1:
            raise SpecError("tags", sorted(TENANT_TAG + t for t in tagged),
                            "at most one tenant:NAME tag per DAG", hint="or pass tenant= to elastic_training")
        if tagged:
            fields["tenant"] = tagged[0]
    native = dag is None or bool(getattr(dag, "render_template_as_native_obj", False))
    for field in _STRUCTURED:
        if is_template(spec.get(field)) and not native:  # it passed here and failed the register task
            raise SpecError(
                field, spec[field], f"a template renders to a string here, not the {_STRUCTURED[field]} "
                f"{field} must be (the DAG does not render native objects)",
                hint="DAG(..., render_template_as_native_obj=True) renders a template to the value itself",
            )
    if "entrypoint" in spec:  # it would replace trainable= in the fields above, silently
        raise SpecError(
            "entrypoint", spec["entrypoint"], f"is given as trainable= here (trainable={trainable!r})",
        )
    _check_warm_start(warm_start)
    if model_asset is not None and not isinstance(model_asset, Asset):
        raise SpecError("model_asset", model_asset, "must be an airflow.sdk.Asset (or None: one named after "
                        "the DAG and group)")
    if warm_start == WARM_START_PREVIOUS and model_asset is None and is_template(checkpoint):
        raise SpecError(  # the default Asset's URI is the checkpoint root, unknown until a run renders it
            "model_asset", None, "an Asset whose URI holds the rendered checkpoints, with "
            "warm_start='previous' and a templated checkpoint",
            hint="e.g. model_asset=Asset(name='digits-model', uri='s3://models/digits')",
        )
    _check_chunk_kwargs(chunk_kwargs)
    check_tracking(tracking, trainable)
    _, n_chunks = validate_fields(fields, num_chunks)
    fields = {k: v for k, v in fields.items() if k != "name"}
    with TaskGroup(group_id=task_id, tooltip=f"elastic training of {trainable}") as group:
        # the full id ("parent.train" inside another group): two groups named alike in one DAG
        # must not share a pool job, a checkpoint root or a model Asset
        full_id = group.group_id or task_id
        if model_asset is None:
            default_root = airflow_home() / CHECKPOINT_DIR / safe_name(dag_id)
            default_root = default_root / safe_name(full_id)
            root = checkpoint if checkpoint and not is_template(checkpoint) else f"file://{default_root}"
            model_asset = Asset(name=f"{dag_id}.{full_id}.model", uri=root, group="model")
        common = {"spec_fields": fields, "group_id": full_id, "num_chunks": num_chunks,
                  "elastic_ops_conn_id": elastic_ops_conn_id, "aws_conn_id": aws_conn_id,
                  "tracking": tracking}
        register = ElasticRegisterOperator(task_id="register", **common)
        chunks = []
        for i in range(n_chunks):
            extra = dict(chunk_kwargs or {})
            if i == 0 and warm_start == WARM_START_PREVIOUS:  # the user's inlets stay
                theirs = extra.get("inlets") or []
                extra["inlets"] = [*(theirs if isinstance(theirs, list | tuple) else [theirs]), model_asset]
            chunks.append(ElasticChunkOperator(
                task_id=f"chunk_{i + 1:02d}_of_{n_chunks:02d}", chunk_index=i,
                warm_start=warm_start if i == 0 else None, **common, **extra,
            ))
        finalize = ElasticFinalizeOperator(
            task_id="finalize", chunk_task_ids=[c.task_id for c in chunks], outlets=[model_asset], **common,
        )
        prev = register
        for task in [*chunks, finalize]:
            prev >> task
            prev = task
        # a teardown: it runs once the rest is done in any state (a chunk killed on its last try
        # ends nothing itself), is left out of the run's state and out of `group >> downstream`.
        # Downstream of every chunk too: a chunk cleared on its own (Airflow clears the setup and
        # the teardown with it, not finalize) must be done before the job is ended
        end_job = ElasticEndJobOperator(task_id="end_job", heartbeat_interval=chunks[0].heartbeat_interval,
                                        **common)
        [*chunks, finalize] >> end_job.as_teardown(setups=register)
    group.model_asset = model_asset  # type: ignore[attr-defined] - for DAG authors wiring Assets
    return group
