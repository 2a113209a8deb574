"""``elastic_training``: task-group expansion and parse-time validation."""

from __future__ import annotations

from pathlib import Path

import pendulum
import pytest
from airflow.sdk import DAG, Asset

from elastic_ops.errors import SpecError
from elastic_ops.operators import (
    ElasticChunkOperator,
    ElasticEndJobOperator,
    ElasticFinalizeOperator,
    ElasticRegisterOperator,
    ElasticRetryPolicy,
)
from elastic_ops.taskgroup import elastic_training
from elastic_ops.utils.jobs import runtime_spec

DIGITS = "elastic_ops.examples.digits:DigitsMLP"
REPO = Path(__file__).resolve().parents[2]


def make_dag(**kwargs):
    """A DAG holding one ``elastic_training`` group built from ``kwargs`` (small defaults)."""
    args = {"task_id": "train", "trainable": DIGITS, "total_iterations": 100, "chunk_iterations": 30,
            "min_workers": 1, "max_workers": 4, "priority": 2} | kwargs
    with DAG(dag_id="d", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")) as dag:
        group = elastic_training(**args)
    return dag, group


def chain_of(dag) -> list[str]:
    """Follow the single downstream edge (teardowns aside) from ``train.register`` to the end."""
    order, task = [], dag.get_task("train.register")
    while task is not None:
        order.append(task.task_id)
        downs = [t for t in task.downstream_list if not t.is_teardown]
        assert len(downs) <= 1
        task = downs[0] if downs else None
    return order


def test_expands_into_register_chunks_finalize_in_a_line():
    dag, _ = make_dag()
    assert chain_of(dag) == [
        "train.register", "train.chunk_01_of_04", "train.chunk_02_of_04", "train.chunk_03_of_04",
        "train.chunk_04_of_04", "train.finalize",
    ]
    assert isinstance(dag.get_task("train.register"), ElasticRegisterOperator)
    assert isinstance(dag.get_task("train.finalize"), ElasticFinalizeOperator)
    chunks = [t for t in dag.tasks if isinstance(t, ElasticChunkOperator)]
    assert [c.chunk_index for c in chunks] == [0, 1, 2, 3]
    assert all(isinstance(c.retry_policy, ElasticRetryPolicy) and c.retries >= 1 for c in chunks)
    # a bad rendered value fails register and finalize at once, whatever retries default_args give
    assert isinstance(dag.get_task("train.register").retry_policy, ElasticRetryPolicy)
    assert isinstance(dag.get_task("train.finalize").retry_policy, ElasticRetryPolicy)
    assert dag.get_task("train.finalize").chunk_task_ids == [c.task_id for c in chunks]
    # ...and a retryable one (the pool's database briefly away) is retried, as in a chunk
    assert [dag.get_task(f"train.{t}").retries for t in ("register", "finalize", "end_job")] == [3, 3, 3]


def test_default_args_win_over_the_operators_own_defaults():
    """The operators' retry defaults set with setdefault overrode the DAG's default_args (Airflow
    applies those only to arguments the call lacks): retries=1 there still gave chunks 3."""
    with DAG(dag_id="d", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
             default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=30)}) as dag:
        elastic_training(task_id="train", trainable=DIGITS, total_iterations=60, chunk_iterations=30,
                         chunk_kwargs={"retry_delay": pendulum.duration(seconds=9)})
    assert {t.retries for t in dag.tasks} == {1}
    delays = {t.task_id: t.retry_delay.total_seconds() for t in dag.tasks}
    assert delays["train.register"] == 30 and delays["train.chunk_01_of_02"] == 9  # explicit wins over both
    assert all(isinstance(t.retry_policy, ElasticRetryPolicy) for t in dag.tasks)


