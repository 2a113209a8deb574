"""JobSpec validation: every bad value names the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from elastic_ops.errors import ElasticOpsError, SpecError
from elastic_ops.spec import Consistency, JobSpec, stop_reached


def make_spec(**overrides) -> JobSpec:
    fields = dict(name="job", entrypoint="pkg.mod:Model", total_iterations=100, global_batch=32)
    fields.update(overrides)
    return JobSpec(**fields)


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        ({"min_workers": 5, "max_workers": 4}, "min_workers", "<= max_workers (4)"),
        ({"chunk_iterations": 101}, "chunk_iterations", "<= total_iterations (100)"),
        ({"total_iterations": 0}, "total_iterations", "between 1 and"),
        ({"consistency": "exact"}, "consistency", "'bitwise', 'fast'"),
        ({"scaling": "cubic"}, "scaling", "'fixed'"),
        ({"checkpoint": "ftp://host/x"}, "checkpoint", "file:///absolute/path"),
        ({"checkpoint": "file://./ck"}, "checkpoint", "note the three slashes"),  # relative: refused here,
        ({"checkpoint": "file://host/ck"}, "checkpoint", "file:///absolute/path"),  # not when training
        # a query or fragment would swallow the '/<run_id>' the Airflow layer appends
        ({"checkpoint": "s3://models/digits?v=2"}, "checkpoint", "no '?', '#'"),
        ({"checkpoint": "file:///tmp/ck#x"}, "checkpoint", "no '?', '#'"),
        ({"checkpoint": "file:///"}, "checkpoint", "file:///absolute/path"),
        ({"checkpoint": "file:///tmp/%00x"}, "checkpoint", "file:///absolute/path"),
        ({"checkpoint": "file:///tmp/x\n"}, "checkpoint", "file:///absolute/path"),
        ({"name": "job\n"}, "name", "starting with a letter or digit"),
        ({"entrypoint": "pkg.mod:Cls\n"}, "entrypoint", "package.module:TrainableClass"),
        ({"total_iterations": 10**30}, "total_iterations", "between 1 and 1000000000"),
        ({"global_batch": 2**40}, "global_batch", "between 1 and 2147483647"),
        ({"total_iterations": 20_000, "chunk_iterations": 1}, "chunk_iterations", "gives 20000 chunks"),
        ({"params": {"lr": float("nan")}}, "params", "numbers finite"),
        ({"params": {"lr": float("inf")}}, "params", "numbers finite"),
        ({"checkpoint": "s3://B/x"}, "checkpoint", "s3://bucket/prefix"),
        ({"entrypoint": "not an entrypoint"}, "entrypoint", "package.module:TrainableClass"),
        ({"priority": 0}, "priority", "between 1 and 1000"),
        ({"priority": -3}, "priority", "between 1 and 1000"),
        ({"max_workers": 8, "global_batch": 4}, "global_batch", ">= max_workers (8)"),
        (
            {"consistency": "bitwise", "max_workers": 3, "global_batch": 32},
            "global_batch",
            "divisible by virtual_shards (3)",
        ),
        (
            {"consistency": "bitwise", "max_workers": 4, "virtual_shards": 2},
            "virtual_shards",
            ">= max_workers",
        ),
        ({"virtual_shards": 4}, "virtual_shards", "only applies to consistency 'bitwise'"),
        ({"warmup_iterations": 5}, "warmup_iterations", "must be 0 with scaling 'fixed'"),  # was ignored
        ({"consistency": "bitwise", "scaling": "linear_lr"}, "scaling", "must be 'fixed'"),
        ({"name": "bad name!"}, "name", "letters, digits"),
        ({"min_workers": True}, "min_workers", "integer"),
        ({"params": {"lr": object()}}, "params", "JSON-serialisable"),
        # Airflow's serializers refuse (serde) or decode (old format) these, so a deferred chunk's
        # trigger failed, or came back with other params (another spec hash)
        ({"params": {"__classname__": "x"}}, "params key", "reserved by Airflow's serializers"),
        ({"params": {"opt": [{"__id__": 1}]}}, "params key", "reserved"),
        ({"params": {"a": {"__type": "dict", "__var": {"b": 1}}}}, "params key", "reserved"),
        # JSON turned the key 1 into "1" (a node agent's Trainable saw other params than a local one,
        # under the same spec hash), and a mix of keys was refused as "'<' not supported …"
        ({"params": {1: "a"}}, "params key", "must be a string"),
        ({"params": {"opt": {"b": 1, None: 2}}}, "params key", "must be a string"),
        ({"params": {True: "a", "b": 2}}, "params key", "must be a string"),
        ({"keep_last": 0}, "keep_last", "between 1 and"),
        # unbounded, these passed here and failed on a node agent (its wire holds at most 2**63-1)
        ({"keep_last": 2**64}, "keep_last", "between 1 and 1000000000"),
        ({"keep_every": 2**64}, "keep_every", "between 1 and 1000000000"),
        ({"checkpoint_interval": 10**30}, "checkpoint_interval", "between 1 and 1000000000"),
        ({"scaling": "linear_lr", "warmup_iterations": 10**30}, "warmup_iterations", "between 0 and"),
        ({"micro_batch": 2**40}, "micro_batch", "between 1 and 2147483647"),
        ({"host_selector": {"gpu": 1}}, "host_selector", "string value"),
        ({"stop_when": {"metric": "loss"}}, "stop_when", '{"metric": NAME, "at_least": X}'),
        ({"stop_when": {"metric": "loss", "at_least": 1, "at_most": 2}}, "stop_when", "at_most"),
        ({"stop_when": {"metric": "loss", "below": 0.1}}, "stop_when", "unknown key 'below'"),
        ({"stop_when": {"metric": "", "at_most": 0.1}}, "stop_when", "needs a metric"),
        ({"stop_when": {"metric": "loss", "at_most": float("nan")}}, "stop_when.at_most", "finite"),
        ({"stop_when": {"metric": "acc", "at_least": "0.9"}}, "stop_when.at_least", "finite"),
        ({"stop_when": "loss<0.1"}, "stop_when", "a mapping"),
        # a script entrypoint's limits: they failed first when a chunk began training, after its wait
        ({"entrypoint": "train.py", "consistency": "bitwise"}, "consistency", "'fast' with a script"),
        ({"entrypoint": "train.py", "scaling": "sqrt_lr"}, "scaling", "'fixed' with a script"),
        ({"entrypoint": "train.py", "micro_batch": 4}, "micro_batch", "not with a script entrypoint"),
    ],
)
def test_bad_values_name_field_value_and_allowed(overrides, field, allowed):
    with pytest.raises(SpecError) as info:
        make_spec(**overrides)
    err = info.value
    assert err.field == field
    assert allowed in str(err)
    assert f"{field}=" in str(err)
    assert not err.retryable  # a bad spec never gets better by retrying


@pytest.mark.parametrize(("stop_when", "metrics", "stops"), [
    ({"metric": "test_accuracy", "at_least": 0.95}, {"loss": 0.2, "test_accuracy": 0.95}, True),
    ({"metric": "test_accuracy", "at_least": 0.95}, {"loss": 0.2, "test_accuracy": 0.949}, False),
    ({"metric": "loss", "at_most": 0.1}, {"loss": 0.1}, True),
    ({"metric": "loss", "at_most": 0.1}, {"loss": float("nan")}, False),
    ({"metric": "test_accuracy", "at_least": 0.5}, {"loss": 0.2}, False),  # not evaluated: keep going
    ({"metric": "loss", "at_most": 0.1}, None, False),
    (None, {"loss": 0.0}, False),
])
def test_stop_when_is_met_only_by_a_finite_metric_within_its_bound(stop_when, metrics, stops):
    assert stop_reached(stop_when, metrics) is stops


def test_spec_error_is_an_elastic_ops_error_and_a_value_error():
    with pytest.raises(ValueError):
        make_spec(min_workers=0)
    assert issubclass(SpecError, ElasticOpsError)


def test_defaults_are_derived_from_other_fields():
    spec = make_spec(consistency="bitwise", max_workers=4)
    assert spec.consistency is Consistency.BITWISE
    assert spec.virtual_shards == 4
    assert spec.chunk_iterations == 100 and spec.checkpoint_interval == 100


def test_chunk_ranges_cover_the_job_without_gaps_or_overlap():
    spec = make_spec(total_iterations=95, chunk_iterations=30)
    ranges = spec.chunk_ranges()
    assert ranges == [(0, 30), (30, 60), (60, 90), (90, 95)]
    assert spec.num_chunks == len(ranges)


def test_spec_hash_ignores_workers_and_priority_but_not_the_trajectory():
    base = make_spec(max_workers=2)
    assert base.spec_hash() == make_spec(max_workers=8, priority=7).spec_hash()
    assert base.spec_hash() != make_spec(max_workers=2, data_seed=1).spec_hash()
    assert base.spec_hash() != make_spec(max_workers=2, params={"lr": 0.1}).spec_hash()
    assert base.spec_hash() == make_spec(max_workers=2, min_workers=2).spec_hash()  # fixed batch
    # scaling: the per-worker batch and the LR factor grow from min_workers' (a probe resumed a
    # min 1 job's checkpoint as a min 2 job, its batch halved, silently)
    scaled = make_spec(max_workers=4, scaling="linear_lr")
    assert scaled.spec_hash() != make_spec(max_workers=4, min_workers=2, scaling="linear_lr").spec_hash()


def test_from_dict_rejects_unknown_and_missing_fields():
    with pytest.raises(SpecError, match="unknown field"):
        JobSpec.from_dict(
            {"name": "j", "entrypoint": "a:B", "total_iterations": 1, "global_batch": 1, "lr": 1}
        )
    # a typo names the field it probably meant, before the list of all of them
    with pytest.raises(SpecError, match=r"invalid spec='total_iteration': unknown field \(did you mean "
                                        r"'total_iterations'\?\); known fields: checkpoint, "):
        JobSpec.from_dict({"name": "j", "entrypoint": "a:B", "total_iteration": 1, "global_batch": 1})
    with pytest.raises(SpecError, match=r"invalid spec='lr': unknown field; known fields"):  # no guess
        JobSpec.from_dict({"name": "j", "entrypoint": "a:B", "total_iterations": 1, "global_batch": 1,
                           "lr": 1})
    # YAML reads an unquoted key as a number, a bool or null: beside a string one, sorted() raised
    with pytest.raises(SpecError, match=r"invalid spec=1: unknown field"):
        JobSpec.from_dict({"name": "j", 1: 2, "x": 3})
    with pytest.raises(SpecError, match="unknown key 1"):
        make_spec(stop_when={1: 2, "z": 1, "metric": "m", "at_least": 1})
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"name": "j", "entrypoint": "a:B", "total_iterations": 1})
    assert info.value.field == "global_batch"
    assert str(info.value) == "missing global_batch: a job spec must set it"  # not "invalid …=None"


def test_from_yaml_reports_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(SpecError, match="cannot be read"):
        JobSpec.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        JobSpec.from_yaml(bad)
    twice = tmp_path / "twice.yaml"
    base = "name: j\nentrypoint: a.b:C\ntotal_iterations: 10\n"
    twice.write_text(base + "total_iterations: 20\nglobal_batch: 8\n")
    with pytest.raises(SpecError, match=r"invalid spec='total_iterations': is given twice \(line 4\)"):
        JobSpec.from_yaml(twice)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: j\xff\n")
    with pytest.raises(SpecError, match="must be UTF-8 text"):
        JobSpec.from_yaml(binary)
    cyclic = tmp_path / "cyclic.yaml"
    cyclic.write_text(base + "global_batch: 8\nparams: &a {x: *a}\n")
    with pytest.raises(SpecError, match="invalid params=.*must not contain itself"):
        JobSpec.from_yaml(cyclic)
    # nine lines of anchors describe 9**9 values: refused without expanding them (it took 34 s
    # and ended in MemoryError), and the message quotes a bounded excerpt
    anchors = ["  l0: &l0 [" + ", ".join(["lol"] * 9) + "]"]
    anchors += [f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(base + "global_batch: 8\nparams:\n" + "\n".join(anchors) + "\n")
    with pytest.raises(SpecError, match="must hold at most 100,000 values") as err:
        JobSpec.from_yaml(bomb)
    assert len(str(err.value)) < 600
    deep = tmp_path / "deep.yaml"
    deep.write_text(base + "global_batch: 8\nparams: {x: " + "[" * 3000 + "]" * 3000 + "}\n")
    with pytest.raises(SpecError, match="nests too deeply"):
        JobSpec.from_yaml(deep)
    deep.write_text(base + "global_batch: 8\nparams: {x: " + "[" * 100 + "]" * 100 + "}\n")
    with pytest.raises(SpecError, match="must nest at most 64 levels deep"):
        JobSpec.from_yaml(deep)
    good = tmp_path / "good.yaml"
    good.write_text("name: j\nentrypoint: a.b:C\ntotal_iterations: 10\nglobal_batch: 8\nmax_workers: 2\n")
    assert JobSpec.from_yaml(good).to_dict()["max_workers"] == 2


def test_yaml_reads_exponent_floats_as_numbers(tmp_path):
    """``lr: 1e-3`` is how learning rates are written; YAML 1.1 (PyYAML's) made it the string
    '1e-3', which the Trainable compared with a float only after the workers had started."""
    path = tmp_path / "job.yaml"
    path.write_text("name: j\nentrypoint: a.b:C\ntotal_iterations: 10\nglobal_batch: 8\n"
                    "params: {lr: 1e-3, wd: 5E-4, big: 2e+3, dotted: 1.5e-3, word: e3, hex: 0x1e3}\n")
    assert JobSpec.from_yaml(path).params == {"lr": 0.001, "wd": 0.0005, "big": 2000.0, "dotted": 0.0015,
                                              "word": "e3", "hex": 483}
    path.write_text("name: j\nentrypoint: a.b:C\ntotal_iterations: 10\nglobal_batch: 8\n"
                    "params: {sha: 8e12345}\n")
    with pytest.raises(SpecError, match=r"numbers finite .*\(hint: YAML reads .* quote a value meant"):
        JobSpec.from_yaml(path)
    path.write_text("name: j\nentrypoint: a.b:C\ntotal_iterations: 10\nglobal_batch: 8\nparams: {yes: 1}\n")
    with pytest.raises(SpecError, match=r"invalid params key=True: must be a string.*quote it"):
        JobSpec.from_yaml(path)
    path.write_text("name: j\nentrypoint: a.b:C\ntotal_iterations: 10\nglobal_batch: 4.8e1\n")
    with pytest.raises(SpecError, match=r"invalid global_batch=48\.0: must be an integer"):
        JobSpec.from_yaml(path)


def test_script_args_are_strings_for_a_script_only_and_part_of_its_hash():
    base = {"name": "j", "entrypoint": "train.py", "total_iterations": 2, "global_batch": 4}
    spec = JobSpec.from_dict({**base, "script_args": ["--lr", "0.1"]})
    assert spec.script_args == ("--lr", "0.1") and spec.to_dict()["script_args"] == ["--lr", "0.1"]
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert spec.spec_hash() != spec.replace(script_args=["--lr", "0.2"]).spec_hash()
    assert JobSpec.from_dict(base).spec_hash() == JobSpec.from_dict({**base, "script_args": []}).spec_hash()
    for bad in ("--lr 0.1", [0.1], ["a\0b"], ["x" * 4097], ["x"] * 1001):
        with pytest.raises(SpecError, match="invalid script_args=.*must be a list of at most 1000 strings"):
            JobSpec.from_dict({**base, "script_args": bad})
    with pytest.raises(SpecError, match="only with a script entrypoint.*hint: a Trainable takes"):
        JobSpec.from_dict({**base, "entrypoint": "a.b:C", "script_args": ["--lr"]})


@pytest.mark.parametrize(("uri", "why"), [
    ("s3://a..b/x", "two adjacent periods"),
    ("s3://192.168.1.1/x", "formatted as an IP address"),
])
def test_bucket_names_s3_refuses_are_refused_where_they_enter(uri, why):
    """They passed the spec and failed at the first request with InvalidBucketName (a probe)."""
    from elastic_ops.checkpoint import open_store

    base = {"name": "j", "entrypoint": "a.b:C", "total_iterations": 2, "global_batch": 4}
    with pytest.raises(SpecError, match=f"invalid checkpoint=.*hint: bucket .* {why}"):
        JobSpec.from_dict({**base, "checkpoint": uri})
    with pytest.raises(SpecError, match=why):
        open_store(uri)
    assert JobSpec.from_dict({**base, "checkpoint": "s3://my.bucket-1/x"}).checkpoint == "s3://my.bucket-1/x"


@pytest.mark.parametrize("uri", [
    "file:///data/store/../../etc", "file:///data/./store", "file:///data/%2e%2e/x", "s3://bucket/a/../b",
])
def test_a_store_path_with_dot_segments_is_refused_where_it_enters(tmp_path, uri):
    """``file:///…/store/../../x`` wrote outside the folder it names (a probe); the agent's wire
    form and ``open_store`` check it too."""
    from elastic_ops.agent.protocol import StoreConfig
    from elastic_ops.checkpoint import open_store

    base = {"name": "j", "entrypoint": "a.b:C", "total_iterations": 2, "global_batch": 4}
    with pytest.raises(SpecError, match="invalid checkpoint=.*without '.' or '..' path segments"):
        JobSpec.from_dict({**base, "checkpoint": uri})
    with pytest.raises(SpecError, match="without '.' or '..' path segments"):
        open_store(uri)
    with pytest.raises(SpecError, match="invalid warm_start.uri=.*without '.' or '..' path segments"):
        StoreConfig.from_wire({"uri": uri}, "warm_start")
    ok = f"file://{tmp_path}/x..y/store.v2"  # dots inside a name are a name
    assert JobSpec.from_dict({**base, "checkpoint": ok}).checkpoint == ok


def test_a_refused_checkpoint_uri_never_echoes_its_secret():
    """``s3://KEY:SECRET@bucket`` is refused; the refusal (CLI output, a task's log) quoted the
    secret (a probe)."""
    base = {"name": "j", "entrypoint": "a.b:C", "total_iterations": 2, "global_batch": 4}
    with pytest.raises(SpecError, match=r"invalid checkpoint='s3://AKIAX:\*\*\*@bucket/x'") as err:
        JobSpec.from_dict({**base, "checkpoint": "s3://AKIAX:SUPERSECRET@bucket/x"})
    assert "SUPERSECRET" not in str(err.value)


def test_yaml_merge_keys_merge_and_unreadable_values_are_spec_errors(tmp_path):
    """The duplicate-key check read '<<' as a key (could not determine a constructor for the tag
    'tag:yaml.org,2002:merge'); an integer of over 4,300 digits or a date like 2024-13-01 was a
    ValueError traceback from the YAML loader."""
    base = "name: j\nentrypoint: a.b:C\ntotal_iterations: 10\nglobal_batch: 8\n"
    path = tmp_path / "job.yaml"
    path.write_text(base + "params:\n  common: &common {lr: 0.1, wd: 0.01}\n  head: {<<: *common, lr: 0.5}\n")
    assert JobSpec.from_yaml(path).params["head"] == {"lr": 0.5, "wd": 0.01}
    path.write_text(base + "params: {<<: {a: 1}, b: 2, b: 3}\n")
    with pytest.raises(SpecError, match="invalid spec='b': is given twice"):
        JobSpec.from_yaml(path)
    for value in ("9" * 5000, "2024-13-01"):
        path.write_text(base + f"params: {{x: {value}}}\n")
        with pytest.raises(SpecError, match=r"holds a value YAML cannot read \(.*\(hint: quote") as err:
            JobSpec.from_yaml(path)
        assert err.value.field == "spec" and "set_int_max_str_digits" not in str(err.value)


def test_a_spec_that_is_no_regular_file_is_refused_at_once(tmp_path):
    """``/dev/zero`` was read until memory ran out, a FIFO waited for a writer forever (an audit)."""
    import os

    with pytest.raises(SpecError, match="not a device"):
        JobSpec.from_yaml("/dev/zero")
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="not a FIFO"):
        JobSpec.from_yaml(fifo)
    with pytest.raises(SpecError, match="not a folder"):
        JobSpec.from_yaml(tmp_path)
    huge = tmp_path / "huge.yaml"
    huge.write_text("name: j\n" + "# padding\n" * 200_000)
    with pytest.raises(SpecError, match="at most 1024 KiB"):
        JobSpec.from_yaml(huge)


PS = {"strategy": "parameter_server", "consistency": "bitwise", "max_workers": 4}


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        ({"strategy": "gossip"}, "strategy", "'allreduce', 'parameter_server'"),
        ({"servers": 2}, "servers", "only with strategy 'parameter_server'"),
        ({**PS, "servers": 0}, "servers", "between 1 and 64"),
        ({**PS, "servers": 65}, "servers", "between 1 and 64"),
        ({**PS, "servers": True}, "servers", "integer"),
        ({**PS, "consistency": "fast"}, "consistency", "must be 'bitwise' with strategy 'parameter_server'"),
        ({"strategy": "parameter_server"}, "consistency", "must be 'bitwise'"),  # the default is fast
        ({**PS, "scaling": "linear_lr", "min_workers": 1}, "scaling", "must be 'fixed' with strategy"),
        ({**PS, "scaling": "adaptive"}, "scaling", "must be 'fixed' with strategy 'parameter_server'"),
        ({**PS, "device": "cuda"}, "device", "must be 'cpu' with strategy 'parameter_server'"),
        ({**PS, "device": "auto"}, "device", "must be 'cpu'"),
        ({**PS, "entrypoint": "train.py"}, "strategy", "must be 'allreduce' with a script entrypoint"),
        ({**PS, "global_batch": 30}, "global_batch", "divisible by virtual_shards (4)"),
    ],
)
def test_parameter_server_settings_it_cannot_honour_are_refused_naming_which(overrides, field, allowed):
    with pytest.raises(SpecError) as err:
        make_spec(**overrides)
    assert err.value.field == field
    assert allowed in str(err.value)


def test_parameter_server_defaults_to_one_server_and_its_fields_enter_the_hash_only_when_set():
    spec = make_spec(**PS)
    assert spec.parameter_server and spec.servers == 1 and spec.virtual_shards == 4
    assert spec.spec_hash() != make_spec(**PS, servers=2).spec_hash()
    allreduce = make_spec(consistency="bitwise", max_workers=4)
    assert not allreduce.parameter_server and allreduce.servers is None
    assert "strategy" not in allreduce.trajectory()  # all-reduce jobs' hashes do not change
    assert JobSpec.from_dict(spec.to_dict()) == spec
