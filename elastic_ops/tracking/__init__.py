"""Experiment tracking: the contract (:mod:`.api`) and MLflow (:mod:`.mlflow`, needs
``pip install 'elastic-ops[mlflow]'`` only when a run is opened)."""

from elastic_ops.tracking.api import NO_RUN, Guarded, JobRun, NoRun, TrackedJob, Tracking, open_run
from elastic_ops.tracking.mlflow import MlflowTracking

__all__ = ["NO_RUN", "Guarded", "JobRun", "MlflowTracking", "NoRun", "TrackedJob", "Tracking", "open_run"]