def test_end_job_is_the_groups_teardown_and_stays_out_of_its_wiring():
    """It runs however the chunks ended (a chunk killed on its last try ends nothing itself), is
    left out of the run's state, and ``upstream >> group >> downstream`` still wire register and
    finalize."""
    from airflow.providers.standard.operators.empty import EmptyOperator

    with DAG(dag_id="d", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")) as dag:
        before = EmptyOperator(task_id="before")
        group = elastic_training(task_id="train", trainable=DIGITS, total_iterations=60,
                                 chunk_iterations=30, max_workers=2)
        after = EmptyOperator(task_id="after")
        before >> group >> after
    end_job = dag.get_task("train.end_job")
    assert isinstance(end_job, ElasticEndJobOperator)
    assert end_job.is_teardown and not end_job.on_failure_fail_dagrun
    # every chunk too: one cleared alone (Airflow clears register and end_job with it, not
    # finalize) is done before the job is ended
    assert end_job.upstream_task_ids == {"train.register", "train.chunk_01_of_02", "train.chunk_02_of_02",
                                         "train.finalize"}
    assert end_job.heartbeat_interval == dag.get_task("train.chunk_01_of_02").heartbeat_interval
    assert dag.get_task("train.register").is_setup
    assert after.upstream_task_ids == {"train.finalize"}
    assert before.downstream_task_ids == {"train.register"}


def test_finalize_emits_the_model_asset_and_previous_warm_start_reads_it():
    asset = Asset(name="m", uri="s3://models/digits")
    dag, group = make_dag(model_asset=asset, warm_start="previous", checkpoint="s3://models/digits")
    assert dag.get_task("train.finalize").outlets == [asset]
    assert group.model_asset == asset
    assert dag.get_task("train.chunk_01_of_04").inlets == [asset]
    assert dag.get_task("train.chunk_02_of_04").inlets == []


def test_default_model_asset_points_at_the_checkpoint_root():
    dag, group = make_dag(checkpoint="s3://models/digits")
    assert group.model_asset.uri == "s3://models/digits"
    assert dag.get_task("train.finalize").outlets == [group.model_asset]


def test_chunk_kwargs_reach_the_chunk_tasks():
    dag, _ = make_dag(chunk_kwargs={"retries": 7})
    assert dag.get_task("train.chunk_01_of_04").retries == 7


def test_warm_start_previous_adds_the_model_asset_to_the_users_inlets():
    theirs = Asset(name="tokenizer", uri="s3://models/tokenizer")
    dag, group = make_dag(warm_start="previous", checkpoint="s3://models/digits",
                          chunk_kwargs={"inlets": [theirs]})
    assert dag.get_task("train.chunk_01_of_04").inlets == [theirs, group.model_asset]  # was [model_asset]
    assert dag.get_task("train.chunk_02_of_04").inlets == [theirs]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_workers": 5, "max_workers": 2}, "min_workers"),
    ({"chunk_iterations": 500}, "chunk_iterations"),
    ({"checkpoint": "ftp://x"}, "checkpoint"),
    ({"priority": 0}, "priority"),
    ({"trainable": "not an entrypoint"}, "entrypoint"),
    ({"consistency": "sloppy"}, "consistency"),
    ({"total_iterations": "{{ params.n }}"}, "num_chunks"),
    ({"trainable": "{{ params.model }}"}, "entrypoint"),
    ({"num_chunks": 0, "chunk_iterations": None}, "num_chunks"),
    ({"num_chunks": 101, "chunk_iterations": None}, "num_chunks"),
    ({"num_chunks": 2}, "chunk_iterations"),  # both given: one would be silently ignored
    ({"name": "other"}, "name"),
    # the spec reference's name for trainable=: it replaced trainable silently, training another model
    ({"entrypoint": "other.models:Model"}, "entrypoint"),
    ({"warm_start": "{{ params.x }}"}, "warm_start"),
    ({"warm_start": "previos"}, "warm_start"),
    ({"warm_start": "s3://"}, "warm_start"),
    ({"warm_start": 5}, "warm_start"),
    ({"total_iterations": 20_000, "chunk_iterations": 1}, "chunk_iterations"),  # 20,000 tasks
    ({"host_selector": {"gpu": 100}}, "host_selector"),
    ({"host_selector": "gpu=h100"}, "host_selector"),
    # a templated total: num_chunks alone decides the task count, up to the spec's 1,000
    ({"total_iterations": "{{ params.n }}", "num_chunks": 5000, "chunk_iterations": None}, "num_chunks"),
    ({"model_asset": "s3://x/y"}, "model_asset"),
    ({"warm_start": "previous", "checkpoint": "{{ params.ck }}"}, "model_asset"),  # no Asset URI to hold it
    ({"chunk_kwargs": ["retries"]}, "chunk_kwargs"),
    # keys the group sets on each chunk itself: a raw "got multiple values" TypeError before
    ({"chunk_kwargs": {"task_id": "x"}}, "chunk_kwargs['task_id']"),
    ({"chunk_kwargs": {"warm_start": "s3://m/x"}}, "chunk_kwargs['warm_start']"),
    ({"chunk_kwargs": {"aws_conn_id": "aws_other"}}, "chunk_kwargs['aws_conn_id']"),
    ({"chunk_kwargs": {"retries": -1}}, "chunk_kwargs['retries']"),
    ({"elastic_ops_conn_id": ""}, "elastic_ops_conn_id"),
    ({"elastic_ops_conn_id": 5}, "elastic_ops_conn_id"),
    ({"aws_conn_id": 5}, "aws_conn_id"),
    # Airflow's raw ValueError (the group id) or TypeError (safe_name) before
    ({"task_id": "bad id!"}, "task_id"),
    ({"task_id": ""}, "task_id"),
    ({"task_id": 5}, "task_id"),
])
def test_bad_arguments_fail_at_parse_time_naming_the_field(kwargs, field):
    with pytest.raises(SpecError) as err:
        make_dag(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)


