"""The views' charts as SVG, rendered on the server from one :class:`~elastic_ops.timeline.Timeline`:
no chart library and nothing to load, and every label escaped like the rest of the page. Each
series carries ``data-job`` and ``data-workers`` (its value at the end of the range), which the
browser test reads back against the ledger."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence
from html import escape

from elastic_ops.timeline import Point, Timeline

W, H = 900, 240  # the viewBox; the page scales it to its width
LEFT, RIGHT, TOP, BOTTOM = 44, 56, 22, 28
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#86bcb6")


def colour(job: str) -> str:
    """A job's colour, the same on every page and every reload (a hash of its name, not its place)."""
    return PALETTE[int(hashlib.sha256(job.encode()).hexdigest()[:8], 16) % len(PALETTE)]


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S")


class _Frame:
    """Maps (time, value) onto the plot area between ``t0..t1`` and ``0..top``."""

    def __init__(self, t0: float, t1: float, top: float) -> None:
        self.t0, self.t1 = t0, max(t1, t0 + 1.0)
        self.top = max(top, 1.0)

    def x(self, t: float) -> float:
        return round(LEFT + (t - self.t0) / (self.t1 - self.t0) * (W - LEFT - RIGHT), 1)

    def y(self, v: float, top: float | None = None) -> float:
        return round(H - BOTTOM - v / (top or self.top) * (H - TOP - BOTTOM), 1)

    def axes(self, label: str, right: tuple[str, float] | None = None) -> str:
        out = [f'<line class="axis" x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}"/>',
               f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}"/>',
               f'<text class="label" x="4" y="12">{escape(label)}</text>']
        for k in range(5):
            t = self.t0 + (self.t1 - self.t0) * k / 4
            out.append(f'<text class="tick" x="{self.x(t)}" y="{H - 8}" text-anchor="middle">'
                       f"{_clock(t)}</text>")
        step = max(1, round(self.top / 4))
        for v in range(0, int(self.top) + 1, step):
            out.append(f'<text class="tick" x="{LEFT - 6}" y="{self.y(v) + 4}" text-anchor="end">{v}</text>')
        if right:
            name, top = right
            out.append(f'<text class="label" x="{W - RIGHT - 40}" y="12">{escape(name)}</text>')
            for k in range(5):
                v = top * k / 4
                out.append(f'<text class="tick" x="{W - RIGHT + 4}" y="{self.y(v, top) + 4}">{v:.0f}</text>')
        return "".join(out)


def _svg(body: str, title: str, cls: str) -> str:
    return (f'<svg class="chart {cls}" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(title)}" '
            f'xmlns="http://www.w3.org/2000/svg">{body}</svg>')


def _steps(points: Sequence[Point], frame: _Frame, end: float, top: float | None = None) -> str:
    """A step line's ``points`` attribute: each value holds until the next point, the last to ``end``."""
    out: list[str] = []
    for k, (t, v) in enumerate(points):
        nxt = points[k + 1][0] if k + 1 < len(points) else end
        out += [f"{frame.x(t)},{frame.y(v, top)}", f"{frame.x(nxt)},{frame.y(v, top)}"]
    return " ".join(out)


def pool_chart(tl: Timeline) -> str:
    """Slots per job over time, stacked, under the pool's capacity."""
    jobs = sorted(tl.held)
    stamps = sorted({t for pts in tl.held.values() for t, _ in pts} | {tl.start})
    stamps = [t for t in stamps if t <= tl.end]
    cap = max([n for _, n in tl.capacity] + [sum(tl.held_at(j, t) for j in jobs) for t in stamps] + [1])
    frame = _Frame(tl.start, tl.end, cap)
    edges = [*stamps, tl.end]
    body, base = [], [0] * len(stamps)
    for job in jobs:
        values = [tl.held_at(job, t) for t in stamps]
        upper, lower = [], []
        for k, t in enumerate(stamps):
            y0, y1 = base[k], base[k] + values[k]
            upper += [f"{frame.x(t)},{frame.y(y1)}", f"{frame.x(edges[k + 1])},{frame.y(y1)}"]
            lower += [f"{frame.x(t)},{frame.y(y0)}", f"{frame.x(edges[k + 1])},{frame.y(y0)}"]
        base = [b + v for b, v in zip(base, values, strict=True)]
        now = tl.held_at(job, tl.end)
        body.append(f'<polygon class="series" data-job="{escape(job)}" data-workers="{now}" '
                    f'fill="{colour(job)}" points="{" ".join(upper + lower[::-1])}">'
                    f"<title>{escape(job)}: {now} slots now</title></polygon>")
    if tl.capacity:
        body.append(f'<polyline class="capacity" data-capacity="{tl.capacity[-1][1]}" fill="none" '
                    f'points="{_steps(tl.capacity, frame, tl.end)}">'
                    "<title>capacity (slots up)</title></polyline>")
    return _svg(frame.axes("slots") + "".join(body), "slots per job over time", "pool-chart")


