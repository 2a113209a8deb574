"""Evaluate the model of a checkpoint (for pipelines that compare and promote models)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from botocore.client import BaseClient


def evaluate_checkpoint(root_uri: str, entrypoint: str, params: dict[str, Any] | None = None,
                        *, s3_client: BaseClient | None = None) -> dict[str, float]:
    """Load the newest verified checkpoint under ``root_uri`` and run the Trainable's evaluate."""
    from elastic_ops.checkpoint import open_store
    from elastic_ops.errors import CheckpointNotFoundError
    from elastic_ops.runtime import load_trainable
    from elastic_ops.runtime.model_checks import metric_values

    store = open_store(root_uri, s3_client=s3_client)
    ref = store.latest()
    if ref is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {root_uri}")
    trainable = load_trainable(entrypoint, params)
    model = trainable.build_model()
    model.load_state_dict(store.load(ref)["model"])
    model.eval()
    return metric_values(trainable.evaluate(model))
