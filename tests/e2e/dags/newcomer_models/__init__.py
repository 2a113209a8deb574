"""A user's models, kept beside the DAG that trains them (the DAG folder is on the task's path,
not on the agent's)."""
