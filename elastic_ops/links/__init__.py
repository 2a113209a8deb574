"""Operator extra links (the pool page of a task's job)."""
