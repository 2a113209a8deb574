"""The plugin's two views, rendered on the server: the pool view (``/elastic-ops/ui``, its own
entry in the Airflow UI's navigation) and the job view (``/elastic-ops/ui/job``, a tab of an
elastic job's DAG run). Charts are SVG (:mod:`elastic_ops.plugin.charts`); one small script of
our own (``ui.js``) reloads the page's content every few seconds and sends the controls to the
HTTP API. The Content-Security-Policy allows nothing but this server's own script, style and
requests (and framing by the Airflow UI, same origin); every value from the ledger or from
Airflow is escaped."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import urlencode

from elastic_ops.plugin import charts
from elastic_ops.plugin.runs import ChunkInfo
from elastic_ops.pool import report
from elastic_ops.timeline import Timeline

REFRESH_S = 5
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'self'")
PAGE_SIZE = 50
RANGES = {"15m": 900.0, "1h": 3600.0, "6h": 6 * 3600.0, "24h": 86400.0, "all": None}
DEFAULT_RANGE = "1h"
EVENT_COLUMNS = ("TIME (UTC)", "EVENT", "JOB", "HOST", "WORKERS", "EPOCH", "SLOTS", "REASON")
FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class EventFilter:
    """The event log's filters and page, as the view's query string gives them."""

    job: str = ""
    host: str = ""
    kind: str = ""
    range: str = DEFAULT_RANGE
    page: int = 0

    def query(self, **change: Any) -> str:
        values = {**dataclasses.asdict(self), **change}
        return urlencode({k: v for k, v in values.items() if v not in ("", 0) or k == "range"})


def cell(value: object) -> str:
    """A table cell's text: nothing known is ``-``, never ``None``."""
    return "-" if value is None or value == "" else str(value)


def clock(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], empty: str, cls: str = "",
           raw_last: bool = False) -> str:
    """``rows`` escaped; ``raw_last``: each row's last cell is markup built here (controls)."""
    if not rows:
        return f'<p class="muted">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = [f"<td>{escape(c)}</td>" for c in (row[:-1] if raw_last else row)]
        if raw_last:
            cells.append(f"<td>{row[-1]}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _layout(title: str, body: str, base: str) -> str:
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width"><title>{escape(title)}</title>'
        f'<link rel="stylesheet" href="{base}/ui/static/ui.css">'
        f'<script src="{base}/ui/static/ui.js" defer></script></head>'
        f'<body data-api="{base}" data-refresh="{REFRESH_S}"><p id="eo-error" role="alert" hidden></p>'
        f'<main id="eo-main">{body}</main></body></html>'
    )


# --- controls -----------------------------------------------------------------------------------


def _form(action: str, path: str, fields: str, label: str, confirm: str) -> str:
    """A control: the script sends its fields as JSON to ``path`` after the user confirms."""
    return (f'<form class="control" data-action="{escape(action)}" data-path="{escape(path)}" '
            f'data-confirm="{escape(confirm)}">{fields}<button type="submit">{escape(label)}</button></form>')


def job_controls(job: Mapping[str, Any]) -> str:
    from urllib.parse import quote

    name = str(job["name"])
    path = f"/jobs/{quote(name, safe='')}"
    pre = "false" if job["preemptible"] else "true"
    return "".join([
        _form("priority", f"{path}/priority",
              f'<input name="priority" type="number" min="1" max="1000" value="{int(job["priority"])}" '
              f'aria-label="priority of {escape(name)}">', "Set priority", f"Change the priority of {name}?"),
        _form("bounds", f"{path}/bounds",
              f'<input name="min_workers" type="number" min="1" value="{int(job["min_workers"])}" '
              f'aria-label="min workers of {escape(name)}">'
              f'<input name="max_workers" type="number" min="1" value="{int(job["max_workers"])}" '
              f'aria-label="max workers of {escape(name)}">', "Set min..max",
              f"Change the worker bounds of {name}?"),
        _form("preemptible", f"{path}/preemptible", f'<input name="preemptible" type="hidden" value="{pre}">',
              "Make preemptible" if pre == "true" else "Make not preemptible",
              f"Make {name} {'preemptible' if pre == 'true' else 'not preemptible'}?"),
    ])