def job_chart(tl: Timeline, job: str) -> str:
    """One job's workers over time (steps, left axis) and completed iterations (line, right axis);
    a marker at every change, its reason on hover."""
    held = tl.held.get(job, ())
    prog = tl.progress.get(job, ())
    top = max([n for _, n in held] + [1])
    itop = max([i for _, i in prog] + [1])
    frame = _Frame(tl.start, tl.end, top)
    body = [frame.axes("workers", ("iterations", itop))]
    if held:
        body.append(f'<polyline class="series workers" data-job="{escape(job)}" '
                    f'data-workers="{tl.held_at(job, tl.end)}" fill="none" stroke="{colour(job)}" '
                    f'points="{_steps(held, frame, tl.end)}"/>')
    if prog:
        pts = " ".join(f"{frame.x(t)},{frame.y(i, itop)}" for t, i in prog)
        body.append(f'<polyline class="series iterations" data-job="{escape(job)}" '
                    f'data-iteration="{prog[-1][1]}" fill="none" points="{pts}"/>')
    for c in tl.changes:
        if c.job != job or c.workers is None:
            continue
        y = frame.y(tl.held_at(job, c.ts) if c.kind != "target" else min(c.workers, top))
        body.append(f'<circle class="change {escape(c.kind)}" cx="{frame.x(c.ts)}" cy="{y}" r="4">'
                    f"<title>{_clock(c.ts)} {escape(c.kind)} -> {c.workers}: {escape(c.reason)}</title>"
                    "</circle>")
    return _svg("".join(body), f"workers and iterations of {job}", "job-chart")


def host_cells(hosts: Sequence[dict], owners: dict[tuple[str, int], str]) -> str:
    """Each host's slots as a row of cells, coloured by the job holding each; the host's state
    beside its name (draining, down and cooling hosts are drawn hatched grey)."""
    size, gap, label = 18, 3, 180
    widest = max([int(h["slots"]) for h in hosts] + [1])
    width = label + widest * (size + gap)
    rows = []
    for r, h in enumerate(hosts):
        y = r * (size + gap)
        state = str(h["state"])
        rows.append(f'<text class="host {escape(state)}" x="0" y="{y + 13}">'
                    f'{escape(h["name"])} ({escape(state)})</text>')
        for s in range(int(h["slots"])):
            job = owners.get((h["name"], s))
            fill = colour(job) if job else ("#d0d7de" if state == "up" else "#8c959f")
            tip = f"{h['name']} slot {s}: {job or 'free'}"
            rows.append(f'<rect class="slot{" " + escape(state) if state != "up" else ""}" '
                        f'data-host="{escape(h["name"])}" data-job="{escape(job or "")}" '
                        f'x="{label + s * (size + gap)}" y="{y}" width="{size}" height="{size}" '
                        f'fill="{fill}">'
                        f"<title>{escape(tip)}</title></rect>")
    height = max(1, len(hosts)) * (size + gap)
    return (f'<svg class="hosts" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(rows)}</svg>')


def swatch(job: str) -> str:
    return (f'<svg class="swatch" width="10" height="10" xmlns="http://www.w3.org/2000/svg">'
            f'<rect width="10" height="10" fill="{colour(job)}"/></svg>')
