"""End to end against a real Airflow: scheduler, dag-processor, triggerer and api-server as
separate processes (LocalExecutor, SQLite), one deployment shared by the tests of this module.

Order matters (module-scoped deployment and pool): competing jobs, S3 checkpoints, then the
SIGKILL test, whose failure cools a host down; the newcomer's model beside its DAG last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from devtools.airflow_env import AirflowDeployment
from devtools.demo import held, reached, setup_pool
from elastic_ops.timeline import allocation_sequence, is_subsequence, max_concurrent_holders
from elastic_ops.utils.jobs import job_id
from tests.mlflow_server import require_mlflow, running_server
from tests.s3_server import s3_endpoint, s3_server  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
READER = "reader"  # a read-only user (role viewer; password = name)


@pytest.fixture(scope="module")
def mlflow_uri():
    """A real MLflow server the deployment's tasks track into (``MLFLOW_TRACKING_URI``); None
    where mlflow is not installed (the MLflow checks then skip; in CI they fail)."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        yield None
        return
    with running_server() as server:
        yield server.uri


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, statsd, mlflow_uri):
    """Airflow with the example DAGs + the e2e DAGs, and an 8-slot pool on 2 logical hosts;
    Airflow's metrics go to a StatsD listener, the tracking DAGs' runs to an MLflow server."""
    root = tmp_path_factory.mktemp("e2e")
    dags = root / "dags"
    dags.mkdir()
    for src in [*(REPO / "dags").glob("*.py"), *(HERE / "dags").glob("*.py")]:
        shutil.copy(src, dags / src.name)
    for package in (HERE / "dags").glob("*/__init__.py"):  # models kept beside the DAGs, as users do
        shutil.copytree(package.parent, dags / package.parent.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    metrics = {"AIRFLOW__METRICS__STATSD_ON": "True", "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
               "AIRFLOW__METRICS__STATSD_PORT": str(statsd.port),
               "AIRFLOW__METRICS__STATSD_PREFIX": "airflow"}
    if mlflow_uri:
        metrics["MLFLOW_TRACKING_URI"] = mlflow_uri
    af = AirflowDeployment(home=root / "airflow", dags_folder=dags, plugins_folder=REPO / "plugins",
                           parallelism=4, extra_env=metrics, readers={READER: READER})
    with af:
        pool = setup_pool(f"sqlite:///{af.home / 'elastic_ops_pool.db'}", slots=8, hosts=2)
        yield af, pool


def wait_until(what: str, check, af: AirflowDeployment, timeout: float = 300, detail=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        af.check_alive()
        if check():
            return
        time.sleep(0.3)
    raise AssertionError(f"not reached within {timeout:.0f}s: {what}" + (f"; {detail()}" if detail else ""))


def test_example_dags_parse_without_import_errors(deployment):
    af, _ = deployment
    for dag_id in ("elastic_seed_job1", "elastic_seed_job2", "elastic_train_from_form",
                   "elastic_scheduled_retraining", "digits_prepare_data", "digits_train_on_new_data",
                   "digits_evaluate_and_promote", "e2e_sigkill", "e2e_task_killed", "e2e_newcomer"):
        af.wait_dag(dag_id, timeout=180)
    assert af.api("GET", "/importErrors")["total_entries"] == 0


def test_pool_page_and_controls_through_the_api_server(deployment):
    """The plugin's routes in the real api-server: the UI's menu entry, the status page with a
    bearer token or the UI's session cookie (how the page loads in the UI's frame), a drain and
    its undo through the authenticated route; nothing without a login."""
    af, pool = deployment
    base, token = f"{af.url}/elastic-ops", af.token()
    bearer = {"Authorization": f"Bearer {token}"}
    plugins = {p["name"]: p for p in af.api("GET", "/plugins")["plugins"]}
    views = {v["destination"]: v["href"] for v in plugins["elastic_ops"]["external_views"]}
    job_view = "/elastic-ops/ui/job?dag_id={DAG_ID}&run_id={RUN_ID}"
    assert views == {"nav": "/elastic-ops/ui", "dag_run": job_view}

    anonymous = httpx.get(f"{base}/ui", timeout=30)  # to the login page, and back after it
    assert anonymous.status_code == 303 and "/login?next=%2Felastic-ops%2Fui" in anonymous.headers["location"]
    assert httpx.get(f"{base}/status", timeout=30).status_code == 401
    for auth in ({"headers": bearer}, {"cookies": {"_token": token}}):
        page = httpx.get(f"{base}/ui", timeout=30, **auth)
        assert page.status_code == 200, page.text
        assert "<td>host1</td>" in page.text and "<td>host2</td>" in page.text

    url = f"{base}/hosts/host2/state"
    assert httpx.post(url, json={"state": "draining"}, timeout=30).status_code == 401
    try:
        r = httpx.post(url, json={"state": "draining"}, headers=bearer, timeout=30)
        assert r.status_code == 200, r.text
        assert {h["name"]: h["state"] for h in pool.status()["hosts"]}["host2"] == "draining"
    finally:
        pool.set_host_state("host2", "up")
    r = httpx.post(url, json={"state": "broken"}, headers=bearer, timeout=30)
    assert r.status_code == 422 and "state" in r.text

    # the CLI through the api-server, logging in with the user's name and password
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_OPS_")}
    env.update(ELASTIC_OPS_API_USER=af.user, ELASTIC_OPS_API_PASSWORD=af.password)

    def cli(*argv: str) -> str:
        out = subprocess.run([sys.executable, "-m", "elastic_ops.cli", "pool", "--api-url", af.url, *argv],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    try:
        cli("drain", "host2")
        hosts = {h["name"]: h["state"] for h in json.loads(cli("status", "--json"))["hosts"]}
        assert hosts == {"host1": "up", "host2": "draining"}
    finally:
        pool.set_host_state("host2", "up")


def test_competing_jobs_follow_the_priority_sequence(deployment, statsd):
    af, pool = deployment
    dags = ("elastic_seed_job1", "elastic_seed_job2")
    runs = ("compete_1", "compete_2")
    jobs = [job_id(d, "train_digits", r) for d, r in zip(dags, runs, strict=True)]
    # Between two chunks a job keeps its slots (parked), so what matters is that job 1 has not
    # reached its last chunk when the priority changes (else it may finish before shrinking to
    # 3): three chunks of 300 iterations, with the agent about 50 iterations a second on 8
    # workers, while job 2's run starts within a few seconds (more on a slow machine).
    af.trigger(dags[0], {"iterations": 900, "priority": 3}, run_id=runs[0])
    wait_until("job 1 on 8", lambda: held(pool).get(jobs[0]) == 8, af)
    af.trigger(dags[1], {"iterations": 1200, "priority": 3}, run_id=runs[1])
    wait_until("4 / 4", lambda: reached(pool, jobs, [(8, 0), (4, 4)]), af)

    # Raise job 2's priority through the plugin's authenticated REST route.
    url = f"{af.url}/elastic-ops/jobs/{jobs[1]}/priority"
    assert httpx.post(url, json={"priority": 5}, timeout=30).status_code == 401
    r = httpx.post(url, json={"priority": 5}, headers={"Authorization": f"Bearer {af.token()}"}, timeout=30)
    assert r.status_code == 200, r.text

    wait_until("3 / 5", lambda: reached(pool, jobs, [(8, 0), (4, 4), (3, 5)]), af,
               detail=lambda: f"allocation sequence {allocation_sequence(pool.events(), jobs)}")
    assert af.wait_run(dags[0], runs[0], timeout=400) == "success"
    assert af.wait_run(dags[1], runs[1], timeout=400) == "success"
    events = pool.events()
    seq = allocation_sequence(events, jobs)
    assert is_subsequence([(8, 0), (4, 4), (3, 5), (0, 8)], seq), seq
    assert max_concurrent_holders(events) == 1
    # the chunk tasks' and the pool's metrics reached the deployment's StatsD (sent when a
    # chunk ends: wait a moment for the last UDP datagrams)
    wait_until("metrics", lambda: sum(int(v.split("|")[0]) for v in statsd.named(
        "airflow.elastic_ops.chunk.iterations")) == 900 + 1200, af, timeout=30,
        detail=lambda: str(statsd.named("airflow.elastic_ops.chunk.iterations")))
    workers = {int(v.split("|")[0]) for v in statsd.named("airflow.elastic_ops.chunk.workers")}
    assert {8, 4, 3, 5, 0} <= workers, workers
    assert "8|g" in statsd.named("airflow.elastic_ops.pool.slots_up")
    assert statsd.named("airflow.elastic_ops.pool.event.grant")
    # every chunk task has an "Elastic pool" button to the pool's page
    chunk = next(t["task_id"] for t in af.task_instances(dags[0], runs[0]) if ".chunk_" in t["task_id"])
    links = af.api("GET", f"/dags/{dags[0]}/dagRuns/{runs[0]}/taskInstances/{chunk}/links")["extra_links"]
    assert links == {"Elastic pool": f"{af.url}/dags/{dags[0]}/runs/{runs[0]}/plugin/elastic-job"}
    assert statsd.named("airflow.elastic_ops.chunk.wait")
    assert statsd.named("airflow.elastic_ops.chunk.samples_per_s")
    for n in (0, 1):  # each job kept slots from its first grant to its end: chunks handed over
        holds = [state[n] > 0 for state in seq]
        first, last = holds.index(True), len(holds) - 1 - holds[::-1].index(True)
        assert all(holds[first:last + 1]), f"job {n + 1} dropped to 0 workers mid-run: {seq}"


class ScriptedJob:
    """A job in the pool that this test drives as a chunk would: it asks, then heartbeats and
    follows each target at once (its iteration boundaries are the test's calls)."""

    def __init__(self, pool, name: str, priority: int) -> None:
        self.pool, self.name, self.epoch, self.workers = pool, name, None, 0
        pool.submit(name, min_workers=1, max_workers=8, priority=priority)

    def step(self) -> bool:
        """One boundary; whether the allocation changed."""
        from elastic_ops.pool import Grant

        if self.epoch is None:
            got = self.pool.request(self.name)
            if isinstance(got, Grant):
                self.epoch, self.workers = got.epoch, got.workers
                return True
            return False
        target = self.pool.heartbeat(self.name, self.epoch, workers=self.workers)
        changed = target.workers != self.workers
        self.workers = target.workers
        return changed

    def finish(self) -> None:
        if self.epoch is not None:
            self.pool.release(self.name, self.epoch, finished=True)


def settle(jobs: list[ScriptedJob], af: AirflowDeployment) -> None:
    """Boundaries until no job's allocation changes (a few rounds: each shrink frees slots first)."""
    quiet = 0
    for _ in range(50):
        af.check_alive()
        quiet = 0 if any([j.step() for j in jobs]) else quiet + 1
        if quiet >= 2:
            return
    raise AssertionError(f"the pool did not settle: {[(j.name, j.workers) for j in jobs]}")


def test_the_views_in_a_real_browser_follow_the_ledger_and_its_controls(deployment):
    """Chromium against the api-server: log in, the pool view's chart and tables show the two
    running jobs as the ledger has them; raising a priority through the control changes the
    ledger and the chart follows; a refused change shows the API's message; the job view of the
    competing jobs' run opens inside the Airflow UI (the run's tab) with its iterations and
    chunks; a read-only user sees no controls. Screenshots of each view go to test-artifacts/ui."""
    from tests.e2e.browser import artifacts_dir, browser, log_in

    af, pool = deployment
    shots = artifacts_dir()
    jobs = [ScriptedJob(pool, "ui_low", 3), ScriptedJob(pool, "ui_high", 3)]

    def ledger() -> dict[str, dict]:
        return {j["name"]: j for j in pool.status()["jobs"]}

    def chart(page, job: str) -> int:
        series = page.locator(f'svg.pool-chart polygon.series[data-job="{job}"]')
        return int(series.get_attribute("data-workers"))

    try:
        settle(jobs, af)
        assert {j.name: j.workers for j in jobs} == {"ui_low": 4, "ui_high": 4}
        with browser() as b:
            context = b.new_context(viewport={"width": 1400, "height": 1000})
            page = log_in(context, f"{af.url}/elastic-ops/ui", af.user, af.password)
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.wait_for_selector("svg.pool-chart")
            for j in jobs:  # the chart's series and the jobs table say what the ledger says
                assert chart(page, j.name) == ledger()[j.name]["workers"] == 4
                row = page.locator("table.jobs").first.locator("tr", has_text=j.name)
                assert row.locator("td").nth(2).inner_text().startswith("4 / 4")
            page.screenshot(path=str(shots / "pool_view.png"), full_page=True)
            finished = page.locator("details.finished")
            finished.locator("summary").click()
            link = finished.locator("tr", has_text="compete_1").locator("a.job-link")
            assert link.get_attribute("href") == "/dags/elastic_seed_job1/runs/compete_1/plugin/elastic-job"

            # raise ui_high's priority through the control: the ledger changes, the chart follows
            control = page.locator('form.control[data-path="/jobs/ui_high/priority"]')
            control.locator("input[name=priority]").fill("5")
            page.once("dialog", lambda d: d.accept())
            control.locator("button").click()
            wait_until("priority 5 in the ledger", lambda: ledger()["ui_high"]["priority"] == 5, af,
                       timeout=60)
            settle(jobs, af)
            assert (ledger()["ui_low"]["workers"], ledger()["ui_high"]["workers"]) == (3, 5)
            page.wait_for_selector('svg.pool-chart polygon.series[data-job="ui_high"][data-workers="5"]')
            assert chart(page, "ui_low") == 3
            page.screenshot(path=str(shots / "pool_view_after_priority.png"), full_page=True)

            # a change the pool refuses: its message on the page, nothing changed
            bounds = page.locator('form.control[data-path="/jobs/ui_low/bounds"]')
            bounds.locator("input[name=min_workers]").fill("6")
            bounds.locator("input[name=max_workers]").fill("2")
            page.once("dialog", lambda d: d.accept())
            bounds.locator("button").click()
            page.wait_for_selector("#eo-error:not([hidden])")
            assert "min_workers" in page.locator("#eo-error").inner_text()
            assert ledger()["ui_low"]["max_workers"] == 8

            # the job view of the competing jobs' first run, as the Airflow UI shows it (the
            # chunk's "Elastic pool" link goes there), and on its own
            dag, run = "elastic_seed_job1", "compete_1"
            job = job_id(dag, "train_digits", run)
            page.goto(f"{af.url}/dags/{dag}/runs/{run}/plugin/elastic-job")
            frame = page.frame_locator("iframe")
            frame.locator("svg.job-chart").wait_for()
            series = frame.locator(f'svg.job-chart polyline.workers[data-job="{job}"]')
            assert int(series.get_attribute("data-workers")) == ledger()[job]["workers"] == 0
            assert frame.locator("svg.job-chart polyline.iterations").get_attribute("data-iteration") == "900"
            chunk_states = frame.locator("table.chunks tbody tr td:nth-child(2)").all_inner_texts()
            assert chunk_states == ["success"] * 3
            assert "900 of 900 iterations committed" in frame.locator("p.state").inner_text()
            series = httpx.get(f"{af.url}/elastic-ops/timeline", timeout=30,
                               params={"job": job, "dag_id": dag, "run_id": run},
                               headers={"Authorization": f"Bearer {af.token()}"}).json()
            assert series["progress"][job][-1][1] == 900 and series["held"][job][-1][1] == 0
            page.screenshot(path=str(shots / "job_view_in_airflow.png"), full_page=True)
            own = context.new_page()
            own.goto(f"{af.url}/elastic-ops/ui/job?dag_id={dag}&run_id={run}")
            own.wait_for_selector("svg.job-chart")
            assert own.locator("table.checkpoints tbody tr").count() == 3
            own.screenshot(path=str(shots / "job_view.png"), full_page=True)
            own.goto(f"{af.url}/elastic-ops/ui/job?dag_id=elastic_seed_job2&run_id=compete_2")
            own.wait_for_selector("svg.job-chart polyline.iterations[data-iteration='1200']")
            own.screenshot(path=str(shots / "job_view_2.png"), full_page=True)  # the README's
            page.goto(f"{af.url}/plugin/elastic-pool")  # the pool view's own entry in the navigation
            page.frame_locator("iframe").locator("svg.pool-chart").wait_for()
            page.screenshot(path=str(shots / "pool_view_in_airflow.png"))
            assert not [p for p in problems if "Content Security Policy" in p or "Refused" in p], problems
            context.close()

            reader = b.new_context(viewport={"width": 1400, "height": 1000})
            view = log_in(reader, f"{af.url}/elastic-ops/ui", READER, READER)
            view.wait_for_selector("svg.pool-chart")
            assert chart(view, "ui_high") == 5
            assert view.locator("form.control").count() == 0
            view.screenshot(path=str(shots / "pool_view_read_only.png"), full_page=True)
            reader.close()
    finally:
        for j in jobs:
            j.finish()


def test_form_params_reject_bad_values_and_s3_checkpoints_use_the_aws_connection(deployment, s3_endpoint):  # noqa: F811
    af, _ = deployment
    with pytest.raises(RuntimeError, match="400"):
        af.trigger("elastic_train_from_form", {"max_workers": 99})
    with pytest.raises(RuntimeError, match="400"):
        af.trigger("elastic_train_from_form", {"checkpoint": "ftp://nope"})

    creds = s3_endpoint.credentials
    af.api("POST", "/connections", json={
        "connection_id": "aws_default", "conn_type": "aws", "login": creds["aws_access_key_id"],
        "password": creds["aws_secret_access_key"],
        "extra": json.dumps({"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region}),
    })
    uri = s3_endpoint.uri("form")
    run = af.trigger("elastic_train_from_form", {"iterations": 4, "max_workers": 1, "checkpoint": uri},
                     run_id="s3_run")
    assert af.wait_run("elastic_train_from_form", run, timeout=400) == "success"
    summary = af.xcom("elastic_train_from_form", run, "train.finalize")
    assert summary["checkpoint_uri"].startswith(f"{uri}/s3_run/") and summary["iteration"] == 4
    keys = [o["Key"] for o in s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket)["Contents"]]
    assert any(k.startswith("form/s3_run/") for k in keys)


def kill_one_worker(home: Path) -> int | None:
    """SIGKILL one training worker of a chunk task running under this Airflow home.

    Workers are children of a fork server: the deployment's elastic-ops agent's (the chunk
    tasks run their chunks there), or a task's own without an agent. It was exec'd with that
    process's environment, so its ``AIRFLOW_HOME`` says which deployment it belongs to.
    """
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if "multiprocessing.forkserver" not in " ".join(proc.info["cmdline"] or []):
            continue
        try:
            if proc.environ().get("AIRFLOW_HOME") != str(home):
                continue
            workers = proc.children()
        except (psutil.Error, OSError):
            continue
        if workers:
            os.kill(workers[-1].pid, signal.SIGKILL)
            return workers[-1].pid
    return None


REFERENCE = """
import sys
from elastic_ops.runtime import run_chunk
from elastic_ops.spec import JobSpec
spec = JobSpec(name="ref", entrypoint="elastic_ops.examples.digits:DigitsMLP", total_iterations=240,
               chunk_iterations=240, global_batch=64, max_workers=2, consistency="bitwise",
               virtual_shards=2, data_seed=3, params={"hidden": 32, "depth": 1},
               checkpoint="file://" + sys.argv[1])
print("SHA", run_chunk(spec, 0, 240, target=lambda i: 1).param_sha256)
"""


def start_reference(tmp_path: Path) -> subprocess.Popen:
    """The same job trained without Airflow, in one uninterrupted run on one worker."""
    return subprocess.Popen([sys.executable, "-c", REFERENCE, str(tmp_path / "ref")], stdout=subprocess.PIPE,
                            text=True)


def finished_after_one_retry(af: AirflowDeployment, run: str, reference: subprocess.Popen) -> tuple[str, str]:
    """Wait for the ``e2e_sigkill`` run to succeed with exactly one retry, of one chunk task:
    that task's id and the SHA-256 of the uninterrupted ``reference`` run's model."""
    assert af.wait_run("e2e_sigkill", run, timeout=500) == "success"
    out, _ = reference.communicate(timeout=300)
    tries = {t["task_id"]: t["try_number"] for t in af.task_instances("e2e_sigkill", run)}
    retried = [tid for tid, n in tries.items() if n > 1]
    assert len(retried) == 1 and tries[retried[0]] == 2, tries  # exactly one retry, of one chunk
    return retried[0], out.split("SHA ")[-1].strip()


def test_killed_worker_is_retried_on_another_host_from_the_latest_checkpoint(deployment, tmp_path, request,
                                                                             mlflow_uri):
    af, pool = deployment
    reference = start_reference(tmp_path)
    request.addfinalizer(lambda: (reference.kill(), reference.wait()))  # not left running on a failure
    from elastic_ops.checkpoint import open_store

    run = af.trigger("e2e_sigkill", run_id="kill_run")
    job = job_id("e2e_sigkill", "train", run)
    store = open_store(f"file://{af.home}/elastic_ops_checkpoints/e2e_sigkill/train/{run}")
    wait_until("first checkpoint of chunk 1", lambda: (r := store.latest()) is not None and r.iteration >= 20,
               af)
    killed_at = store.latest().iteration
    wait_until("a worker to kill", lambda: kill_one_worker(af.home) is not None, af, timeout=60)

    retried, ref_sha = finished_after_one_retry(af, run, reference)
    failures = [e for e in pool.events(job=job) if e["kind"] == "failure"]
    assert len(failures) == 1
    failed_host = failures[0]["host"]
    result = af.xcom("e2e_sigkill", run, retried)
    assert failed_host not in result["hosts"]  # the retry's grant avoided the failed host
    assert 0 < killed_at <= result["workers_timeline"][0][0] < 240  # resumed mid-chunk from a checkpoint
    # the task log (the UI) says where the retry resumed from and why it ran
    log = (af.home / "logs" / "dag_id=e2e_sigkill" / f"run_id={run}" / f"task_id={retried}" / "attempt=2.log")
    text = log.read_text()
    assert "chunk 1 [0, 240), try 2, a retry after WorkerLostError: " in text
    assert f"on {failed_host}; the grant avoids {failed_host}: resumes from the checkpoint at iteration " \
           f"{result['workers_timeline'][0][0]} (file://" in text
    summary = af.xcom("e2e_sigkill", run, "train.finalize")
    assert summary["param_sha256"] == ref_sha  # bitwise identical to an uninterrupted run
    tracked_in_one_mlflow_run(mlflow_uri, job, summary, tmp_path)


def tracked_in_one_mlflow_run(uri: str | None, job: str, summary: dict, tmp_path: Path) -> None:
    """The retried job is one MLflow run (experiment: the DAG id): the loss at every iteration,
    once; the failure counted; the final model logged, its URI in the summary."""
    if uri is None:
        require_mlflow()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("e2e_sigkill")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`elastic_ops.job` = '{job}'")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    # through the agent progress is sampled; the chunks' results carry every step's loss
    assert sorted(steps) == list(range(1, 241))  # every iteration, once
    assert run.data.tags["elastic_ops.failures"] == "1" and run.info.status == "FINISHED"
    assert run.data.params["params.pace_s"] == "0.03"
    assert summary["mlflow_run_id"] == run.info.run_id
    import mlflow.pytorch

    mlflow.set_tracking_uri(uri)  # models:/ URIs resolve through it
    (tmp_path / "model").mkdir()
    model = mlflow.pytorch.load_model(summary["mlflow_model_uri"], dst_path=str(tmp_path / "model"))
    assert sum(p.numel() for p in model.parameters()) > 0


def kill_task_process(af: AirflowDeployment, ti_id: str) -> int | None:
    """SIGKILL the process running task instance ``ti_id`` (the task SDK titles it
    ``airflow worker -- <ti id>``); its pid, or None while it is not running."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if " ".join(proc.info["cmdline"] or []).strip() != f"airflow worker -- {ti_id}":
            continue
        os.kill(proc.info["pid"], signal.SIGKILL)
        return proc.info["pid"]
    return None


def test_a_chunk_task_killed_on_its_last_try_leaves_no_job_in_the_pool(deployment, request):
    """No ``on_kill`` runs for a SIGKILLed task: its lease would expire after its TTL and its
    demand stay in the plan until ``job_idle_s``; the group's ``end_job`` teardown ends it."""
    af, pool = deployment
    from elastic_ops.checkpoint import open_store

    run = af.trigger("e2e_task_killed", run_id="task_kill_run")
    job = job_id("e2e_task_killed", "train", run)
    store = open_store(f"file://{af.home}/elastic_ops_checkpoints/e2e_task_killed/train/{run}")
    wait_until("first checkpoint", lambda: (r := store.latest()) is not None and r.iteration >= 20, af)
    (ti,) = [t for t in af.task_instances("e2e_task_killed", run) if t["task_id"] == "train.chunk_01_of_01"]
    assert kill_task_process(af, ti["id"]) is not None
    assert af.wait_run("e2e_task_killed", run, timeout=300) == "failed"
    states = {t["task_id"]: t["state"] for t in af.task_instances("e2e_task_killed", run)}
    assert states["train.chunk_01_of_01"] == "failed" and states["train.finalize"] == "upstream_failed"
    assert states["train.end_job"] == "success"
    assert af.xcom("e2e_task_killed", run, "train.end_job") == {"job": job, "ended": True}
    (row,) = [j for j in pool.status()["jobs"] if j["name"] == job]
    assert row["state"] == "finished" and row["workers"] == 0 and row["placements"] == []
    assert store.latest().iteration >= 20  # the committed checkpoint survived the kill


def test_a_model_beside_the_dag_trains_on_the_agent_started_as_the_readme_says(deployment):
    """Issue 25: the agent could not import ``newcomer_models.seqgru`` (the DAG could), and the
    chunk failed for good. The task hands the agent its import path; the chunk trains there.
    Last in the module: its iterations would count in the competing jobs' metrics."""
    af, _ = deployment
    agent_env = psutil.Process(af.procs["agent"].pid).environ()
    assert str(af.dags_folder) not in agent_env.get("PYTHONPATH", "")  # as docs/howto/agents.md starts it
    run = af.trigger("e2e_newcomer", run_id="newcomer_run")
    assert af.wait_run("e2e_newcomer", run, timeout=300) == "success"
    result = af.xcom("e2e_newcomer", run, "train.chunk_01_of_01")
    assert result["status"] == "completed" and result["iterations"] == 30
    agent_log = (af.home / "logs" / "agent.log").read_text()
    assert "job e2e_newcomer" in agent_log and "pids rank0=" in agent_log  # it ran on the agent
