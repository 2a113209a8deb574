"""elastic_ops: elastic deep-learning training for Apache Airflow.

Layers (dependencies point downwards only): the Airflow layer (operators, sensors, triggers,
hooks, taskgroup) calls ``runtime``, ``pool`` and ``checkpoint``, which never import Airflow and
rest on ``spec`` and ``errors``.
"""

__version__ = "0.1.0"