def host_controls(host: Mapping[str, Any]) -> str:
    from urllib.parse import quote

    name = str(host["name"])
    path = f"/hosts/{quote(name, safe='')}/state"
    out = []
    for state, label in (("draining", "Drain"), ("up", "Undrain"), ("down", "Mark down")):
        if state != host["state"]:
            out.append(_form("host", path, f'<input name="state" type="hidden" value="{state}">', label,
                             f"{label} host {name}?"))
    return "".join(out)


# --- the pool view --------------------------------------------------------------------------------


def _owners(status: Mapping[str, Any]) -> dict[tuple[str, int], str]:
    return {(str(h), int(s)): j["name"] for j in status["jobs"] for h, s in j.get("placements") or ()}


def _rate(obs: Sequence[Mapping[str, Any]] | None, workers: int | None) -> float | None:
    """Iterations a second at ``workers`` (None: at any count), from what the heartbeats measured."""
    rows = [o for o in obs or () if (workers is None or int(o.get("workers", 0)) == workers)
            and float(o.get("seconds", 0)) > 0]
    its, secs = sum(int(o["iterations"]) for o in rows), sum(float(o["seconds"]) for o in rows)
    return its / secs if secs else None


def _throughput(obs: Sequence[Mapping[str, Any]] | None, workers: int) -> str:
    rate = _rate(obs, workers)
    return f"{rate:.1f} it/s" if rate else "-"


def eta(total: int | None, obs: Sequence[Mapping[str, Any]] | None, workers: int) -> str:
    """Time left at the current rate: (total - iterations the heartbeats reported) / iterations a
    second at the current worker count (or at any, before one was measured). An estimate: a
    retried range is reported twice."""
    rate = _rate(obs, workers) or _rate(obs, None)
    if not total or not rate:
        return "-"
    done = min(total, sum(int(o["iterations"]) for o in obs or ()))
    left = (total - done) / rate
    when = f"{left / 60:.0f} min" if left >= 120 else f"{left:.0f} s"
    return f"~{when} ({done} of {total})"


def _held(job: Mapping[str, Any]) -> str:
    going = len(job.get("releasing") or ())
    return f"{job['workers']} / {job['target']}" + (f" ({going} leaving)" if going else "")


def _job_rows(jobs: Sequence[Mapping[str, Any]], observations: Mapping[str, Any], can_edit: bool,
              job_links: Mapping[str, str], totals: Mapping[str, int]) -> list[list[str]]:
    rows = []
    for j in jobs:
        name = str(j["name"])
        link = job_links.get(name)
        controls = job_controls(j) if can_edit else ""
        if link:
            # _top: the job view is a page of the Airflow UI, not one to open inside this frame
            controls = f'<a class="job-link" href="{escape(link)}" target="_top">job view</a>' + controls
        rows.append([name, str(j["state"]), _held(j), str(j["priority"]),
                     f"{j['min_workers']}..{j['max_workers']}",
                     "yes" if j["preemptible"] else "no", cell(j["reason"]),
                     _throughput(observations.get(name), int(j["workers"])),
                     eta(totals.get(name), observations.get(name), int(j["workers"]))
                     if j["state"] != FINISHED else "-", controls])
    return rows


JOB_HEADER = ("JOB", "STATE", "WORKERS / TARGET", "PRIO", "MIN..MAX", "PREEMPT", "WHY (THE PLAN'S REASON)",
              "THROUGHPUT", "ETA", "")


