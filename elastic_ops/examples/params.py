"""Validation of the example models' hyperparameters (``JobSpec.params``).

Bad values raise :class:`~elastic_ops.errors.SpecError` naming ``params.<key>``, the value and
what is allowed, like every other spec field.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from elastic_ops.errors import SpecError
from elastic_ops.pool.checks import check_flag
from elastic_ops.spec import check_int

Check = Callable[[str, Any], Any]


def positive_int(key: str, value: object) -> int:
    return check_int(f"params.{key}", value, 1)


def non_negative_int(key: str, value: object) -> int:
    return check_int(f"params.{key}", value, 0)


def flag(key: str, value: object) -> bool:
    return check_flag(f"params.{key}", value)


def positive_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SpecError(f"params.{key}", value, "must be a number > 0")
    return float(value)


def non_negative_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise SpecError(f"params.{key}", value, "must be a number >= 0")
    return float(value)


def fraction(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise SpecError(f"params.{key}", value, "must be a number strictly between 0 and 1")
    return float(value)


def probability(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise SpecError(f"params.{key}", value, "must be a number >= 0 and < 1")
    return float(value)


def parse(params: Mapping[str, Any], schema: Mapping[str, tuple[Any, Check]]) -> dict[str, Any]:
    """Fill defaults and validate ``params`` against ``schema`` (``key -> (default, check)``)."""
    unknown = sorted(set(params) - set(schema))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(schema), n=1)
        raise SpecError(
            f"params.{unknown[0]}", params[unknown[0]], f"unknown parameter; known: {', '.join(schema)}",
            hint=f"did you mean {close[0]!r}?" if close else None,
        )
    return {key: check(key, params.get(key, default)) for key, (default, check) in schema.items()}