def test_templates_are_accepted_at_parse_time_and_kept_for_rendering():
    dag, _ = make_dag(total_iterations="{{ params.iterations }}", num_chunks=3, chunk_iterations=None,
                      max_workers="{{ params.max_workers }}", priority="{{ params.priority }}")
    chunks = [t for t in dag.tasks if isinstance(t, ElasticChunkOperator)]
    assert len(chunks) == 3
    assert chunks[0].spec_fields["max_workers"] == "{{ params.max_workers }}"
    assert "spec_fields" in ElasticChunkOperator.template_fields


def test_other_templated_fields_parse_and_are_checked_once_rendered():
    """The parse-time stand-in for a templated keep_last, device, … was None: the DAG failed to
    import with "invalid keep_last=None", a value the user never gave."""
    templated = {"keep_last": "{{ params.keep }}", "device": "{{ params.device }}",
                 "threads_per_worker": "{{ params.threads }}", "params": "{{ params.hp }}"}
    with DAG(dag_id="d", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
             render_template_as_native_obj=True) as dag:  # params renders to a dict only so
        elastic_training(task_id="train", trainable=DIGITS, total_iterations=100, chunk_iterations=30,
                         **templated)
    chunk = next(t for t in dag.tasks if isinstance(t, ElasticChunkOperator))
    assert all(chunk.spec_fields[k] == v for k, v in templated.items())

    def rendered(**values):
        fields = chunk.spec_fields | {"keep_last": "5", "device": "cpu", "threads_per_worker": "2",
                                      "params": {"lr": 0.1}} | values
        return runtime_spec(fields, name="j", checkpoint_root="file:///tmp/ck", run_id="r")

    assert (rendered().keep_last, rendered().threads_per_worker) == (5, 2)
    for field, value in (("keep_last", "0"), ("device", "gpu"), ("threads_per_worker", "many"),
                         ("params", "lr=0.1")):
        with pytest.raises(SpecError) as err:
            rendered(**{field: value})
        assert err.value.field == field


@pytest.mark.parametrize("field", ["params", "host_selector", "stop_when", "script_args"])
def test_a_templated_mapping_or_list_needs_a_dag_that_renders_native_objects(field):
    """Jinja renders "{{ params.hp }}" to the string "{'lr': 0.1}": it parsed here, and the
    register task failed with "invalid params=\"{'lr': 0.1}\": must be a mapping"."""
    with pytest.raises(SpecError, match="renders to a string here.*render_template_as_native_obj") as err:
        make_dag(**{field: "{{ params.x }}"})
    assert err.value.field == field


def test_a_rule_between_a_templated_choice_and_a_given_value_waits_for_the_rendered_value():
    """A templated scaling stood in as its default, 'fixed', and refused the DAG: "invalid
    warmup_iterations=10: must be 0 with scaling 'fixed'", a scaling the user never gave."""
    make_dag(scaling="{{ params.scaling }}", warmup_iterations=10, max_workers=4)
    make_dag(preemptible="{{ params.p }}", device="{{ params.d }}", scaling="{{ params.s }}",
             warmup_iterations=10, min_workers="{{ params.n }}")
    # no value it may render to passes: refused, saying what stood in for the template
    with pytest.raises(SpecError, match=r"warmup_iterations=10: must be 0 with scaling 'fixed'") as err:
        make_dag(device="{{ params.d }}", warmup_iterations=10)
    assert "checked at parse time with device='cpu' in place of the template" in err.value.hint
    with pytest.raises(SpecError, match="keep_last") as err:
        make_dag(scaling="{{ params.s }}", keep_last=0)
    assert "scaling='fixed' in place of the template" in err.value.hint


def test_num_chunks_with_a_fixed_total_sets_the_chunk_count():
    dag, _ = make_dag(total_iterations=10, chunk_iterations=None, num_chunks=4)
    assert len([t for t in dag.tasks if isinstance(t, ElasticChunkOperator)]) == 4


