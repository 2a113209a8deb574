"""The validated job spec.

A ``JobSpec`` is frozen and validated when it is built (from Python, a YAML file, Airflow
Params or the CLI): every bad value raises :class:`~elastic_ops.errors.SpecError` naming the
field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_ops.errors import UNSET, SpecError, short_repr
from elastic_ops.urls import shown_url

# matched with fullmatch: a trailing newline is not part of a valid value
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}")
_ENTRY_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
# No '?', '#', whitespace or an encoded NUL: a query or fragment would swallow the '/<run_id>'
# the Airflow layer appends (every DAG run would share one store), and the local path needs a
# name below the root.
_URI_RE = re.compile(
    r"(?!.*%00)(file://(localhost)?/[^?#\s]+|s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^?#\s]*)?)"
)
URI_ALLOWED = (
    "must be a URI 'file:///absolute/path' or 's3://bucket/prefix' (bucket: 3-63 lowercase letters, "
    "digits, '.', '-'; no '?', '#' or spaces)"
)


DEFAULT_TENANT = "default"


def check_tenant(field: str, value: object) -> str:
    """A tenant's name: 1-128 letters, digits, ``_ . -``, starting with a letter or digit."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise SpecError(field, value, "must be a tenant name: 1-128 letters, digits, '_', '.', '-', starting "
                        "with a letter or digit")
    return value


_LABEL_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}")
MAX_SELECTOR_LABELS = 16


