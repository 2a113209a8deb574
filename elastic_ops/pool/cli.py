"""``elastic-ops pool …`` and ``elastic-ops simulate …`` subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from elastic_ops.pool import report
from elastic_ops.pool.api import EventKind
from elastic_ops.pool.api_client import ENV_API_PASSWORD, ENV_API_TOKEN, ENV_API_URL, ENV_API_USER
from elastic_ops.pool.client import ENV_URL


def add_commands(sub: argparse._SubParsersAction) -> None:
    pool = sub.add_parser("pool", help="inspect and control the resource pool ledger")
    pool.add_argument("--pool-url", default=None, help=f"SQLAlchemy URL of the ledger (default: ${ENV_URL})")
    pool.add_argument(
        "--api-url", default=None,
        help=f"instead of the ledger, Airflow's api-server (its elastic_ops routes; default: "
        f"${ENV_API_URL} when no ledger URL is set); token from ${ENV_API_TOKEN}, or "
        f"${ENV_API_USER} and ${ENV_API_PASSWORD}",
    )
    psub = pool.add_subparsers(dest="pool_command", required=True)

    p = psub.add_parser("status", help="hosts, slots, jobs, leases and targets")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_status, reads_only=True)

    p = psub.add_parser("set-priority", help="change a job's priority (re-plans at once)")
    p.add_argument("job")
    p.add_argument("priority", type=int)
    _prints_change(p, lambda c, a: c.set_priority(a.job, a.priority), job_change)

    p = psub.add_parser("set-bounds", help="change a job's min/max workers (re-plans at once)")
    p.add_argument("job")
    p.add_argument("min_workers", type=int)
    p.add_argument("max_workers", type=int)
    _prints_change(p, lambda c, a: c.set_bounds(a.job, a.min_workers, a.max_workers), job_change)

    p = psub.add_parser("set-preemptible", help="allow or forbid preempting a job")
    p.add_argument("job")
    p.add_argument("preemptible", choices=["true", "false"])
    _prints_change(p, lambda c, a: c.set_preemptible(a.job, a.preemptible == "true"), job_change)

    p = psub.add_parser("set-selector", help="the labels a job's hosts must carry (none: any host)")
    p.add_argument("job")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    _prints_change(p, lambda c, a: c.set_selector(a.job, parse_labels(a.label)), job_change)
    p.set_defaults(flag_aliases={"selector": "--label"})

    p = psub.add_parser("drain", help="no new grants on HOST; its jobs move off at their next boundary")
    p.add_argument("host")
    _prints_change(p, lambda c, a: c.drain_host(a.host), host_change)

    p = psub.add_parser("set-host-state", help="set a host's state: up, draining, down, cooling")
    p.add_argument("host")
    p.add_argument("state", choices=["up", "draining", "down", "cooling"])
    _prints_change(p, lambda c, a: c.set_host_state(a.host, a.state), host_change)

    p = psub.add_parser("add-host", help="register (or re-enable) a host with SLOTS slots")
    p.add_argument("host")
    p.add_argument("slots", type=int)
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    _prints_change(p, lambda c, a: c.add_host(a.host, a.slots, parse_labels(a.label)), host_change)
    p.set_defaults(flag_aliases={"labels": "--label"})

    p = psub.add_parser("add-tenant", help="register (or change) a tenant: a team with guaranteed slots")
    p.add_argument("tenant")
    p.add_argument("--guaranteed", type=int, required=True, metavar="N",
                   help="slots it gets whenever its jobs can use them (reclaimed from borrowers)")
    p.add_argument("--max", type=int, default=None, metavar="M", dest="max_slots",
                   help="the most it may hold, borrowing included (default: no limit)")
    p.add_argument("--weight", type=float, default=1.0, metavar="W",
                   help="its share of idle capacity lent to tenants wanting more (default: %(default)s)")
    _prints_change(p, lambda c, a: c.add_tenant(a.tenant, guaranteed=a.guaranteed, max_slots=a.max_slots,
                                                weight=a.weight), tenant_change)

    p = psub.add_parser("remove-tenant", help="remove a tenant no unfinished job belongs to")
    p.add_argument("tenant")
    _prints_change(p, lambda c, a: c.remove_tenant(a.tenant), tenant_change)

    p = psub.add_parser("configure", help="pool-wide settings (policy, preemption, ttl, anti-thrashing)")
    p.add_argument("--policy")
    p.add_argument("--preemption", choices=["none", "graceful"])
    for name in ("lease-ttl-s", "min-rescale-interval-s", "min-gain", "aging-s", "job-idle-s", "cooling-s",
                 "plan-interval-s", "plan-refresh-s", "rescale-cost-s"):
        p.add_argument(f"--{name}", type=float)
    p.add_argument("--failure-threshold", type=int)
    p.set_defaults(func=_configure)

    p = psub.add_parser(
        "planner", help="run the pool's planner as a service: plans whenever one is due (optional: "
        "clients plan without it)",
    )
    p.add_argument("--once", action="store_true", help="run one plan now, print the planner's state, exit")
    p.add_argument("--poll-s", type=float, default=None,
                   help="seconds between checks for a due plan (default: the pool's plan_interval_s)")
    p.set_defaults(func=_planner)

    p = psub.add_parser("events", help="the event log (grants, grows, shrinks, releases, expiries, hosts)")
    p.add_argument("--job", default=None)
    p.add_argument("--last", type=int, default=None, metavar="N", help="only the newest N events")
    p.add_argument("--since", default=None, metavar="WHEN",
                   help="only events since WHEN: a duration back from now (90s, 30m, 2h, 1d) or an ISO "
                   "8601 time (2026-12-03T10:00, UTC unless it says)")
    p.add_argument("--kind", action="append", default=None, metavar="KIND",
                   help="only events of KIND (repeat, or comma-separated): "
                   + ", ".join(k.value for k in EventKind))
    p.add_argument("--follow", action="store_true",
                   help="after the events so far, print new ones as they come (until Ctrl-C)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=_events, reads_only=True)

    p = psub.add_parser("usage", help="slot-hours per job and per host, from the event log")
    p.add_argument("--hours", type=float, default=None, help="the last H hours (default: the whole log)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_usage, reads_only=True)

    p = psub.add_parser(
        "prune-events", help="delete events older than DAYS (a job holding a lease keeps its events)"
    )
    p.add_argument("--older-than-days", type=float, required=True, metavar="DAYS")
    p.set_defaults(func=_prune_events)

    sim = sub.add_parser("simulate", help="replay a workload trace through the pool policies")
    src = sim.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", help="workload CSV (name,time,application,num_replicas,batch_size)")
    src.add_argument("--synthetic", type=int, metavar="N", help="sample N jobs from the Philly trace instead")
    sim.add_argument("--seed", type=int, default=0,
                     help="with --synthetic: which window and sample (default: %(default)s)")
    sim.add_argument("--slots", type=int, default=64, help="slots in the pool (default: %(default)s)")
    sim.add_argument("--slots-per-host", type=int, default=4, help="slots per host (default: %(default)s)")
    sim.add_argument("--policy", default="all",  # checked by the simulator (the policies load late)
                     help="a registered policy, 'static', or 'all' (default: %(default)s)")
    sim.add_argument("--preemption", default="graceful", choices=["none", "graceful"],
                     help="preemption (default: %(default)s)")
    sim.add_argument("--rescale-cost", type=float, default=30.0,
                     help="seconds lost per rescale (default: %(default)s)")
    sim.add_argument(
        "--placement", default="actual", choices=["actual", "packed"],
        help="step times for each job's real spread over hosts (default), or as if tightly packed",
    )
    sim.add_argument("--replan-interval", type=float, default=60.0,
                     help="seconds between re-plans (default: %(default)s)")
    sim.add_argument(
        "--traces", default=None, help="application traces folder (default: $ELASTIC_OPS_TRACES, else "
        "../shared/traces/pollux/traces beside the repository)"
    )
    sim.add_argument(
        "--min-rescale-interval-s", "--min-rescale-interval", dest="min_rescale_interval_s", type=float,
        default=0.0, help="anti-thrashing: seconds (as `pool configure --min-rescale-interval-s`; "
        "default: %(default)s)",
    )
    sim.add_argument("--min-gain", type=float, default=0.0,
                     help="anti-thrashing: least relative change (default: %(default)s)")
    sim.add_argument(
        "--adaptive", action="store_true",
        help="every job scaling: adaptive under goodput (the pool chooses its batch per allocation; "
        "the other policies run it at its own batch)",
    )
    sim.add_argument("--tenants", default=None, metavar="FILE",
                     help='tenants (JSON: {"tenants": {NAME: {"guaranteed": N, "max_slots": M, '
                     '"weight": W}}, "jobs": {JOB: NAME}}); a job not listed: its workload tenant column')
    sim.add_argument("--json", action="store_true", help="last line: one JSON object")
    # An error about a library parameter names the option it came from: the options' dests are the
    # parameters' names (min_rescale_interval_s, slots_per_host, …, workload, traces, policy), so
    # only the parameter spelled otherwise needs an alias.
    sim.set_defaults(func=_simulate, flag_aliases={"jobs": "--synthetic"})  # synthetic_workload(jobs=…)


def _client(args: argparse.Namespace):
    """The ledger (``--pool-url``, ``$ELASTIC_OPS_POOL_URL``) or the api-server (``--api-url``,
    ``$ELASTIC_OPS_API_URL``): the same methods either way."""
    if args.pool_url and args.api_url:
        from elastic_ops.errors import SpecError

        raise SpecError("--api-url", args.api_url, "must not be given with --pool-url: give one of them")
    ledger = args.pool_url or os.environ.get(ENV_URL)
    api_url = args.api_url or (None if ledger else os.environ.get(ENV_API_URL))
    if not (ledger or api_url):
        from elastic_ops.errors import UNSET, SpecError

        raise SpecError("--pool-url", UNSET, f"the ledger's SQLAlchemy URL (or ${ENV_URL}), or --api-url "
                        f"(or ${ENV_API_URL}) for Airflow's api-server")
    if api_url:
        from elastic_ops.pool.api_client import ApiPoolClient

        return ApiPoolClient(api_url)
    from elastic_ops.errors import SpecError
    from elastic_ops.pool.client import PoolClient

    source = "--pool-url" if args.pool_url else f"${ENV_URL}"  # where the user gave the URL
    try:  # a reading command on a typo'd URL must not create an empty ledger to show
        return PoolClient(ledger, create=not getattr(args, "reads_only", False))
    except SpecError as exc:
        if exc.field != "url":
            raise
        raise exc.naming(source) from None


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    """``--label KEY=VALUE`` arguments as a mapping."""
    from elastic_ops.errors import SpecError
    from elastic_ops.spec import check_host_selector

    labels: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise SpecError("label", item, "must be KEY=VALUE")
        k, v = item.split("=", 1)
        try:  # checked one by one, so that the error quotes the argument as typed
            check_host_selector("labels", {k: v})
        except SpecError as exc:
            raise SpecError("label", item, exc.allowed) from None
        if not v:  # `--label gpu=$GPU` with $GPU unset
            raise SpecError("label", item, f"must be KEY=VALUE with a value after the '=' (label {k!r})")
        if k in labels:
            raise SpecError("label", item, f"each label once: {k!r} is given already as {k}={labels[k]}")
        labels[k] = v
    return labels


def _configure(args: argparse.Namespace) -> None:
    keys = (
        "policy",
        "preemption",
        "lease_ttl_s",
        "min_rescale_interval_s",
        "min_gain",
        "aging_s",
        "job_idle_s",
        "cooling_s",
        "failure_threshold",
        "plan_interval_s",
        "plan_refresh_s",
        "rescale_cost_s",
    )
    changes = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    print(json.dumps(_client(args).configure(**changes), sort_keys=True))


def _planner(args: argparse.Namespace) -> None:
    """Plans whenever one is due until SIGTERM or Ctrl-C: a dedicated planner, so an expired
    lease's slots return and time-driven rules (aging, cooling) act even when no client calls."""
    import signal

    from elastic_ops.pool.client import PoolClient
    from elastic_ops.spec import check_number

    if args.poll_s is not None:
        check_number("--poll-s", args.poll_s, minimum=0.01, maximum=3600.0, unit=" of seconds")
    pool = _client(args)
    if not isinstance(pool, PoolClient):
        from elastic_ops.errors import SpecError

        raise SpecError("--api-url", args.api_url, "the planner needs the ledger: give --pool-url "
                        f"(or ${ENV_URL}), not the api-server")
    if args.once:
        print(json.dumps(pool.plan(), sort_keys=True))
        return
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    from elastic_ops.urls import shown_url

    print(f"planner on {shown_url(pool.url)}: planning whenever a plan is due", file=sys.stderr, flush=True)
    plans = pool.serve_planner(lambda: bool(stopping), poll_s=args.poll_s)
    print(f"planner stopped after {plans} plans", file=sys.stderr)


