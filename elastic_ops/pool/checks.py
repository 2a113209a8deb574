"""The ledger's argument checks: every value a :class:`~elastic_ops.pool.client.PoolClient` call
takes is checked here before its transaction starts, and a bad one is a
:class:`~elastic_ops.errors.SpecError` naming the field, the value and what is allowed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from elastic_ops.errors import SpecError
from elastic_ops.pool import schema as s
from elastic_ops.pool.model import HostState, Observation, Preemption, Slot, check_aging
from elastic_ops.pool.policies import POLICIES
from elastic_ops.pool.scaling import Batching
from elastic_ops.spec import MAX_WORKERS_LIMIT, check_host_name, check_int, check_number

MAX_HOST_SLOTS = 1_000_000  # the most slots one host may have

MAX_LEASE_TTL_S = 86_400.0  # a day
MAX_SETTING = 1e9  # any other setting (seconds or a fraction): past it, arithmetic leaves the finite
MAX_LOOKBACK_H = 1e6  # ~114 years: more reads the whole log anyway; a huge value would overflow to inf


def check_bounds(min_workers: object, max_workers: object) -> None:
    low = check_int("min_workers", min_workers, 1, MAX_WORKERS_LIMIT)
    high = check_int("max_workers", max_workers, 1, MAX_WORKERS_LIMIT)
    if low > high:
        raise SpecError("min_workers", min_workers, f"must be <= max_workers ({max_workers})")


def check_name(field: str, value: object) -> str:
    """A job's name: printable (no control characters), no surrounding spaces, 1-255 characters
    (the Airflow layer's are ``<dag>.<group>.<run_id>``, sanitised)."""
    if (
        not isinstance(value, str) or not value or len(value) > 255 or value != value.strip()
        or not value.isprintable()
    ):
        raise SpecError(field, value, "must be 1-255 printable characters without surrounding spaces")
    return value


MAX_EPOCH = 2**63 - 1  # the ledger's integers


def check_epoch(value: object) -> int:
    return check_int("epoch", value, 0, MAX_EPOCH)


def check_flag(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SpecError(field, value, "must be true or false")
    return value


def check_hosts(field: str, value: object) -> list[str]:
    """A collection of host names (a string is one name, not a collection of letters)."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise SpecError(field, value, "must be a list of host names")
    return sorted({check_host_name(field, h) for h in value})


MAX_MEASURED_ITERATIONS = 10**12
MAX_MEASURED_SECONDS = 1e9


def _built(field: str, value: Mapping[str, Any], cls: type, needs: str) -> Any:
    """``cls(**value)`` for a dict a caller passed instead of the value: unknown keys and
    missing ones are a SpecError naming ``field``."""
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(map(str, value)) - known):
        raise SpecError(field, unknown[0], f"an unknown field; known: {', '.join(sorted(known))}")
    try:
        return cls(**value)
    except TypeError:
        raise SpecError(field, dict(value), f"needs {needs}") from None


def check_observation(value: object) -> Observation | None:
    """A heartbeat's ``measured``: an :class:`Observation` (or its dict), each field in range."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = _built("measured", value, Observation, "iterations, seconds and workers")
    if not isinstance(value, Observation):
        raise SpecError("measured", value, "must be an Observation (iterations, seconds, workers, hosts, "
                        "batch, grad_sqr, grad_var)")
    check_int("measured.iterations", value.iterations, 0, MAX_MEASURED_ITERATIONS)
    check_number("measured.seconds", value.seconds, minimum=0, maximum=MAX_MEASURED_SECONDS,
                 unit=" of seconds")
    check_int("measured.workers", value.workers, 1, MAX_WORKERS_LIMIT)
    check_int("measured.hosts", value.hosts, 1, value.workers)
    check_int("measured.batch", value.batch, 0, 2**31 - 1)
    if (value.grad_sqr is None) != (value.grad_var is None):
        raise SpecError("measured.grad_sqr", value.grad_sqr,
                        "given with measured.grad_var (both gradient statistics, or neither)")
    if value.grad_sqr is not None:
        check_number("measured.grad_sqr", value.grad_sqr, minimum=0)
        check_number("measured.grad_var", value.grad_var, minimum=0)
    return value


def check_batching(value: object) -> Batching | None:
    """``submit``'s ``batching``: a :class:`Batching` (or its dict), or None (a fixed batch)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        for name, v in value.items():  # before Batching compares them
            check_int(f"batching.{name}", v, 0, 2**31 - 1)
        try:
            value = _built("batching", value, Batching, "base and most")
        except ValueError as exc:
            if isinstance(exc, SpecError):
                raise
            given = dict(value) if isinstance(value, Mapping) else value  # a mapping here, narrowed
            raise SpecError("batching", given, str(exc).split(": ", 1)[-1]) from None
    if not isinstance(value, Batching):
        raise SpecError("batching", value, "must be a Batching (base, most, per_worker, least, "
                        "per_worker_most) or None")
    for f in dataclasses.fields(Batching):
        check_int(f"batching.{f.name}", getattr(value, f.name), 0, 2**31 - 1)
    return value


def check_placements(value: object) -> list[Slot] | None:
    """``[(host, slot), ...]``: the slots a job says it still uses. A malformed entry would match
    none of its slots, so that every slot the plan takes looked given up while still in use."""
    if value is None:
        return None
    allowed = "must be a list of (host, slot) pairs, slot an integer >= 0"
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise SpecError("placements", value, allowed)
    out = []
    for p in value:
        if isinstance(p, str | bytes) or not isinstance(p, Sequence) or len(p) != 2:
            raise SpecError("placements", p, allowed)
        out.append((check_host_name("placements", p[0]), check_int("placements", p[1], 0, 1_000_000)))
    return out


check_host = check_host_name


def check_host_state(value: object) -> HostState:
    if isinstance(value, str):  # any other value is no state either
        try:
            return HostState(value)
        except ValueError:
            pass
    raise SpecError("state", value, "must be one of 'up', 'draining', 'down', 'cooling'")


CONFIG_FIELDS = tuple(k for k in s.DEFAULTS)
# leases, and the time a waiting job stays planned without asking: under a second is a typo
AT_LEAST_1_S = ("lease_ttl_s", "job_idle_s")


def check_config(changes: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in changes.items():
        if key not in CONFIG_FIELDS:
            raise SpecError(key, value, f"unknown pool setting; known: {', '.join(CONFIG_FIELDS)}")
        if key == "policy":
            if not isinstance(value, str) or value not in POLICIES:  # a SpecError names the option
                known = ", ".join(sorted(POLICIES))
                raise SpecError("policy", value, f"must be a policy name, one of {known}")
        elif key == "preemption":
            if value not in ("none", "graceful"):
                raise SpecError("preemption", value, "must be one of 'none', 'graceful'")
            value = Preemption(value).value
        elif key == "failure_threshold":
            check_int(key, value, 1, 1_000_000)
        elif key == "aging_s":
            check_aging(key, value)
            check_number(key, value, minimum=0, maximum=MAX_SETTING)
        elif key in ("plan_interval_s", "plan_refresh_s"):
            # the planner's pace: a refresh under the interval would plan on every heartbeat
            check_number(key, value, minimum=0, maximum=3600.0, unit=" of seconds")
        elif key in AT_LEAST_1_S:
            # a lease that outlives every heartbeat gap by days would keep a dead holder's slots;
            # one under a second would be lost to any pause of its holder (heartbeats: ttl / 3)
            most = MAX_LEASE_TTL_S if key == "lease_ttl_s" else MAX_SETTING
            check_number(key, value, minimum=1, maximum=most, unit=" of seconds")
        else:
            check_number(key, value, minimum=0, maximum=MAX_SETTING)
        out[key] = value
    return out
