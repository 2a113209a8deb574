"""Workloads and measured application models for the simulator (Pollux artifact traces).

A workload row is ``name,time,application,num_replicas,batch_size`` (and optionally ``tenant``):
a job submitted at ``time`` asking for ``num_replicas`` GPUs at global batch ``batch_size``. Its
length comes from the application traces (``<traces>/<application>/``):

- **iterations** to reach the application's target metric at that global batch, read from
  ``validation-<batch>.csv`` (linear between epochs). The target is the *worst final metric*
  over all measured global batches, so every batch size reaches it (direction — higher or lower
  is better — is read from the curve itself);
- **step time** on ``r`` GPUs at per-GPU batch ``batch / r`` (the global batch stays fixed):
  ``placements.csv`` for up to 16 GPUs packed on 4-GPU nodes (e.g. 6 GPUs = placement ``24``),
  ``scalability.csv`` beyond that (linear between measured replica counts), log-log
  interpolation in the per-GPU batch. A per-GPU batch above the largest measured one is run as
  gradient accumulation (``k`` micro-steps of ``batch / (r k)``); one below the smallest
  measured batch is not allowed, which bounds a job's useful workers (``max_workers``).
  Given the job's real **spread** (GPUs on each node it runs on), the step time is the one
  measured for that spread: ``placements.csv`` holds every spread over up to 4 nodes (``1111``
  = 4 nodes with 1 GPU each, ``13`` = 1 + 3), ``scalability.csv`` replica counts from 6 up on
  6, 8, 12 and 16 nodes (the measured node count nearest the spread's, more nodes on a tie).
  A spread the traces do not cover (nodes of more than 4 GPUs; 5+ nodes for fewer than 6
  GPUs) falls back to the packed estimate.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import functools
import io
import math
import os
import re
from pathlib import Path

from elastic_ops.errors import SpecError
from elastic_ops.pool.scaling import adascale_gain
from elastic_ops.spec import check_tenant

GPUS_PER_NODE = 4
TRACES_ENV = "ELASTIC_OPS_TRACES"


def default_traces_dir() -> Path:
    """``$ELASTIC_OPS_TRACES`` or ``../shared/traces/pollux/traces`` next to the repository."""
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    return repo.parent / "shared" / "traces" / "pollux" / "traces"


@dataclasses.dataclass(frozen=True)
class WorkloadJob:
    name: str
    submit: float
    application: str
    num_replicas: int
    batch_size: int
    tenant: str = "default"  # the optional ``tenant`` column


# Latest arrival a workload may have, in seconds (about 31 years): far beyond any trace, and far
# below where the simulator's clock would stop moving (past ~1e15 s, now + a 60 s tick == now).
MAX_SUBMIT_S = 1e9

# An application is a folder directly in the traces folder: a plain name, never a path.
_APP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_COLUMNS = "name,time,application,num_replicas,batch_size"


def check_application(name: str) -> str:
    """``name`` if it is a plain application name (else a SpecError quoting it as given)."""
    if not _APP_NAME.fullmatch(name):
        raise SpecError(
            "application", name, "must be a plain name: a folder of the traces folder (e.g. cifar10)"
        )
    return name


def read_workload(path: str | Path) -> list[WorkloadJob]:
    """The jobs of a workload CSV by arrival; a bad row, a repeated name or a byte that is not
    UTF-8 is a SpecError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise SpecError("workload", str(path), "must be an existing CSV file")
    jobs: list[WorkloadJob] = []
    first_line: dict[str, int] = {}  # name -> the line it first appears on
    for i, row in enumerate(csv.DictReader(io.StringIO(_decode(path))), start=2):
        try:
            job = _parse_row(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError("workload", f"{path}:{i}", f"rows need {_COLUMNS} ({exc})") from None
        if job.name in first_line:
            # the policies and the metrics know a job by its name: two would be one job twice
            raise SpecError(
                "workload", f"{path}:{i}",
                f"job name {job.name!r} is already used on line {first_line[job.name]}; names must be unique",
            )
        first_line[job.name] = i
        jobs.append(job)
    return sorted(jobs, key=lambda j: (j.submit, j.name))


def _decode(path: Path) -> str:
    """The file's text; an encoding error names the line it is on (a BOM, as spreadsheets write
    one, is dropped)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError("workload", str(path), f"must be a readable CSV file ({exc.strerror})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError(
            "workload", f"{path}:{line}",
            f"must be a UTF-8 text CSV; byte {data[exc.start]:#04x} is not UTF-8",
        ) from None


def _parse_row(row: dict[str, str]) -> WorkloadJob:
    """One workload row; ValueError (KeyError: a missing column) says what is wrong with it."""
    job = WorkloadJob(
        row["name"], float(row["time"]), row["application"], int(row["num_replicas"]), int(row["batch_size"]),
        row.get("tenant") or "default",
    )
    if not job.name:
        raise ValueError("name is empty")
    if not (math.isfinite(job.submit) and 0 <= job.submit <= MAX_SUBMIT_S):
        raise ValueError(f"time {row['time']!r} is not a number of seconds from 0 to {MAX_SUBMIT_S:,.0f}")
    if not _APP_NAME.fullmatch(job.application):
        raise ValueError(f"application {row['application']!r} is not a plain name (a folder of the traces)")
    if job.num_replicas < 1 or job.batch_size < 1:
        raise ValueError("num_replicas and batch_size must be >= 1")
    check_tenant("tenant", job.tenant)
    return job


def _read(path: Path, columns: tuple[str, ...]) -> list[dict[str, float | str]]:
    """The rows of one trace file (numbers but ``placement``); a file that is missing, empty or
    not the measured table is a SpecError about the traces folder."""
    try:
        with path.open(encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in columns if c not in (reader.fieldnames or ())]
            if missing:
                raise ValueError(f"no column {', '.join(missing)}")
            rows = [
                {k: (v if k == "placement" else float(v)) for k, v in row.items() if k in columns}
                for row in reader
            ]
    except FileNotFoundError:
        raise _trace_error(path.parent, f"has no {path.name}") from None
    except (OSError, UnicodeDecodeError, TypeError, ValueError) as exc:
        raise _trace_error(path.parent, f"has an unreadable {path.name} ({exc})") from None
    if not rows:
        raise _trace_error(path.parent, f"has an empty {path.name}")
    return rows


def _missing_application(folder: Path) -> SpecError:
    """Why the traces folder ``folder.parent`` has no application ``folder.name``: the folder is
    not there, it is not a traces folder (no application in it: often the folder above or below
    the right one), or the workload names an application it lacks."""
    traces = folder.parent
    allowed = "a folder of Pollux application traces, one folder per application (cifar10, bert, …)"
    try:
        apps = sorted(p.name for p in traces.iterdir() if (p / "placements.csv").is_file())
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
        if isinstance(exc, FileNotFoundError):
            why = "does not exist"
        return SpecError(
            "traces", str(traces), f"{allowed}: {why}",
            hint="e.g. ../shared/traces/pollux/traces",
        )
    if not apps:
        return SpecError(
            "traces", str(traces), f"{allowed}: holds none (no folder in it has a placements.csv)",
            hint="e.g. ../shared/traces/pollux/traces",
        )
    return SpecError(
        "application", folder.name, f"not in the traces folder {traces}, which has {', '.join(apps)}"
    )


def _trace_error(folder: Path, what: str) -> SpecError:
    """An error about the traces folder: ``folder``, one application's folder in it, ``what``."""
    return SpecError(
        "traces", str(folder.parent), f"Pollux application traces: {folder.name} {what} (each application "
        "folder holds placements.csv, scalability.csv and validation-<batch>.csv)",
    )


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, clamped at the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


Spread = tuple[int, ...]  # GPUs per node a job runs on, ascending


def spread_of(slots) -> Spread:
    """The spread of a job holding ``slots`` (``(host, index)`` pairs)."""
    per_host: dict[str, int] = {}
    for host, _ in slots:
        per_host[host] = per_host.get(host, 0) + 1
    return tuple(sorted(per_host.values()))


def placement_for(r: int) -> str:
    """The packing of ``r`` GPUs on 4-GPU nodes, as the artifact spells it (digits ascending)."""
    full, rest = divmod(r, GPUS_PER_NODE)
    return "".join(sorted(([str(rest)] if rest else []) + [str(GPUS_PER_NODE)] * full))


class Application:
    """Measured step times and convergence of one application."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise _missing_application(folder)
        self.name = folder.name
        curves: dict[str, list[tuple[float, float]]] = {}
        for row in _read(folder / "placements.csv", ("placement", "local_bsz", "step_time")):
            curves.setdefault(str(row["placement"]), []).append(
                (float(row["local_bsz"]), float(row["step_time"]))
            )
        self.by_placement = {p: sorted(v) for p, v in curves.items()}
        # each measured spread once, under its smallest spelling (the traces spell some spreads
        # several ways: the nodes in another order)
        self.by_spread: dict[Spread, str] = {}
        for p in sorted(self.by_placement):
            self.by_spread.setdefault(tuple(sorted(int(c) for c in p)), p)
        scal: dict[int, dict[int, list[tuple[float, float]]]] = {}
        columns = ("num_replicas", "num_nodes", "local_bsz", "step_time")
        for row in _read(folder / "scalability.csv", columns):
            scal.setdefault(int(row["num_replicas"]), {}).setdefault(int(row["num_nodes"]), []).append(
                (float(row["local_bsz"]), float(row["step_time"]))
            )
        # For each replica count keep the tightest packing measured (and every node count).
        self.by_replicas = {r: sorted(nodes[min(nodes)]) for r, nodes in scal.items()}
        self.by_replicas_nodes = {r: {n: sorted(c) for n, c in nodes.items()} for r, nodes in scal.items()}
        self.min_local = min(b for v in self.by_placement.values() for b, _ in v)
        self.max_local = max(b for v in self.by_placement.values() for b, _ in v)
        self.validation: dict[int, list[tuple[float, float]]] = {}
        for f in folder.glob("validation-*.csv"):
            batch = re.fullmatch(r"validation-([0-9]+)\.csv", f.name)
            if batch:  # other files are not the artifact's: leave them
                rows = _read(f, ("iteration", "metric"))
                self.validation[int(batch[1])] = [(float(r["iteration"]), float(r["metric"])) for r in rows]
        if not self.validation:
            raise _trace_error(folder, "has no validation-<batch>.csv")
        self._folder = folder
        smallest = self.validation[min(self.validation)]
        self.higher_is_better = smallest[-1][1] >= smallest[0][1]
        finals = [v[-1][1] for v in self.validation.values()]
        self.target_metric = min(finals) if self.higher_is_better else max(finals)

    def check_batch(self, job: str, batch: int) -> None:
        """A job's global batch lies within what the traces measured: past the largest
        validation batch, step times are extrapolated without bound (a batch of 1e11 made one
        job run for ages of simulated time, re-planned every tick)."""
        most = max(self.validation)
        if batch > most:
            raise SpecError("batch_size", batch, f"job {job!r}: at most {most}, the largest batch the "
                            f"{self.name} traces measured")

    @functools.cache  # noqa: B019 - one Application per process, few keys
    def iterations(self, batch: int) -> float:
        """Iterations to reach the target metric at global batch ``batch`` (nearest measured batch)."""
        b = min(self.validation, key=lambda k: (abs(math.log(k / batch)), k))
        prev_it, prev_m = 0.0, None
        for it, m in self.validation[b]:
            reached = m >= self.target_metric if self.higher_is_better else m <= self.target_metric
            if reached:
                if prev_m is None or m == prev_m:
                    return it
                frac = (self.target_metric - prev_m) / (m - prev_m)
                return prev_it + frac * (it - prev_it)
            prev_it, prev_m = it, m
        return self.validation[b][-1][0]

    @functools.cached_property
    def _statistics(self) -> dict[int, list[tuple[float, float, float, float]]]:
        """Per validation batch, per epoch: (progress at its end, iteration, grad_sqr, grad_var).
        Progress is counted in iterations at the smallest batch (the traces' unit)."""
        out = {}
        columns = ("progress", "iteration", "grad_sqr", "grad_var")
        for batch in self.validation:
            rows = _read(self._folder / f"validation-{batch}.csv", columns)
            out[batch] = [(float(r["progress"]), float(r["iteration"]), float(r["grad_sqr"]),
                           float(r["grad_var"])) for r in rows]
        return out

    @property
    def base_batch(self) -> int:
        """The batch the traces count progress in (their smallest)."""
        return min(self.validation)

    @functools.cache  # noqa: B019
    def epoch_iterations(self, batch: int) -> tuple[float, ...]:
        """The iteration at global ``batch`` (its nearest measured batch) at which each epoch
        ends (:attr:`epoch_ends`): where its gradient statistics change."""
        b = min(self.validation, key=lambda k: (abs(math.log(k / batch)), k))
        progress = [0.0] + [r[0] for r in self._statistics[b]]
        its = [0.0] + [r[1] for r in self._statistics[b]]
        return tuple(_interp(progress, its, p) for p in self.epoch_ends)

    @functools.cached_property
    def epoch_ends(self) -> list[float]:
        """The progress at the end of each epoch (the least over the batches measured, as the
        Pollux artifact counts epochs)."""
        rows = self._statistics.values()
        return [min(r[e][0] for r in rows) for e in range(min(map(len, rows)))]

    @functools.cache  # noqa: B019
    def grad_stats(self, batch: float, epoch: int) -> tuple[float, float]:
        """(grad_sqr, grad_var) during ``epoch`` at global ``batch``, linear between the two
        batches measured around it (clamped at the ends); ``grad_var`` is that of one
        :attr:`base_batch` batch."""
        batches = sorted(self._statistics)
        lo = max([b for b in batches if b <= batch] or batches[:1])
        hi = min([b for b in batches if b >= batch] or batches[-1:])
        a = self._statistics[lo][min(epoch, len(self._statistics[lo]) - 1)]
        b = self._statistics[hi][min(epoch, len(self._statistics[hi]) - 1)]
        if hi == lo:
            return a[2], a[3]
        f = (batch - lo) / (hi - lo)
        return a[2] + f * (b[2] - a[2]), a[3] + f * (b[3] - a[3])

    def gain(self, batch: float, epoch: int) -> float:
        """Progress per iteration at global ``batch`` during ``epoch``, in iterations at
        :attr:`base_batch` (the AdaScale gain)."""
        sqr, var = self.grad_stats(batch, epoch)
        return adascale_gain(sqr, var, batch / self.base_batch)

    def max_workers(self, batch: int, limit: int) -> int:
        """Most GPUs that keep the per-GPU batch at or above the smallest measured one."""
        return max(1, min(limit, int(batch // self.min_local)))

    def _curve_time(self, curve: list[tuple[float, float]], local: float) -> float:
        xs = [math.log(b) for b, _ in curve]
        ys = [math.log(t) for _, t in curve]
        return math.exp(_interp(xs, ys, math.log(local)))

    def _time_at(self, r: int, local: float) -> float:
        if r <= 4 * GPUS_PER_NODE:
            return self._curve_time(self.by_placement[placement_for(r)], local)
        counts = sorted(self.by_replicas)
        if r >= counts[-1]:
            return self._curve_time(self.by_replicas[counts[-1]], local)
        lo = max([c for c in counts if c <= r] or [4 * GPUS_PER_NODE])
        hi = min(c for c in counts if c >= r)
        t_lo = (
            self._curve_time(self.by_replicas[lo], local)
            if lo in self.by_replicas
            else self._curve_time(self.by_placement[placement_for(lo)], local)
        )
        if hi == lo:
            return t_lo
        t_hi = self._curve_time(self.by_replicas[hi], local)
        return t_lo + (t_hi - t_lo) * (r - lo) / (hi - lo)

    def _spread_curve(self, spread: Spread) -> list[tuple[float, float]] | None:
        """The measured step-time curve of ``spread`` (None: not measured)."""
        if len(spread) <= 1:
            return None  # one node: the packed estimate is the measurement
        spelled = self.by_spread.get(spread)
        if spelled is not None:
            return self.by_placement[spelled]
        by_nodes = self.by_replicas_nodes.get(sum(spread))
        if len(spread) <= GPUS_PER_NODE or not by_nodes:
            return None
        nodes = min(by_nodes, key=lambda n: (abs(n - len(spread)), -n))
        return by_nodes[nodes]

    @functools.cache  # noqa: B019
    def step_time(self, r: int, batch: int, spread: Spread | None = None) -> float:
        """Seconds per iteration of global batch ``batch`` on ``r`` GPUs (accumulating if needed),
        packed on 4-GPU nodes, or spread as ``spread`` says (GPUs per node)."""
        local = batch / r
        accum = max(1, math.ceil(local / self.max_local))
        # GPUs per node in any order: the nodes are alike
        curve = self._spread_curve(tuple(sorted(spread))) if spread is not None else None
        if curve is not None:
            return accum * self._curve_time(curve, local / accum)
        return accum * self._time_at(r, local / accum)


@functools.cache
def load_application(traces: str, name: str) -> Application:
    return Application(Path(traces) / check_application(name))


# Global batch a synthetic job of each application uses (the most common choice in the
# artifact's workloads).
SYNTHETIC_BATCH = {
    "cifar10": 2048,
    "ncf": 32768,
    "yolov3": 64,
    "deepspeech2": 320,
    "bert": 384,
    "imagenet": 6400,
}


def synthetic_workload(
    philly_csv: str | Path,
    traces: str | Path,
    *,
    jobs: int,
    seed: int,
    window_h: float = 8.0,
    max_gpus: int = 64,
) -> list[WorkloadJob]:
    """A workload sampled from the Philly trace, like the artifact's: ``jobs`` jobs from a random
    ``window_h``-hour window (``seed`` picks the window and the sample). Each job keeps its
    arrival offset and GPU request, and runs the application whose single-GPU run time at its
    default batch is closest (log scale) to the Philly job's GPU time."""
    import datetime as dt
    import random

    if not isinstance(jobs, int) or jobs < 1:
        raise SpecError("jobs", jobs, "must be an integer >= 1")
    if not Path(philly_csv).is_file():
        raise SpecError(
            "traces", str(traces), f"a traces folder with the Philly trace ({Path(philly_csv).name}) and the "
            "applications' folders", hint="e.g. ../shared/traces/pollux/traces",
        )
    rng = random.Random(seed)
    rows = []
    with Path(philly_csv).open() as f:
        for r in csv.DictReader(f):
            ts = dt.datetime.strptime(r["timestamp"], "%Y-%m-%d %H:%M:%S").timestamp()
            rows.append((ts, float(r["gpu_time"]), int(float(r["num_gpus"]))))
    rows.sort()
    apps = {a: load_application(str(traces), a) for a in SYNTHETIC_BATCH}
    one_gpu = {
        a: app.iterations(SYNTHETIC_BATCH[a]) * app.step_time(1, SYNTHETIC_BATCH[a])
        for a, app in apps.items()
    }
    width = window_h * 3600
    for _ in range(100):
        start = rng.uniform(rows[0][0], rows[-1][0] - width)
        inside = [r for r in rows if start <= r[0] < start + width]
        if len(inside) >= jobs:
            break
    else:
        raise SpecError("jobs", jobs, f"no {window_h:g}-hour window of the Philly trace has that many jobs")
    picked = sorted(rng.sample(inside, jobs))
    out = []
    for i, (ts, gpu_time, gpus) in enumerate(picked):
        app = min(one_gpu, key=lambda a: (abs(math.log(max(gpu_time, 1.0) / one_gpu[a])), a))
        out.append(
            WorkloadJob(
                f"{app}-{i}", round(ts - start, 1), app, max(1, min(gpus, max_gpus)), SYNTHETIC_BATCH[app]
            )
        )
    return out