def _status(args: argparse.Namespace) -> None:
    st = _client(args).status()
    if args.json:
        print(json.dumps(st, sort_keys=True))
        return
    print(report.summary(st))
    print()
    print(report.text_table(report.host_rows(st), report.HOST_COLUMNS))
    if report.has_tenants(st):
        print()
        print(report.text_table(report.tenant_rows(st), report.TENANT_COLUMNS))
    print()
    print(report.text_table(report.job_rows(st), report.JOB_COLUMNS))


def _prints_change(p: argparse.ArgumentParser, change, describe) -> None:
    """A changing command prints one line of what changed (``--quiet``: nothing), read from the
    pool's status before and after, so it says what the pool holds now, not what was asked."""
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")

    def func(args: argparse.Namespace) -> None:
        client = _client(args)
        before = None if args.quiet else client.status()
        change(client, args)
        if not args.quiet:
            print(report.shown(describe(args, before, client.status())))

    p.set_defaults(func=func)


def _named(status: dict, kind: str, name: str) -> dict | None:
    return next((x for x in status[kind] if x["name"] == name), None)


def _arrow(label: str, old: object, new: object) -> str | None:
    def shown(v: object) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)  # as the command takes it

    return None if old == new else f"{label} {shown(old)} -> {shown(new)}"


