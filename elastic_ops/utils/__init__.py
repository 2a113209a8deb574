"""What the Airflow layer (operators, sensors, the task group) shares that is not an operator:
job naming and registration (:mod:`.jobs`), the retry policy (:mod:`.retry`)."""
