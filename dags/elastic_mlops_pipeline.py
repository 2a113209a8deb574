"""An MLOps pipeline wired by Assets: prepare data → elastic training → evaluate → promote.

1. ``digits_prepare_data`` snapshots the data set and emits the ``digits_dataset`` Asset.
2. ``digits_train_on_new_data`` is scheduled on that Asset and trains elastically; its finalize
   task emits the model Asset with the checkpoint URI and metrics in the event's extra.
3. ``digits_evaluate_and_promote`` is scheduled on the model Asset: it evaluates the new model
   and promotes it (writes the registry file) only when it beats the current one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Asset, task

from elastic_ops.taskgroup import elastic_training

START = pendulum.datetime(2024, 1, 1, tz="UTC")
# not AIRFLOW_HOME/elastic_ops: a folder of the package's name there hides it from `python -m`
HOME = Path(os.environ.get("AIRFLOW_HOME", Path.home() / "airflow")) / "elastic_ops_pipeline"
DATASET = Asset(name="digits_dataset", uri=f"file://{HOME / 'data' / 'digits.json'}", group="dataset")
MODEL = Asset(name="digits_model", uri=f"file://{HOME / 'checkpoints' / 'digits_pipeline'}", group="model")
REGISTRY = HOME / "registry" / "digits.json"

with DAG(dag_id="digits_prepare_data", schedule=None, start_date=START, catchup=False,
         tags=["elastic_ops", "mlops"]):

    @task(outlets=[DATASET])
    def prepare(*, outlet_events=None) -> dict:
        from sklearn.datasets import load_digits

        data = load_digits()
        digest = hashlib.sha256(data.data.tobytes() + data.target.tobytes()).hexdigest()
        meta = {"samples": int(data.data.shape[0]), "features": int(data.data.shape[1]), "sha256": digest}
        path = Path(DATASET.uri.removeprefix("file://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta))
        outlet_events[DATASET].extra = meta
        return meta

    prepare()

with DAG(dag_id="digits_train_on_new_data", schedule=[DATASET], start_date=START, catchup=False,
         max_active_runs=1, tags=["elastic_ops", "mlops"]):
    elastic_training(
        task_id="train",
        trainable="elastic_ops.examples.digits:DigitsMLP",
        total_iterations=150, chunk_iterations=50, min_workers=1, max_workers=4, priority=2,
        checkpoint=MODEL.uri, model_asset=MODEL, global_batch=64,
    )

with DAG(dag_id="digits_evaluate_and_promote", schedule=[MODEL], start_date=START, catchup=False,
         max_active_runs=1, tags=["elastic_ops", "mlops"]):

    @task(inlets=[MODEL])
    def evaluate(*, inlet_events=None) -> dict:
        from elastic_ops.operators.evaluate import evaluate_checkpoint

        extra = inlet_events[MODEL][-1].extra
        metrics = evaluate_checkpoint(extra["checkpoint_root"], extra["entrypoint"], extra["params"])
        return {"checkpoint_uri": extra["checkpoint_uri"], "checkpoint_root": extra["checkpoint_root"],
                "metrics": metrics}

    @task
    def promote(candidate: dict) -> dict:
        current = json.loads(REGISTRY.read_text()) if REGISTRY.exists() else None
        new_acc = candidate["metrics"].get("test_accuracy", 0.0)
        old_acc = current["metrics"].get("test_accuracy", 0.0) if current else float("-inf")
        if new_acc <= old_acc:
            return {"promoted": False, "accuracy": new_acc, "current_accuracy": old_acc}
        REGISTRY.parent.mkdir(parents=True, exist_ok=True)
        REGISTRY.write_text(json.dumps(candidate))
        return {"promoted": True, "accuracy": new_acc, "previous_accuracy": current and old_acc}

    promote(evaluate())