def event_rows(events: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    return [[clock(e["ts"]), str(e["kind"]), cell(e.get("job")), cell(e.get("host")), cell(e.get("workers")),
             cell(e.get("epoch")), ",".join(f"{h}:{s}" for h, s in e.get("slots") or ()) or "-",
             cell(e.get("reason"))] for e in events]


def filter_events(events: Sequence[Mapping[str, Any]], flt: EventFilter) -> list[Mapping[str, Any]]:
    """Newest first, those of ``flt.host`` (named by the event or holding one of its slots)."""
    return [e for e in reversed(events) if not flt.host or e.get("host") == flt.host
            or any(h == flt.host for h, _ in e.get("slots") or ())]


def _options(name: str, values: Sequence[str], chosen: str, any_label: str = "any") -> str:
    opts = [f'<option value="">{escape(any_label)}</option>'] if any_label else []
    opts += [f'<option value="{escape(v)}"{" selected" if v == chosen else ""}>{escape(v)}</option>'
             for v in values]
    return f'<label>{escape(name)} <select name="{escape(name)}">{"".join(opts)}</select></label>'


def _events_section(events: Sequence[Mapping[str, Any]], flt: EventFilter, status: Mapping[str, Any],
                    kinds: Sequence[str], base: str) -> str:
    rows = filter_events(events, flt)
    page = rows[flt.page * PAGE_SIZE:(flt.page + 1) * PAGE_SIZE]
    form = ('<form class="filters" method="get">'
            + _options("job", sorted(j["name"] for j in status["jobs"]), flt.job)
            + _options("host", sorted(h["name"] for h in status["hosts"]), flt.host)
            + _options("kind", list(kinds), flt.kind)
            + _options("range", list(RANGES), flt.range, any_label="")
            + '<button type="submit">Filter</button></form>')
    nav = []
    if flt.page:
        nav.append(f'<a class="page newer" href="{base}/ui?{escape(flt.query(page=flt.page - 1))}">newer</a>')
    if len(rows) > (flt.page + 1) * PAGE_SIZE:
        nav.append(f'<a class="page older" href="{base}/ui?{escape(flt.query(page=flt.page + 1))}">older</a>')
    first = flt.page * PAGE_SIZE
    shown = (f'<p class="muted">events {first + 1 if page else 0}–{first + len(page)} '
             f'of {len(rows)} (newest first) {" ".join(nav)}</p>')
    return ("<h3>Event log</h3>" + form + shown
            + _table(EVENT_COLUMNS, event_rows(page), "No events match.", "events"))


def _tenants_section(status: dict) -> str:
    """The tenants (guaranteed, in use, borrowed, lent) when the pool has any."""
    if not report.has_tenants(status):
        return ""
    table = _table(report.TENANT_COLUMNS, report.tenant_rows(status), "None.", "tenants")
    return f"<section><h3>Tenants</h3>{table}</section>"


def pool_page(
    status: Mapping[str, Any], timeline: Timeline, events: Sequence[Mapping[str, Any]], flt: EventFilter, *,
    kinds: Sequence[str], observations: Mapping[str, Any], can_edit: bool, base: str,
    nodes: Mapping[str, Any] | None = None, job_links: Mapping[str, str] | None = None,
    totals: Mapping[str, int] | None = None,
) -> str:
    """The pool view for ``PoolClient.status()``, its timeline over the chosen range, and the
    event log (oldest first, already filtered by job, kind and range)."""
    job_links, totals = job_links or {}, totals or {}
    live = [j for j in status["jobs"] if j["state"] != FINISHED]
    done = [j for j in status["jobs"] if j["state"] == FINISHED]
    hosts = status["hosts"]
    host_rows = [[*r, host_controls(h) if can_edit else ""] for r, h in zip(report.host_rows(status), hosts,
                                                                              strict=True)]
    legend = "".join(f'<span class="legend-item">{charts.swatch(j)} {escape(j)}</span>'
                     for j in sorted(timeline.held))
    ranges = " ".join(
        f'<a class="range{" chosen" if r == flt.range else ""}" '
        f'href="{base}/ui?{escape(flt.query(range=r, page=0))}">{escape(r)}</a>' for r in RANGES)
    body = (
        f'<h2>Elastic pool</h2><p class="summary">{escape(report.summary(status))}</p>'
        f'<section class="timeline"><h3>Slots per job</h3><p class="muted">range: {ranges}'
        f'{" (oldest points left out)" if timeline.truncated else ""}</p>{charts.pool_chart(timeline)}'
        f'<p class="legend">{legend}<span class="legend-item capacity-key">- - capacity</span></p></section>'
        f'<section><h3>Hosts</h3>{charts.host_cells(hosts, _owners(status))}'
        + _table((*report.HOST_COLUMNS, ""), host_rows, "No hosts registered.", "hosts", raw_last=True)
        + "</section>"
        + _tenants_section(status)
        + "<section><h3>Running and waiting jobs</h3>"
        + _table(JOB_HEADER, _job_rows(live, observations, can_edit, job_links, totals),
                 "No job is running or waiting.", "jobs", raw_last=True)
        + f'<details class="finished"><summary>Finished jobs ({len(done)})</summary>'
        + _table(JOB_HEADER, _job_rows(done, observations, False, job_links, totals), "None.",
                 "jobs finished-jobs", raw_last=True)
        + "</details></section>"
        + _nodes_section(status, nodes)
        + f"<section>{_events_section(events, flt, status, kinds, base)}</section>"
        + f'<p class="muted">Updates every {REFRESH_S} s. JSON: <code>{base}/status</code>, '
        f"<code>{base}/events</code>, <code>{base}/timeline</code>."
        + ("" if can_edit else " You may read the pool; changing it needs edit permission on the "
           "Airflow pool <code>elastic_ops</code>.") + "</p>"
    )
    return _layout("Elastic pool", body, base)


def _nodes_section(status: Mapping[str, Any], view: Mapping[str, Any] | None) -> str:
    """The cluster's node agents (nothing without cluster settings), and the pool's hosts that
    none announces."""
    if not view or not view.get("cluster"):
        return ""
    if "error" in view:
        return f'<h3>Node agents</h3><p class="muted">{escape(view["error"])}</p>'
    nodes = view["nodes"]
    missing = report.unannounced_hosts(status, nodes)
    note = (f"<p>Pool hosts without a live node agent (they get no chunks): {escape(', '.join(missing))}</p>"
            if missing else "")
    table = _table(report.NODE_COLUMNS, report.node_rows(nodes), "No node agent is live.")
    return "<section><h3>Node agents</h3>" + table + note + "</section>"


# --- the job view ---------------------------------------------------------------------------------


def _metrics(result: Mapping[str, Any] | None) -> str:
    if not result:
        return "-"
    items = [("loss", result.get("loss"))] + sorted((result.get("metrics") or {}).items())
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, int | float) else f"{k} {cell(v)}" for k, v in items
                     if v is not None) or "-"