def job_change(args: argparse.Namespace, before: dict, after: dict) -> str:
    """``job train: priority 3 -> 7, target 4 -> 5 workers``: the job's settings that changed,
    and its target where the re-plan moved it."""
    old, new = _named(before, "jobs", args.job) or {}, _named(after, "jobs", args.job) or {}

    def sel(j: dict) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted((j.get("selector") or {}).items())) or "any host"

    parts = [_arrow("priority", old.get("priority"), new.get("priority")),
             _arrow("workers", f"{old.get('min_workers')}..{old.get('max_workers')}",
                    f"{new.get('min_workers')}..{new.get('max_workers')}"),
             _arrow("preemptible", old.get("preemptible"), new.get("preemptible")),
             _arrow("selector", sel(old), sel(new)),
             _arrow("target", old.get("target"), f"{new.get('target')} workers")
             if old.get("target") != new.get("target") else None]
    said = [p for p in parts if p]
    return f"job {args.job}: " + (", ".join(said) if said else "unchanged")


def tenant_change(args: argparse.Namespace, before: dict, after: dict) -> str:
    """``tenant vision: guaranteed 8, max 16, weight 1 (in use 3)`` or ``tenant vision: removed``."""
    new, old = _named(after, "tenants", args.tenant), _named(before, "tenants", args.tenant)
    if not hasattr(args, "guaranteed") or new is None:  # remove-tenant
        return f"tenant {args.tenant}: removed"
    limit = "no max" if new["max_slots"] is None else f"max {new['max_slots']}"
    what = "added" if old is None else "set"
    return (f"tenant {args.tenant}: {what} guaranteed {new['guaranteed']}, {limit}, weight {new['weight']:g} "
            f"(in use {new['in_use']}, borrowed {new['borrowed']}, lent {new['lent']})")


