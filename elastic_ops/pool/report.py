"""The pool's status as rows, for people: the CLI's tables and the api-server's pool view
show the same columns from the same ``PoolClient.status()`` object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HOST_COLUMNS = ("HOST", "STATE", "SLOTS", "USED", "LABELS")
NODE_COLUMNS = ("HOST", "PID", "VERSION", "CHUNKS", "ADDRESS")
TENANT_COLUMNS = ("TENANT", "GUARANTEED", "MAX", "WEIGHT", "IN USE", "BORROWED", "LENT", "JOBS")
JOB_COLUMNS = (
    "JOB", "STATE", "MIN..MAX", "PRIO", "PREEMPT", "HOSTS", "WORKERS", "TARGET", "EPOCH", "LEASE", "REASON",
)


def text_table(rows: list[list[Any]], header: Sequence[str]) -> str:
    """``rows`` under ``header`` in aligned columns (the CLI's tables)."""
    cells = [header] + [[shown(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def shown(cell: str) -> str:
    """A cell as the terminal may show it: a control character (an escape sequence, a newline
    forging a row) from whatever wrote the value is shown escaped, never acted on."""
    return cell if cell.isprintable() else cell.encode("unicode_escape").decode("ascii")


def summary(st: dict[str, Any]) -> str:
    cfg = st["settings"]
    return (
        f"policy {cfg['policy']} (preemption {cfg['preemption']}), lease ttl {cfg['lease_ttl_s']:g}s; "
        f"slots used {st['slots']['used']} of {st['slots']['up']} up"
    )


def host_rows(st: dict[str, Any]) -> list[list[str]]:
    return [
        [h["name"], h["state"], str(h["slots"]), str(h["used"]),
         ",".join(f"{k}={v}" for k, v in h["labels"].items()) or "-"]
        for h in st["hosts"]
    ]


def has_tenants(st: dict[str, Any]) -> bool:
    """Whether the pool has tenants to show: one registered, or jobs in one that is not (every
    job in ``default`` with no tenant registered: a pool without tenants)."""
    return any(t["name"] != "default" or t["guaranteed"] or t["max_slots"] is not None
               for t in st.get("tenants", ()))


def tenant_rows(st: dict[str, Any]) -> list[list[str]]:
    """The tenants: settings, slots their jobs hold, borrowed beyond the guarantee, lent of it."""
    return [
        [t["name"], str(t["guaranteed"]), "-" if t["max_slots"] is None else str(t["max_slots"]),
         f"{t['weight']:g}", str(t["in_use"]), str(t["borrowed"]), str(t["lent"]), str(t["jobs"])]
        for t in st.get("tenants", ())
    ]


def node_rows(nodes: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The announced node agents (``NodeClient.announced()``); ADDRESS: where the node leads
    chunks spanning hosts (``-``: it trains on its own host only)."""
    return [
        [host, *(str(info.get(k, "?")) for k in ("pid", "version", "chunks")), str(info.get("addr") or "-")]
        for host, info in sorted(nodes.items())
    ]


def unannounced_hosts(st: dict[str, Any], nodes: dict[str, dict[str, Any]]) -> list[str]:
    """The pool's hosts that no node agent announces: in a cluster they get no chunks."""
    return [h["name"] for h in st["hosts"] if h["name"] not in nodes]


def job_rows(st: dict[str, Any]) -> list[list[str]]:
    return [
        [
            j["name"], j["state"], f"{j['min_workers']}..{j['max_workers']}", str(j["priority"]),
            "yes" if j["preemptible"] else "no",
            ",".join(f"{k}={v}" for k, v in sorted(j.get("selector", {}).items())) or "any",
            _workers(j), str(j["target"]), str(j["epoch"]),
            "-" if j["lease_expires_in"] is None else f"{j['lease_expires_in']:.0f}s", str(j["reason"]),
        ]
        for j in st["jobs"]
    ]


def _workers(job: dict[str, Any]) -> str:
    """Slots held, and how many of them it was told to give up (a shrink or a move under way)."""
    going = len(job.get("releasing") or ())
    return f"{job['workers']} ({going} leaving)" if going else str(job["workers"])