def chunk_rows(chunks: Sequence[ChunkInfo]) -> list[list[str]]:
    rows = []
    for c in chunks:
        r = c.result or {}
        workers = sorted({int(w) for _, w, _ in r.get("workers_timeline") or ()})
        rows.append([f"{c.index} of {c.count}", c.state,
                     f"{r['start']}..{r['end']}" if r else "-", _metrics(c.result),
                     ",".join(map(str, workers)) or "-",
                     f"{float(r['samples_per_sec']):.0f}" if r.get("samples_per_sec") else "-",
                     cell(r.get("preemptions")), str(len(c.tries))])
    return rows


def try_rows(chunks: Sequence[ChunkInfo]) -> list[list[str]]:
    rows = []
    for c in chunks:
        r = c.result or {}
        timeline = r.get("workers_timeline") or ()
        for t in c.tries:
            last = t is c.tries[-1] and bool(r)
            resumed = (f"iteration {int(timeline[0][0])}" if last and timeline else "-")
            rows.append([f"{c.index} of {c.count}", str(t.try_number), t.state, cell(t.hostname),
                         ",".join(map(str, r.get("epochs") or ())) if last else "-",
                         ",".join(r.get("hosts") or ()) if last else "-", resumed, clock(t.start),
                         clock(t.end)])
    return rows


