"""The Trainable base class the examples subclass (``elastic_ops.runtime.Trainable``)."""

try:
    from elastic_ops.runtime.trainable import Trainable
except ImportError:  # TEMPORARY until elastic_ops.runtime lands; removed then
    Trainable = object  # type: ignore[misc,assignment]

__all__ = ["Trainable"]
