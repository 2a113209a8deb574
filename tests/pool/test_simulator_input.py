"""Simulator input is validated where it enters (no traces needed): settings and workload rows."""

from __future__ import annotations

import pytest

from elastic_ops.errors import SpecError
from elastic_ops.pool.simulator import SimConfig
from elastic_ops.pool.workload import read_workload


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("rescale_cost", float("nan"), ">= 0"),
    ("rescale_cost", float("inf"), ">= 0"),
    ("rescale_cost", -1.0, ">= 0"),
    ("replan_interval", 1e-9, ">= 1"),  # would tick forever
    ("replan_interval", float("nan"), ">= 1"),
    ("min_rescale_interval_s", float("nan"), ">= 0"),
    ("min_gain", float("inf"), ">= 0"),
])
def test_simulation_settings_must_be_finite_and_sane(field, value, allowed):
    with pytest.raises(SpecError, match=f"invalid {field}=.*must be a finite number {allowed}"):
        SimConfig(**{field: value})


@pytest.mark.parametrize("row", [
    "j1,0,cifar10,-3,128",
    "j1,0,cifar10,0,128",
    "j1,0,cifar10,2,-5",
    "j1,nan,cifar10,2,128",
    "j1,0,cifar10,two,128",
])
def test_bad_workload_rows_name_the_file_and_line(tmp_path, row):
    path = tmp_path / "w.csv"
    path.write_text(f"name,time,application,num_replicas,batch_size\nj0,0,cifar10,1,128\n{row}\n")
    with pytest.raises(SpecError, match=f"invalid workload='{path}:3'"):
        read_workload(path)
