"""The pool's status page, served by the plugin at ``/elastic-ops/ui`` and shown in the Airflow
UI (Admin → "Elastic pool status"). Plain HTML, no script: every value from the ledger is escaped, and
the page's Content-Security-Policy allows nothing but its own inline style (and framing by the
Airflow UI, same origin). It reloads itself every few seconds."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from html import escape
from typing import Any

from elastic_ops.pool import report

REFRESH_S = 5
CSP = "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'self'"
EVENT_COLUMNS = ("TIME (UTC)", "EVENT", "JOB / HOST", "WORKERS", "EPOCH", "SLOTS", "REASON")

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1rem; color: #1f2328; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; }
th, td { border-bottom: 1px solid #d0d7de; padding: 0.25rem 0.75rem; text-align: left; }
th { background: #f6f8fa; font-weight: 600; }
td { font-variant-numeric: tabular-nums; }
.muted { color: #59636e; }
"""


def _table(header: Sequence[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _event_rows(events: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for e in reversed(events):  # newest first
        ts = dt.datetime.fromtimestamp(e["ts"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        slots = ",".join(f"{h}:{s}" for h, s in e["slots"])
        rows.append([ts, e["kind"], e["job"] or e["host"] or "-", str(e["workers"]), str(e["epoch"]),
                     slots or "-", e["reason"] or ""])
    return rows


def _nodes_section(status: dict[str, Any], view: dict[str, Any] | None) -> str:
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
    return "<h3>Node agents</h3>" + table + note


def render(status: dict[str, Any], events: list[dict[str, Any]], nodes: dict[str, Any] | None = None) -> str:
    """The page for ``PoolClient.status()``, the newest ``events`` (oldest first) and, in a
    cluster, the node agents (``api._node_view()``)."""
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        f"<title>Elastic pool</title><style>{_STYLE}</style></head><body>"
        f"<h2>Elastic pool</h2><p>{escape(report.summary(status))}</p>"
        "<h3>Hosts</h3>" + _table(report.HOST_COLUMNS, report.host_rows(status), "No hosts registered.")
        + "<h3>Jobs</h3>" + _table(report.JOB_COLUMNS, report.job_rows(status), "No jobs.")
        + _nodes_section(status, nodes)
        + f"<h3>Recent events</h3>{_table(EVENT_COLUMNS, _event_rows(events), 'No events.')}"
        f'<p class="muted">Reloads every {REFRESH_S} s. JSON: <code>/elastic-ops/status</code>, '
        "<code>/elastic-ops/events</code>.</p></body></html>"
    )