def checkpoint_rows(chunks: Sequence[ChunkInfo]) -> list[list[str]]:
    return [[f"{c.index} of {c.count}", str(c.result["end"]), cell(c.result.get("checkpoint_uri")),
             cell((c.result.get("param_sha256") or "")[:16])]
            for c in chunks if c.result and c.result.get("checkpoint_uri")]


def change_rows(timeline: Timeline, job: str, limit: int = 100) -> list[list[str]]:
    mine = [c for c in timeline.changes if c.job == job][-limit:]
    return [[clock(c.ts), c.kind, cell(c.workers), cell(c.reason)] for c in reversed(mine)]


def job_section(name: str, job: Mapping[str, Any] | None, timeline: Timeline, chunks: Sequence[ChunkInfo], *,
                can_edit: bool, observations: Sequence[Mapping[str, Any]] | None = None) -> str:
    total = next((c.total_iterations for c in chunks if c.total_iterations), None)
    done = max([int(c.result["end"]) for c in chunks if c.result] + [0])
    state = (f"{escape(str(job['state']))}: {escape(_held(job))} workers, priority {int(job['priority'])}, "
             f"{int(job['min_workers'])}..{int(job['max_workers'])}; {escape(cell(job['reason']))}"
             if job else "not in the pool (not started, or its events were pruned)")
    state += f"; {done} of {total if total else '?'} iterations committed"
    if job and job["state"] != FINISHED:
        workers = int(job["workers"])
        state += (f"; {escape(_throughput(observations, workers))}, "
                  f"ETA {escape(eta(total, observations, workers))}")
    editable = job is not None and can_edit and job["state"] != FINISHED
    controls = f'<div class="controls">{job_controls(job)}</div>' if editable else ""
    return (
        f'<section class="job" data-job="{escape(name)}"><h3>{charts.swatch(name)} {escape(name)}</h3>'
        f'<p class="state">{state}</p>{controls}'
        f"{charts.job_chart(timeline, name)}"
        '<p class="muted legend"><span class="legend-item">— workers (left)</span>'
        '<span class="legend-item iterations-key">— completed iterations (right)</span>'
        "<span class=\"legend-item\">● a change: hover for the plan's reason</span></p>"
        "<h4>Changes and the plan's reasons</h4>"
        + _table(("TIME (UTC)", "EVENT", "WORKERS", "REASON"), change_rows(timeline, name), "No changes yet.",
                 "changes")
        + "<h4>Chunks</h4>"
        + _table(("CHUNK", "STATE", "ITERATIONS", "LOSS / METRICS", "WORKERS", "SAMPLES/S", "PREEMPTIONS",
                  "TRIES"), chunk_rows(chunks), "No chunk task yet.", "chunks")
        + "<h4>Tries</h4>"
        + _table(("CHUNK", "TRY", "STATE", "AIRFLOW HOST", "EPOCHS", "POOL HOSTS", "RESUMED FROM", "STARTED",
                  "ENDED"), try_rows(chunks), "No try yet.", "tries")
        + "<h4>Committed checkpoints</h4>"
        + _table(("CHUNK", "ITERATION", "URI", "PARAMS SHA-256"), checkpoint_rows(chunks), "None yet.",
                 "checkpoints")
        + "</section>"
    )


def job_page(dag_id: str, run_id: str, sections: Sequence[str], base: str) -> str:
    head = (f"<h2>Elastic training of {escape(dag_id)}</h2><p class=\"muted\">run {escape(run_id)} · "
            f'<a href="{base}/ui">the pool</a></p>')
    body = "".join(sections) or '<p class="muted">This run has no elastic training task.</p>'
    return _layout(f"Elastic job · {dag_id}", head + body, base)
