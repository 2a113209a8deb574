"""Elastic training operators: register → chunk × N → finalize, and the end_job teardown (see
``elastic_training``)."""

from elastic_ops.operators.chunk import ElasticChunkOperator
from elastic_ops.operators.lifecycle import (
    ElasticEndJobOperator,
    ElasticFinalizeOperator,
    ElasticRegisterOperator,
)
from elastic_ops.operators.results import ChunkTaskResult
from elastic_ops.utils.retry import ElasticRetryPolicy

__all__ = [
    "ChunkTaskResult", "ElasticChunkOperator", "ElasticEndJobOperator", "ElasticFinalizeOperator",
    "ElasticRegisterOperator", "ElasticRetryPolicy",
]