def host_change(args: argparse.Namespace, before: dict, after: dict) -> str:
    """``host gpu-0: up -> draining (3 slots in use move off at their jobs' next boundary)``."""
    old, new = _named(before, "hosts", args.host), _named(after, "hosts", args.host) or {}

    def labels(h: dict) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted((h.get("labels") or {}).items())) or "none"

    if old is None:
        return (f"host {args.host}: added, {new.get('slots')} slots, {new.get('state')}, "
                f"labels {labels(new)}")
    said = [p for p in (_arrow("state", old["state"], new.get("state")),
                        _arrow("slots", old["slots"], new.get("slots")),
                        _arrow("labels", labels(old), labels(new))) if p]
    line = f"host {args.host}: " + (", ".join(said) if said else "unchanged")
    if new.get("state") == "draining" and old["state"] != "draining":
        line += (f"; no new grants, the {new.get('used', 0)} slots in use move off at their jobs' next "
                 "iteration boundary")
    return line


def parse_since(value: str, now: float) -> float:
    """``--since``: ``90s``/``30m``/``2h``/``1d`` back from ``now``, or an ISO 8601 time (UTC
    unless it names its zone), as Unix seconds."""
    import datetime as dt
    import re

    from elastic_ops.errors import SpecError

    allowed = "a duration back from now (90s, 30m, 2h, 1d) or an ISO 8601 time (2026-12-03T10:00)"
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", value)
    if m:
        back = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        if back > 10 * 365 * 86400:
            raise SpecError("--since", value, allowed + ", at most 10 years back")
        return now - back
    try:
        when = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise SpecError("--since", value, allowed) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def event_kinds(given: Sequence[str] | None) -> list[str] | None:
    """``--kind``, repeated or comma-separated, each a known kind."""
    if not given:
        return None
    from elastic_ops.errors import SpecError

    kinds = [k.strip() for item in given for k in item.split(",") if k.strip()]
    known = [k.value for k in EventKind]
    for k in kinds:
        if k not in known:
            import difflib

            close = difflib.get_close_matches(k, known, n=1)
            raise SpecError("--kind", k, f"an event kind, one of {', '.join(known)}",
                            hint=f"did you mean {close[0]!r}?" if close else None)
    return kinds


