"""A real Airflow deployment for the demo and the end-to-end tests.

``AirflowDeployment`` writes an ``AIRFLOW_HOME`` (SQLite metadata, LocalExecutor, simple auth
manager with one admin user), migrates the database, and starts the scheduler, dag-processor,
triggerer and api-server as separate processes, each in its own process group, so that
:meth:`stop` can end every process they started (terminate, then kill) — also on Ctrl-C or an
exception, when used as a context manager. It also speaks the REST API v2 (JWT from
``/auth/token``): trigger a DAG run, read task instances, wait for a run to finish.

With ``agent=True`` (the default) it also starts the per-host elastic-ops agent
(``elastic-ops agent``, its own process group, log ``logs/agent.log``) before the Airflow
components, waits until it answers, and sets ``ELASTIC_OPS_AGENT_SOCKET`` for every component,
so chunk tasks run their chunks on the agent's warm workers instead of in the task process.
A cluster on one machine: ``nodes=`` starts node agents instead, ``database_url=`` puts the
metadata on PostgreSQL, ``celery_broker=`` runs the CeleryExecutor with a Celery worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
FINISHED = {"success", "failed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_socket_path(home: Path) -> str:
    """``$AIRFLOW_HOME/elastic_ops_agent.sock``, or a short path under /tmp named after the home
    when that is longer than a Unix socket path may be."""
    path = str(home / "elastic_ops_agent.sock")
    if len(os.fsencode(path)) <= 107:
        return path
    return f"/tmp/elastic-ops-agent-{hashlib.sha256(str(home).encode()).hexdigest()[:16]}.sock"


@dataclasses.dataclass
class AirflowDeployment:
    """One Airflow installation under ``home``. Use as ``with AirflowDeployment(...) as af:``."""

    home: Path
    dags_folder: Path
    plugins_folder: Path | None = None
    port: int = 0
    parallelism: int = 2
    user: str = "admin"
    password: str = "admin"
    # more users, of the viewer role (read only): name -> password
    readers: dict[str, str] = dataclasses.field(default_factory=dict)
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    python: str = sys.executable
    agent: bool = True  # start the per-host elastic-ops agent and point the tasks at it
    # a cluster on one machine: a node agent per host name (ELASTIC_OPS_NODE_* in extra_env);
    # the tasks then send each chunk to the node of its granted host
    nodes: tuple[str, ...] = ()
    node_args: tuple[str, ...] = ()  # more arguments for every node agent (e.g. --advertise-addr)
    # Airflow's metadata database (SQLAlchemy URL); None: SQLite under ``home``
    database_url: str | None = None
    # CeleryExecutor (a cluster's executor) on this broker (e.g. redis://host:6379/0): tasks run in a
    # `celery worker` started with the other components, on a queue of this deployment's own, with
    # results in the metadata database; None: LocalExecutor
    celery_broker: str | None = None

    def __post_init__(self) -> None:
        self.home = Path(self.home).resolve()
        self.dags_folder = Path(self.dags_folder).resolve()
        self.port = self.port or free_port()
        self.agent_socket = agent_socket_path(self.home)
        self.procs: dict[str, subprocess.Popen] = {}
        self._token: str | None = None
        self._secrets = {"jwt": secrets.token_hex(32), "key": secrets.token_hex(16)}
        self.queue = f"elastic-ops-{secrets.token_hex(6)}"  # Celery: this deployment's tasks only

    # --- configuration ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
        bin_dir = str(Path(self.python).parent)
        env.update({
            "PATH": f"{bin_dir}:{env.get('PATH', '')}",
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.plugins_folder or self.home / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join([f"{self.user}:admin",
                                                                  *(f"{r}:viewer" for r in self.readers)]),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "5",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.database_url or f"sqlite:///{self.home}/airflow.db",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": self._secrets["key"],
            "AIRFLOW__API_AUTH__JWT_SECRET": self._secrets["jwt"],
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
            "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        })
        if self.agent:
            env["ELASTIC_OPS_AGENT_SOCKET"] = self.agent_socket
        if self.celery_broker:
            database = self.database_url or f"sqlite:///{self.home}/airflow.db"
            env.update({
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__CELERY__BROKER_URL": self.celery_broker,
                "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{database}",
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.parallelism),
                "AIRFLOW__OPERATORS__DEFAULT_QUEUE": self.queue,
            })
        env.update(self.extra_env)
        return env

    def setup(self) -> AirflowDeployment:
        """Write the home and migrate the metadata database (idempotent)."""
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        (self.home / "plugins").mkdir(exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps({self.user: self.password, **self.readers}))
        self.airflow("db", "migrate", timeout=300)
        return self

    def airflow(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run one ``airflow`` CLI command against this deployment; raise with its output on error."""
        proc = subprocess.run(
            [self.python, "-m", "airflow", *args], env=self.env(), cwd=self.home,
            capture_output=True, text=True, timeout=timeout,
        )
        if proc.returncode:
            raise RuntimeError(f"airflow {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return proc

    # --- processes -------------------------------------------------------------------------

    def start(self, components: tuple[str, ...] = COMPONENTS, timeout: float = 180) -> AirflowDeployment:
        if self.agent:  # first: it warms up (torch, fork server) while Airflow starts
            self._start_agent()
        if self.nodes and self.node_config() is None:
            raise ValueError("nodes= needs ELASTIC_OPS_NODE_REDIS_URL and _SECRET in extra_env")
        for host in self.nodes:
            self._start_runner(f"node-{host}", "node", "--host", host, *self.node_args)
        commands = {name: [name] for name in components}
        if self.celery_broker:  # the worker that runs the tasks, on this deployment's queue only
            commands["celery-worker"] = ["celery", "worker", "--queues", self.queue]
        for name, command in commands.items():
            log = open(self.home / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
            self.procs[name] = subprocess.Popen(
                [self.python, "-m", "airflow", *command], env=self.env(), cwd=self.home,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
            log.close()
        self.wait_healthy(timeout)
        return self

    def _start_agent(self) -> None:
        # as docs/howto/agents.md starts it: no DAG folder on its path (the tasks hand it their import path)
        self._start_runner("agent", "agent", "--socket", self.agent_socket, dag_folders=False)

    def _start_runner(self, name: str, *args: str, dag_folders: bool = True) -> None:
        """An ``elastic-ops`` agent or node process in its own process group, logging to ``name``.
        ``dag_folders``: the DAG and plugins folders on its ``PYTHONPATH`` (node agents: a task
        elsewhere cannot hand them its folders), so Trainables next to the DAGs import there."""
        env = self.env()
        if dag_folders:
            plugins = self.plugins_folder or self.home / "plugins"
            paths = [str(self.dags_folder), str(plugins), env.get("PYTHONPATH")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        log = open(self.home / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            [self.python, "-m", "elastic_ops.cli", *args], env=env,
            cwd=self.home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    def node_config(self) -> Any:
        from elastic_ops.agent.cluster import node_config_from_env

        return node_config_from_env(self.env())

    def wait_nodes(self, timeout: float) -> None:
        """Wait until every node agent has announced itself (torch imported, fork server warm)."""
        from elastic_ops.agent.node_client import NodeClient

        client = NodeClient(self.node_config())
        deadline = time.monotonic() + timeout
        while not all(client.alive(host) for host in self.nodes):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"node agents {', '.join(self.nodes)} not announced after {timeout:.0f}s")
            time.sleep(0.5)

    def kill_node(self, host: str) -> None:
        """SIGKILL the node agent of ``host`` with everything it started (its workers): the host
        died."""
        proc = self.procs.pop(f"node-{host}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def wait_agent(self, timeout: float) -> None:
        """Wait until the agent answers a ping (it has imported torch and warmed its fork server)."""
        from elastic_ops.agent.client import AgentClient
        from elastic_ops.errors import AgentUnavailableError

        client = AgentClient(self.agent_socket)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(AgentUnavailableError):
                client.ping()
                return
            time.sleep(0.5)
        raise TimeoutError(f"elastic-ops agent not answering at {self.agent_socket} after {timeout:.0f}s")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.home / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"airflow {name} exited with {proc.returncode}:\n{tail}")

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if "agent" in self.procs:
            self.wait_agent(timeout)
        if self.nodes:
            self.wait_nodes(timeout)
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/api/v2/monitor/health", timeout=5).status_code == 200:
                    return
            time.sleep(1)
        raise TimeoutError(f"api-server not healthy at {self.url} after {timeout:.0f}s")

    def stop(self, grace_s: float = 20) -> None:
        """Terminate every process group, then kill what is left after ``grace_s``."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs.values():  # the group may outlive its leader (task runners, workers)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if "agent" in self.procs:  # an agent that had to be killed leaves its socket behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.agent_socket)
        self.procs.clear()

    def __enter__(self) -> AirflowDeployment:
        try:
            return self.setup().start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- REST API v2 -----------------------------------------------------------------------

    def token(self) -> str:
        if self._token is None:
            r = httpx.post(f"{self.url}/auth/token", json={"username": self.user, "password": self.password},
                           timeout=30)
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return self._token

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        r = httpx.request(method, f"{self.url}/api/v2{path}",
                          headers={"Authorization": f"Bearer {self.token()}"}, timeout=30, **kwargs)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None

    def wait_dag(self, dag_id: str, timeout: float = 120) -> dict[str, Any]:
        """Wait until the dag-processor has parsed ``dag_id``; raise with import errors if any."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(RuntimeError):
                return self.api("GET", f"/dags/{dag_id}")
            time.sleep(1)
        errors = self.api("GET", "/importErrors")
        raise TimeoutError(f"DAG {dag_id} not parsed after {timeout:.0f}s; import errors: {errors}")

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None, run_id: str | None = None) -> str:
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}}
        if run_id:
            body["dag_run_id"] = run_id
        return self.api("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances",
                        params={"limit": 1000})["task_instances"]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
        return self.api("GET", path, params={"deserialize": True})["value"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            state = self.run_state(dag_id, run_id)
            if state in FINISHED:
                return state
            time.sleep(1)
        raise TimeoutError(f"run {dag_id}/{run_id} not finished after {timeout:.0f}s")