def check_host_selector(field: str, value: object) -> dict[str, str]:
    """Host labels a job's hosts must all carry (``{"gpu": "h100"}``): keys of letters, digits,
    ``_ . - /`` (up to 63), printable string values (up to 253), at most 16 pairs."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(field, value, 'must be a mapping of host labels, e.g. {"gpu": "h100"}')
    if len(value) > MAX_SELECTOR_LABELS:
        raise SpecError(field, dict(value), f"must name at most {MAX_SELECTOR_LABELS} labels")
    for key, label in value.items():
        if not isinstance(key, str) or not _LABEL_KEY_RE.fullmatch(key):
            raise SpecError(field, dict(value), f"label name {key!r} must be 1-63 letters, digits, "
                            "'_', '.', '-', '/', starting with a letter or digit")
        if not isinstance(label, str) or len(label) > 253 or not label.isprintable():
            # printable: labels are shown in tables, logs and event reasons (no escape sequences)
            raise SpecError(field, dict(value), f"label {key!r} must have a printable string value of at "
                            f"most 253 characters, not {label!r}")
    return dict(value)


STOP_BOUNDS = ("at_least", "at_most")


def check_stop_when(field: str, value: object) -> dict[str, Any] | None:
    """``{"metric": NAME, "at_least": X}`` or ``{"metric": NAME, "at_most": X}`` (or None): stop
    the job at the first chunk end whose metrics (its ``loss`` or an evaluation metric) meet it."""
    if value is None:
        return None
    allowed = 'a mapping {"metric": NAME, "at_least": X} or {"metric": NAME, "at_most": X}'
    if not isinstance(value, Mapping):
        raise SpecError(field, value, f"must be {allowed}")
    bounds = [k for k in STOP_BOUNDS if k in value]
    unknown = sorted(set(value) - {"metric", *STOP_BOUNDS}, key=str)
    if unknown or len(bounds) != 1:
        extra = f"; unknown key {unknown[0]!r}" if unknown else ""
        raise SpecError(field, dict(value), f"must be {allowed}{extra}")
    metric = value.get("metric")
    if not isinstance(metric, str) or not metric.strip():
        raise SpecError(field, dict(value), "needs a metric: 'loss' or a name evaluate() returns")
    bound = value[bounds[0]]
    if isinstance(bound, bool) or not isinstance(bound, int | float) or not math.isfinite(bound):
        raise SpecError(f"{field}.{bounds[0]}", bound, "must be a finite number")
    return {"metric": metric, bounds[0]: bound}


def stop_reached(stop_when: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None) -> bool:
    """Whether ``metrics`` (a chunk end's: ``loss`` and the evaluation) meet ``stop_when``."""
    if not stop_when or not metrics:
        return False
    value = metrics.get(stop_when["metric"])
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if "at_least" in stop_when:
        return value >= stop_when["at_least"]
    return value <= stop_when["at_most"]


def stop_metric_missing(stop_when: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None) -> str | None:
    """A warning if ``stop_when``'s metric is not among ``metrics`` (a completed chunk's end's):
    a misspelt name would otherwise train the whole job without a word; else None."""
    if not stop_when or stop_when["metric"] in (metrics or {}):
        return None
    names = ", ".join(sorted(metrics or {})) or "none"
    return (f"stop_when.metric {stop_when['metric']!r} is not among this chunk end's metrics ({names}): "
            "the job stops early only where a chunk end reports it (evaluate() gives all but loss)")


def check_host_name(field: str, value: object) -> str:
    """A host name as hostnames go (the pool prints it as ``host:slot`` in events and placements;
    node agents are found by it)."""
    if not isinstance(value, str) or not _HOST_RE.fullmatch(value):
        raise SpecError(
            field, value, "must be 1-255 letters, digits, '_', '.', '-', starting with a letter or digit"
        )
    return value

def check_number(
    field: str, value: object, *, minimum: float, exclusive: bool = False, unit: str = "",
    maximum: float | None = None,
) -> float:
    """``value`` as a finite number >= ``minimum`` (> when ``exclusive``) and <= ``maximum``, or
    :class:`SpecError` naming ``field`` (NaN and inf compare false both ways, so they are refused
    explicitly)."""
    if (
        isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        or value < minimum or (exclusive and value == minimum) or (maximum is not None and value > maximum)
    ):
        op = ">" if exclusive else ">="
        most = "" if maximum is None else f" and <= {maximum:g}"
        raise SpecError(field, value, f"must be a finite number{unit} {op} {minimum:g}{most}")
    return value


def check_checkpoint_uri(field: str, value: object) -> str:
    """``value`` as a checkpoint store URI, or :class:`SpecError` naming ``field``."""
    shown = shown_url(value) if isinstance(value, str) else value  # s3://KEY:SECRET@… is refused, unechoed
    if not isinstance(value, str) or not _URI_RE.fullmatch(value):
        hint = "a file:// URI takes an absolute path: note the three slashes in file:///"
        raise SpecError(field, shown, URI_ALLOWED, hint=hint if str(value).startswith("file://") else None)
    if value.startswith("s3://") and (why := bucket_problem(value[5:].partition("/")[0])):
        raise SpecError(field, shown, URI_ALLOWED, hint=why)
    if why := dot_segment(value):
        raise SpecError(field, shown, URI_ALLOWED, hint=why)
    return value


def dot_segment(uri: str) -> str | None:
    """What is wrong with a store URI's path holding a '.' or '..' segment (None: nothing):
    ``file:///data/store/../../etc`` would write outside the folder it names, and a store is
    known by its URI (two spellings of one folder would be two stores)."""
    from urllib.parse import unquote, urlparse

    path = unquote(urlparse(uri).path)
    if any(part in (".", "..") for part in path.split("/")):
        return "a path without '.' or '..' path segments: give the folder's own path"
    return None


_IP_RE = re.compile(r"\d{1,3}(\.\d{1,3}){3}")


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


def bucket_problem(name: str) -> str | None:
    """What S3's naming rules refuse in a bucket name (None: nothing): S3 answers these only at
    the first request, as InvalidBucketName."""
    if not _BUCKET_RE.fullmatch(name):
        return ("a bucket name has 3-63 lowercase letters, digits, '.' and '-', and starts and ends "
                "with a letter or digit")
    if ".." in name:
        return f"bucket {name!r} has two adjacent periods, which S3 refuses"
    if _IP_RE.fullmatch(name):
        return f"bucket {name!r} is formatted as an IP address, which S3 refuses"
    return None


MAX_WORKERS_LIMIT = 4096
MAX_ITERATIONS = 10**9
MAX_GLOBAL_BATCH = 2**31 - 1
MAX_ADAPTIVE_BATCH = 2**30 - 1  # what a boundary's decision carries (runtime/control.py)
MAX_CHUNKS = 1000  # one Airflow task each


class Consistency(enum.StrEnum):
    """How results may depend on the worker count.

    ``bitwise``: fixed virtual shards reduced in a fixed order; identical to a 1-worker run.
    ``fast``: plain allreduce; equal within floating-point tolerance.
    """

    BITWISE = "bitwise"
    FAST = "fast"


class Scaling(enum.StrEnum):
    """How the batch reacts to the worker count. ``fixed`` (default) keeps the global batch;
    ``linear_lr`` / ``sqrt_lr`` grow it with the workers; ``adaptive`` lets the pool choose it
    per allocation, from ``global_batch`` to ``max_global_batch``, the learning rate following
    the AdaScale gain (docs/runtime.md, "Adaptive batch")."""

    FIXED = "fixed"
    LINEAR_LR = "linear_lr"
    SQRT_LR = "sqrt_lr"
    ADAPTIVE = "adaptive"


class Strategy(enum.StrEnum):
    """How workers combine what they learn. ``allreduce`` (default): every worker holds the whole
    model and the gradients are all-reduced (``consistency`` says how). ``parameter_server``:
    ``servers`` processes hold the parameters in shards with their optimizer state; workers pull
    what their batch needs (an embedding table's touched rows only), push its gradients (sparse
    for embedding tables), and the servers reduce them in a fixed shard order and step
    (docs/runtime.md, "Parameter-server strategy")."""

    ALLREDUCE = "allreduce"
    PARAMETER_SERVER = "parameter_server"


MAX_SERVERS = 64


class Device(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    AUTO = "auto"


def _enum(cls: type[enum.Enum], field: str, value: object) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise SpecError(field, value, f"must be one of {allowed}") from None


def check_int(field: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` as an integer in ``[lo, hi]`` (``hi=None``: no upper bound), or
    :class:`SpecError` naming ``field`` — the one integer check of every layer (spec, pool,
    wire messages, CLI)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise SpecError(field, value, f"must be an integer {rng}")
    return value


MAX_SPEC_BYTES = 1 << 20  # a job spec is a page of YAML; a bigger "spec" is the wrong file


def _read_spec_file(path: Path) -> bytes:
    """The bytes of a spec file: a regular file of at most MAX_SPEC_BYTES. Opened without
    blocking and checked before reading, so a FIFO (which would wait for a writer), a device
    (``/dev/zero``: read until memory ran out) or a folder is refused at once."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            raise SpecError("spec", str(path), f"must be a regular YAML file, not {kind}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError("spec", str(path), f"must be a YAML job spec of at most {MAX_SPEC_BYTES // 1024} KiB",
                        hint="is this the spec file?")
    return data


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything that defines an elastic training job. See docs/reference/spec.md."""

    name: str
    entrypoint: str
    total_iterations: int
    global_batch: int
    chunk_iterations: int | None = None
    min_workers: int = 1
    max_workers: int = 1
    priority: int = 1
    preemptible: bool = True
    consistency: Consistency = Consistency.FAST
    virtual_shards: int | None = None
    micro_batch: int | None = None
    scaling: Scaling = Scaling.FIXED
    max_global_batch: int | None = None  # scaling adaptive: the largest batch the pool may choose
    warmup_iterations: int = 0
    checkpoint: str | None = None
    checkpoint_interval: int | None = None
    keep_last: int = 3
    keep_every: int | None = None
    data_seed: int = 0
    threads_per_worker: int = 1
    device: Device = Device.CPU
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    host_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)  # labels its hosts carry
    tenant: str = DEFAULT_TENANT  # the team whose share of the pool it runs in
    stop_when: Mapping[str, Any] | None = None  # stop at the first chunk end that meets it
    script_args: Sequence[str] = ()  # a script entrypoint's sys.argv[1:]
    strategy: Strategy = Strategy.ALLREDUCE
    servers: int | None = None  # strategy parameter_server: the server processes (default 1)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise SpecError(
                "name", self.name,
                "must be 1-128 characters of letters, digits, '_', '.', '-', starting with a letter or digit",
            )
        self._check_entrypoint()
        check_int("total_iterations", self.total_iterations, 1, MAX_ITERATIONS)
        check_int("global_batch", self.global_batch, 1, MAX_GLOBAL_BATCH)
        chunk = self.total_iterations if self.chunk_iterations is None else self.chunk_iterations
        check_int("chunk_iterations", chunk, 1)
        if chunk > self.total_iterations:
            raise SpecError(
                "chunk_iterations", chunk, f"must be <= total_iterations ({self.total_iterations})"
            )
        chunks = -(-self.total_iterations // chunk)
        if chunks > MAX_CHUNKS:
            raise SpecError(
                "chunk_iterations", chunk,
                f"gives {chunks} chunks of total_iterations {self.total_iterations}; at most {MAX_CHUNKS}",
                hint=f"each chunk is one Airflow task: use chunk_iterations >= "
                f"{-(-self.total_iterations // MAX_CHUNKS)}",
            )
        set_("chunk_iterations", chunk)
        check_int("min_workers", self.min_workers, 1, MAX_WORKERS_LIMIT)
        check_int("max_workers", self.max_workers, 1, MAX_WORKERS_LIMIT)
        if self.min_workers > self.max_workers:
            raise SpecError(
                "min_workers", self.min_workers, f"must be <= max_workers ({self.max_workers})"
            )
        check_int("priority", self.priority, 1, 1000)
        if not isinstance(self.preemptible, bool):
            raise SpecError("preemptible", self.preemptible, "must be true or false")
        set_("consistency", _enum(Consistency, "consistency", self.consistency))
        set_("scaling", _enum(Scaling, "scaling", self.scaling))
        set_("device", _enum(Device, "device", self.device))
        set_("strategy", _enum(Strategy, "strategy", self.strategy))
        self._check_strategy()
        self._check_script_mode()
        self._check_batching()
        check_int("warmup_iterations", self.warmup_iterations, 0, MAX_ITERATIONS)
        if self.warmup_iterations and self.scaling in (Scaling.FIXED, Scaling.ADAPTIVE):
            raise SpecError("warmup_iterations", self.warmup_iterations,
                            f"must be 0 with scaling {self.scaling.value!r} (it ramps the LR of linear_lr / "
                            "sqrt_lr)",
                            hint="use an LR scheduler (build_scheduler) for a warmup")
        if self.checkpoint is not None:
            check_checkpoint_uri("checkpoint", self.checkpoint)
        interval = chunk if self.checkpoint_interval is None else self.checkpoint_interval
        check_int("checkpoint_interval", interval, 1, MAX_ITERATIONS)
        set_("checkpoint_interval", interval)
        check_int("keep_last", self.keep_last, 1, MAX_ITERATIONS)
        if self.keep_every is not None:
            check_int("keep_every", self.keep_every, 1, MAX_ITERATIONS)
        check_int("data_seed", self.data_seed, 0, 2**63 - 1)
        check_int("threads_per_worker", self.threads_per_worker, 1, 256)
        if not isinstance(self.params, Mapping):
            raise SpecError("params", _short(self.params), "must be a mapping of hyperparameters")
        _check_size("params", self.params)
        try:
            json.dumps(dict(self.params), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:  # ValueError: NaN, inf, a cycle
            hint = ("YAML reads 1e999 or a hash like 8e12345 as a number too large for a float: quote "
                    "a value meant as text" if isinstance(exc, ValueError) else None)
            raise SpecError(
                "params", _short(self.params), f"must be JSON-serialisable, numbers finite ({exc})", hint=hint
            ) from None
        set_("params", dict(self.params))
        if not self.is_script():  # against the Trainable's declared parameters, if it is imported here
            from elastic_ops.runtime.entrypoints import check_params_if_imported

            check_params_if_imported(self.entrypoint, self.params)
        set_("host_selector", check_host_selector("host_selector", self.host_selector))
        check_tenant("tenant", self.tenant)
        set_("stop_when", check_stop_when("stop_when", self.stop_when))
        set_("script_args", self._checked_script_args())

    def _check_entrypoint(self) -> None:
        ep = self.entrypoint
        script = isinstance(ep, str) and ep.endswith(".py") and "\n" not in ep
        if not isinstance(ep, str) or not (_ENTRY_RE.fullmatch(ep) or script):
            raise SpecError(
                "entrypoint",
                ep,
                "must be 'package.module:TrainableClass' or a path to a Python script ending in .py",
            )

    @property
    def parameter_server(self) -> bool:
        """Whether the job trains with parameter servers (``strategy: parameter_server``)."""
        return self.strategy is Strategy.PARAMETER_SERVER

    def is_script(self) -> bool:
        """Whether the entrypoint is a DDP-style script (else a Trainable class)."""
        return self.entrypoint.endswith(".py")

    def _checked_script_args(self) -> tuple[str, ...]:
        args = self.script_args
        allowed = (f"must be a list of at most {MAX_SCRIPT_ARGS} strings (the script's sys.argv[1:]), "
                   f"each at most {MAX_SCRIPT_ARG_CHARS} characters without NUL")
        if isinstance(args, str | bytes) or not isinstance(args, Sequence) or len(args) > MAX_SCRIPT_ARGS:
            raise SpecError("script_args", args, allowed)
        for arg in args:
            if not isinstance(arg, str) or len(arg) > MAX_SCRIPT_ARG_CHARS or "\0" in arg:
                raise SpecError("script_args", args, allowed + f"; not {_short(arg, 80)}")
        if args and not self.is_script():
            raise SpecError("script_args", args, "only with a script entrypoint",
                            hint="a Trainable takes its hyperparameters from params")
        return tuple(args)

    def _check_strategy(self) -> None:
        """``servers`` only with the parameter server, and the settings it cannot honour refused
        here, naming the one that conflicts (the sync mode is bitwise by construction: fixed
        virtual shards, reduced in shard order on each server)."""
        if self.strategy is not Strategy.PARAMETER_SERVER:
            if self.servers is not None:
                raise SpecError("servers", self.servers, "only with strategy 'parameter_server'",
                                hint="servers are the parameter-server processes; all-reduce has none")
            return
        servers = 1 if self.servers is None else self.servers
        check_int("servers", servers, 1, MAX_SERVERS)
        object.__setattr__(self, "servers", servers)
        ps = "with strategy 'parameter_server'"
        if self.is_script():
            raise SpecError("strategy", self.strategy.value, "must be 'allreduce' with a script entrypoint",
                            hint="a script reduces its own gradients (e.g. with DDP); the parameter server "
                            "trains a Trainable")
        if self.consistency is not Consistency.BITWISE:
            raise SpecError(
                "consistency", self.consistency.value, f"must be 'bitwise' {ps}",
                hint="its sync mode reduces fixed virtual shards in a fixed order on the servers, bit for "
                "bit like a 1-worker run; an asynchronous (fast) mode is not implemented",
            )
        if self.scaling is not Scaling.FIXED:
            raise SpecError(
                "scaling", self.scaling.value, f"must be 'fixed' {ps}",
                hint="the servers step on the fixed global batch; a batch that grows with the workers or "
                "follows the pool (adaptive) needs the whole gradient in one place, which no process has",
            )
        if self.device is not Device.CPU:
            raise SpecError("device", self.device.value, f"must be 'cpu' {ps}",
                            hint="servers and workers talk over gloo's point-to-point transport, on CPU")

    def _check_script_mode(self) -> None:
        """A script reduces its own gradients (e.g. with DDP) and runs its own forward and backward:
        checked here, not first when a chunk starts training after its wait for workers."""
        if not self.is_script():
            return
        if self.consistency is not Consistency.FAST:
            raise SpecError("consistency", self.consistency.value, "must be 'fast' with a script entrypoint",
                            hint="the script reduces its own gradients (e.g. with DDP)")
        if self.scaling is not Scaling.FIXED:
            raise SpecError("scaling", self.scaling.value, "must be 'fixed' with a script entrypoint",
                            hint="the script sets its own batch and learning rate")
        if self.micro_batch is not None:
            raise SpecError("micro_batch", self.micro_batch, "not with a script entrypoint",
                            hint="the script runs its own forward and backward: accumulate there")

    def _check_batching(self) -> None:
        if self.micro_batch is not None:
            check_int("micro_batch", self.micro_batch, 1, MAX_GLOBAL_BATCH)
        if self.consistency is Consistency.BITWISE:
            shards = self.max_workers if self.virtual_shards is None else self.virtual_shards
            check_int("virtual_shards", shards, 1, MAX_WORKERS_LIMIT)
            if shards < self.max_workers:
                raise SpecError(
                    "virtual_shards", shards, f"must be >= max_workers ({self.max_workers})",
                    hint="every worker needs at least one virtual shard",
                )
            if self.global_batch % shards:
                raise SpecError(
                    "global_batch",
                    self.global_batch,
                    f"must be divisible by virtual_shards ({shards}) in bitwise mode",
                    hint="bitwise mode splits every batch into equal, fixed virtual shards",
                )
            object.__setattr__(self, "virtual_shards", shards)
            if self.scaling in (Scaling.LINEAR_LR, Scaling.SQRT_LR):
                raise SpecError(
                    "scaling", self.scaling.value,
                    "must be 'fixed' or 'adaptive' when consistency is 'bitwise'",
                    hint="a batch that grows with the workers cannot be identical to a 1-worker run",
                )
        elif self.virtual_shards is not None:
            raise SpecError("virtual_shards", self.virtual_shards, "only applies to consistency 'bitwise'")
        self._check_adaptive()
        if self.scaling in (Scaling.LINEAR_LR, Scaling.SQRT_LR) and self.global_batch % self.min_workers:
            raise SpecError(
                "global_batch",
                self.global_batch,
                f"must be divisible by min_workers ({self.min_workers}) with scaling "
                f"{self.scaling.value!r} (the per-worker batch is global_batch / min_workers)",
            )
        if self.global_batch < self.max_workers and self.scaling in (Scaling.FIXED, Scaling.ADAPTIVE):
            raise SpecError(
                "global_batch",
                self.global_batch,
                f"must be >= max_workers ({self.max_workers}) so every worker gets a sample",
                hint=f"or lower max_workers to at most {self.global_batch}",
            )

    def _check_adaptive(self) -> None:
        if self.scaling is not Scaling.ADAPTIVE:
            if self.max_global_batch is not None:
                raise SpecError("max_global_batch", self.max_global_batch, "only with scaling 'adaptive'",
                                hint="it bounds the batch the pool chooses for an adaptive job")
            return
        most = self.max_global_batch
        if most is None:  # each worker at most the base batch
            most = min(self.global_batch * self.max_workers, MAX_ADAPTIVE_BATCH)
        check_int("max_global_batch", most, 1, MAX_ADAPTIVE_BATCH)
        if most < self.global_batch:
            raise SpecError("max_global_batch", most, f"must be >= global_batch ({self.global_batch})",
                            hint="global_batch is the smallest batch an adaptive job trains at")
        object.__setattr__(self, "max_global_batch", most)

    # --- derived values -----------------------------------------------------------------

    def step_batch(self, chosen: int) -> int:
        """The global batch an iteration trains at when the pool chose ``chosen`` (0: none):
        an adaptive job's choice within ``[global_batch, max_global_batch]``, in whole virtual
        shards in bitwise mode; every other job's ``global_batch``."""
        if self.scaling is not Scaling.ADAPTIVE or chosen <= self.global_batch:
            return self.global_batch
        batch = min(int(chosen), int(self.max_global_batch or self.global_batch))
        if self.consistency is Consistency.BITWISE:
            batch -= batch % int(self.virtual_shards or 1)
        return max(batch, self.global_batch)

    @property
    def num_chunks(self) -> int:
        return -(-self.total_iterations // int(self.chunk_iterations or self.total_iterations))

    def chunk_ranges(self) -> list[tuple[int, int]]:
        """The ``[start, end)`` iteration range of every chunk, in order."""
        step = int(self.chunk_iterations or self.total_iterations)
        return [(s, min(s + step, self.total_iterations)) for s in range(0, self.total_iterations, step)]

    def checkpoint_uri(self, root: str | Path = "checkpoints") -> str:
        """The checkpoint URI, defaulting to ``file://<root>/<name>`` (absolute)."""
        if self.checkpoint:
            return self.checkpoint
        return f"file://{(Path(root).resolve() / self.name)}"

    def spec_hash(self) -> str:
        """A hash of the fields that define the training trajectory (not workers or priority).

        Stored in every manifest, so a checkpoint is never resumed by a different job.
        """
        return hashlib.sha256(json.dumps(self.trajectory(), sort_keys=True).encode()).hexdigest()[:16]

    def trajectory(self) -> dict[str, Any]:
        """The fields :meth:`spec_hash` hashes, as plain JSON values."""
        keys = (
            "entrypoint", "global_batch", "consistency", "virtual_shards", "micro_batch",
            "scaling", "warmup_iterations", "data_seed", "params", "total_iterations",
        )
        if self.scaling in (Scaling.LINEAR_LR, Scaling.SQRT_LR):  # the batch and the LR grow from
            keys += ("min_workers",)  # min_workers' (fixed: no hash change, existing checkpoints resume)
        if self.script_args:  # likewise only when given
            keys += ("script_args",)
        if self.strategy is Strategy.PARAMETER_SERVER:  # each server's shard and optimizer state
            keys += ("strategy", "servers")  # (all-reduce jobs' hashes do not change)
        return {k: _plain(getattr(self, k)) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    # --- constructors -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        if not isinstance(data, Mapping):
            raise SpecError("spec", data, "must be a mapping of field names to values")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)  # YAML keys may be numbers, bools, null
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), sorted(known), n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecError(
                "spec", unknown[0], f"unknown field{guess}; known fields: {', '.join(sorted(known))}"
            )
        for required in ("name", "entrypoint", "total_iterations", "global_batch"):
            if required not in data:
                raise SpecError(required, UNSET, "a job spec must set it")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | Path) -> JobSpec:
        import yaml

        p = Path(path)
        try:
            text = _read_spec_file(p).decode("utf-8")
        except OSError as exc:
            raise SpecError("spec", str(path), f"cannot be read ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            why = f"must be UTF-8 text ({exc.reason} at byte {exc.start})"
            raise SpecError("spec", str(path), why) from None
        try:
            data = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise SpecError("spec", str(path), f"is not valid YAML ({exc})") from None
        except SpecError:
            raise  # a key given twice
        except ValueError as exc:  # an integer of over 4,300 digits, a date like 2024-13-01
            why = str(exc).split(";")[0]  # not Python's advice to raise its digit limit
            raise SpecError("spec", str(path), f"holds a value YAML cannot read ({why})",
                            hint="quote a value meant as text") from None
        except RecursionError:
            raise SpecError("spec", str(path), "nests too deeply to be a job spec") from None
        return cls.from_dict(data or {})


def _short(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters (see :func:`elastic_ops.errors.short_repr`)."""
    return short_repr(value, limit)


MAX_SCRIPT_ARGS = 1000
MAX_SCRIPT_ARG_CHARS = 4096
MAX_PARAMS_NODES = 100_000  # values in params, each repetition counted (a YAML alias expands)
MAX_PARAMS_DEPTH = 64


# Keys Airflow's serializers give a meaning to, in a mapping anywhere in the value: serde refuses
# to serialise a dict with __classname__ or __id__, and reads a dict with both __type and __var
# back as an encoded value (params travel in a deferred chunk's trigger kwargs and events).
RESERVED_KEYS = ("__classname__", "__id__")
ENCODED_PAIR = ("__type", "__var")


def _check_keys(field: str, mapping: Mapping) -> None:
    odd = [k for k in mapping if not isinstance(k, str)]
    if odd:  # JSON (the spec hash, a node agent's wire, Airflow's serializers) turns 1 into "1"
        raise SpecError(
            f"{field} key", odd[0], "must be a string: JSON object keys are strings",
            hint="YAML reads an unquoted key like 1, yes or ~ as a number, a bool or null: quote it",
        )
    bad = next((k for k in RESERVED_KEYS if k in mapping), None)
    if bad is None and all(k in mapping for k in ENCODED_PAIR):
        bad = ENCODED_PAIR[0]
    if bad is not None:
        raise SpecError(
            f"{field} key", bad,
            "keys '__classname__' and '__id__' (and '__type' next to '__var') are reserved by Airflow's "
            "serializers, which carry the spec while a chunk waits for workers",
            hint="rename the key",
        )


def _check_size(field: str, value: object) -> None:
    """Refuse a value that would expand past ``MAX_PARAMS_NODES`` values, nest deeper than
    ``MAX_PARAMS_DEPTH`` or contain itself, counting shared parts once per use without
    expanding them (a few lines of YAML anchors can otherwise describe billions of values), or
    that holds a key other than a string or one Airflow's serializers reserve (:func:`_check_keys`)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(v: object, depth: int) -> int:
        if not isinstance(v, Mapping | list | tuple):
            return 1
        key = id(v)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise SpecError(field, _short(value), "must not contain itself")
        if depth > MAX_PARAMS_DEPTH:
            raise SpecError(field, _short(value), f"must nest at most {MAX_PARAMS_DEPTH} levels deep")
        open_.add(key)
        if isinstance(v, Mapping):
            _check_keys(field, v)
        parts = [x for kv in v.items() for x in kv] if isinstance(v, Mapping) else v
        total = 1
        for part in parts:
            total += size(part, depth + 1)
            if total > MAX_PARAMS_NODES:
                raise SpecError(field, _short(value), f"must hold at most {MAX_PARAMS_NODES:,} values "
                                "(counting each repetition of a YAML alias)")
        open_.discard(key)
        sizes[key] = total
        return total

    size(value, 0)


def _unique_key_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """``yaml.safe_load`` that refuses a key given twice (the plain loader keeps the last)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<: *defaults': the mapping merged in is checked on its own
                key = self.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:
                    continue  # the SafeLoader refuses an unhashable key with its own message
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise SpecError("spec", key, f"is given twice (line {line}); give each field once")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    # YAML 1.1 (PyYAML) reads 1e-3 and 5E4 as strings (its floats need a dot and a signed
    # exponent); YAML 1.2, JSON and every ML config reads them as numbers, as users write LRs
    UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))
    return UniqueKeyLoader


_FLOAT_RE = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


def _plain(value: object) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return list(value)
    return value