FOLLOW_POLL_S = 1.0  # --follow: how often the log is read for new events


def _events(args: argparse.Namespace) -> None:
    import time

    from elastic_ops.spec import check_int

    if args.last is not None:
        check_int("--last", args.last, 1, 1_000_000)
    since = parse_since(args.since, time.time()) if args.since is not None else None
    kinds = event_kinds(args.kind)
    client = _client(args)
    events = client.events(args.job, last=args.last, since_ts=since, kinds=kinds)
    if not events and not args.json and not args.follow:
        # an empty table would look like a hang or a typo'd job gone unnoticed; JSON lines stay empty
        where = f" for job {args.job!r} (`elastic-ops pool status` lists the jobs)" if args.job else ""
        print(f"no events{where}", file=sys.stderr)
    for e in events:
        _print_event(e, args.json)
    if not args.follow:
        return
    seen = events[-1]["id"] if events else _newest_id(client)
    try:
        while True:
            sys.stdout.flush()
            time.sleep(FOLLOW_POLL_S)
            for e in client.events(args.job, since_id=seen, kinds=kinds):
                _print_event(e, args.json)
                seen = e["id"]
    except KeyboardInterrupt:  # Ctrl-C ends following: not an error
        return


def _newest_id(client) -> int:
    newest = client.events(last=1)
    return newest[-1]["id"] if newest else 0


def _print_event(e: dict, as_json: bool) -> None:
    import datetime as dt

    if as_json:
        print(json.dumps(e, sort_keys=True))
        return
    ts = dt.datetime.fromtimestamp(e["ts"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    who = e["job"] or e["host"] or "-"
    facts = [f"{k}={e[k]}" for k in ("workers", "epoch") if e[k] is not None]  # a host event has none
    if e["slots"]:
        facts.append("slots=[" + ",".join(f"{h}:{s}" for h, s in e["slots"]) + "]")
    line = " ".join([f"{e['id']:>6} {ts} {e['kind']:<8} {who:<20}", *facts, e["reason"] or ""])
    print(report.shown(line))


def _usage(args: argparse.Namespace) -> None:
    u = _client(args).usage(hours=args.hours)
    if args.json:
        print(json.dumps(u, sort_keys=True))
        return
    print(f"{u['slot_hours']:g} slot-hours over {u['hours']:g} hours")
    print()
    total = u["slot_hours"] or 1.0
    print(report.text_table([[j["job"], f"{j['slot_hours']:.2f}", f"{100 * j['slot_hours'] / total:.1f}%"]
                  for j in u["jobs"]], ["JOB", "SLOT-HOURS", "SHARE"]))
    print()
    print(report.text_table([[h["host"], f"{h['slot_hours']:.2f}",
                   f"{100 * h['utilization']:.1f}%" if "utilization" in h else "-"] for h in u["hosts"]],
                 ["HOST", "SLOT-HOURS", "BUSY"]))
    if any(t["tenant"] != "default" or t["guaranteed"] for t in u.get("tenants", ())):
        print()
        kinds = ("guaranteed", "used", "borrowed", "lent")
        print(report.text_table([[t["tenant"], *(f"{t[k]:.2f}" for k in kinds)] for t in u["tenants"]],
                                ["TENANT", "GUARANTEED", "USED", "BORROWED", "LENT"]))


def _prune_events(args: argparse.Namespace) -> None:
    from elastic_ops.pool.checks import MAX_LOOKBACK_H
    from elastic_ops.spec import check_number

    days = check_number("--older-than-days", args.older_than_days, minimum=0, exclusive=True,
                        unit=" of days", maximum=MAX_LOOKBACK_H / 24)
    print(f"deleted {_client(args).prune_events(days * 86400.0)} events older than {days:g} days")


def _simulate(args: argparse.Namespace) -> int:
    from elastic_ops.pool.simulator import main_simulate

    return main_simulate(args)
