"""The resource pool: a ledger of hosts and slots, pure allocation policies, and a simulator.

Never imports Airflow. Entry point for callers: :class:`PoolClient` (see docs/pool.md).
"""

from elastic_ops.pool.client import ENV_URL, Grant, PoolClient, Target, Wait
from elastic_ops.pool.model import (
    Decision,
    Host,
    HostState,
    Job,
    JobState,
    Observation,
    Plan,
    PolicyConfig,
    Preemption,
    Snapshot,
    TargetAction,
)
from elastic_ops.pool.policies import POLICIES, decide, get_policy
from elastic_ops.pool.scaling import Measured, ScalingModel

__all__ = [
    "ENV_URL",
    "POLICIES",
    "Decision",
    "Grant",
    "Host",
    "HostState",
    "Job",
    "JobState",
    "Measured",
    "Observation",
    "Plan",
    "PolicyConfig",
    "PoolClient",
    "Preemption",
    "ScalingModel",
    "Snapshot",
    "Target",
    "TargetAction",
    "Wait",
    "decide",
    "get_policy",
]