def test_the_trigger_forms_params_take_an_empty_checkpoint_and_refuse_bad_values(monkeypatch, tmp_path):
    """``dags/elastic_train_params.py``: empty checkpoint = the default (as its form says)."""
    import copy
    import runpy

    from airflow.sdk import DAG as SdkDAG
    from airflow.sdk.exceptions import ParamValidationError

    made, leave = [], SdkDAG.__exit__

    def keep(self, *exc):  # the file builds its DAG in a `with` block, assigned to no name
        made.append(self)
        return leave(self, *exc)

    monkeypatch.setattr(SdkDAG, "__exit__", keep)
    runpy.run_path(str(REPO / "dags" / "elastic_train_params.py"))
    (dag,) = made

    def validate(conf):
        params = copy.deepcopy(dag.params)
        params.update(conf)
        params.validate()

    for good in ({"checkpoint": ""}, {"checkpoint": None}, {"checkpoint": "s3://bucket/p"},
                 {"checkpoint": "file:///data/ck"}, {"checkpoint": "s3://my.bucket-1/a..b"}):
        validate(good)
    # bucket names S3 refuses are refused by the form too, as by the spec (they passed the form)
    for bad in ({"checkpoint": "s3://a..b/x"}, {"checkpoint": "s3://192.168.1.1/x"},
                {"checkpoint": "s3://192.168.1.1"}):
        with pytest.raises(ParamValidationError):
            validate(bad)
    for bad in ({"checkpoint": "ftp://x"}, {"checkpoint": "s3://B/x"}, {"max_workers": 99},
                {"priority": 0}, {"iterations": "many"}):
        with pytest.raises(ParamValidationError):
            validate(bad)


def test_the_dag_serializes_for_the_scheduler():
    from airflow.serialization.serialized_objects import DagSerialization

    dag, _ = make_dag(warm_start="previous")
    data = DagSerialization.to_dict(dag)
    rebuilt = DagSerialization.from_dict(data)
    assert set(rebuilt.task_dict) == set(dag.task_dict)
    assert rebuilt.get_task("train.chunk_01_of_04").has_retry_policy


def test_groups_of_the_same_name_in_different_parents_stay_apart():
    """model_a/train and model_b/train: two pool jobs, two checkpoint roots, two model Assets."""
    from airflow.sdk import TaskGroup

    with DAG(dag_id="d", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")) as dag:
        groups = []
        for parent in ("model_a", "model_b"):
            with TaskGroup(group_id=parent):
                groups.append(elastic_training(task_id="train", trainable=DIGITS, total_iterations=20,
                                               chunk_iterations=10, max_workers=2))
    chunks = [dag.get_task(f"{p}.train.chunk_01_of_02") for p in ("model_a", "model_b")]
    assert [c.group_id for c in chunks] == ["model_a.train", "model_b.train"]
    context = {"dag": dag, "run_id": "r1"}
    specs = [c._spec(context) for c in chunks]
    assert specs[0].name != specs[1].name and specs[0].checkpoint != specs[1].checkpoint
    assert groups[0].model_asset.name != groups[1].model_asset.name


def test_a_misspelt_param_of_a_trainable_the_dag_imports_fails_at_parse_time():
    """The DAG file imports its model (as users do): the dag-processor's import error names the
    parameter and the one meant, instead of four workers failing with a traceback."""
    import elastic_ops.examples.digits  # noqa: F401 - what the DAG file does

    with pytest.raises(SpecError) as err:
        make_dag(params={"hiden": 32})
    assert "invalid params.hiden=32: DigitsMLP takes no parameter 'hiden'" in str(err.value)
    assert "did you mean 'hidden'?" in str(err.value)
    make_dag(params={"hidden": 32})


def test_the_tenant_comes_from_the_argument_else_a_dag_tag_else_default():
    def spec_of(tags, **kwargs):
        args = {"task_id": "train", "trainable": DIGITS, "total_iterations": 100, "chunk_iterations": 50}
        start = pendulum.datetime(2024, 1, 1, tz="UTC")
        with DAG(dag_id="d", schedule=None, start_date=start, tags=tags) as dag:
            elastic_training(**args, **kwargs)
        fields = dag.get_task("train.register").spec_fields
        return runtime_spec(fields, name="d.train.r", checkpoint_root="file:///tmp/x", run_id="r")

    assert spec_of(["tenant:vision", "ml"]).tenant == "vision"
    assert spec_of(["tenant:vision"], tenant="nlp").tenant == "nlp"
    assert spec_of([]).tenant == "default"
    with pytest.raises(SpecError, match="at most one tenant:NAME tag"):
        spec_of(["tenant:a", "tenant:b"])
    with pytest.raises(SpecError, match="tenant"):
        spec_of([], tenant="no spaces")
