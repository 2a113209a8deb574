"""Triggers that watch the resource pool while a task is deferred (they hold no worker slot)."""

from elastic_ops.triggers.events import CapacityEvent, GrantEvent, TriggerFailure
from elastic_ops.triggers.pool import GrantTrigger, PoolCapacityTrigger

__all__ = ["CapacityEvent", "GrantEvent", "GrantTrigger", "PoolCapacityTrigger", "TriggerFailure"]
