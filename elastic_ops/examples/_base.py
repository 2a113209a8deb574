"""The Trainable base class the examples subclass (``elastic_ops.runtime.Trainable``)."""

from elastic_ops.runtime.trainable import Trainable

__all__ = ["Trainable"]
