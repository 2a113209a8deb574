"""Sensors over the resource pool."""

from elastic_ops.sensors.pool import ElasticPoolSensor

__all__ = ["ElasticPoolSensor"]
