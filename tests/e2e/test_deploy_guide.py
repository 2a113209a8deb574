"""docs/deploy.md, "On one machine, under your own Airflow", run as written against a real Airflow.

The "existing Airflow 3.3" is a deployment of ``devtools.airflow_env`` (SQLite, LocalExecutor,
api-server, scheduler, dag-processor, triggerer) with no elastic_ops settings of its own that the
guide sets: the guide's environment file replaces them. Every code block of the section runs, in
the document's order, with the guide's paths moved into a temporary folder (``/opt/airflow``,
``/opt/elastic-ops/bin/``, ``/run/elastic-ops``, port 8080):

- ``bash`` blocks run in bash (``set -euo pipefail``) from the checkout, with ``airflow`` and
  ``elastic-ops`` on ``PATH``. ``pip install …`` lines run with ``--dry-run`` (the checkout must
  resolve with those constraints and extras; nothing is installed). ``sudo systemctl …`` lines
  act on the unit the guide defines: ``enable --now`` and ``restart`` start the unit's
  ``ExecStart`` with its ``Environment=``, ``EnvironmentFile=`` and ``RuntimeDirectory=``.
- The ``ini`` block is that unit.

Between the settings and the first ``elastic-ops`` command the Airflow components restart with
the environment file, as the guide says. The first DAG run must succeed with its chunks trained
on the agent, and ``airflow dags list-runs`` must then show it as ``success``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from devtools.airflow_env import AirflowDeployment, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "deploy.md"
START, END = "## On one machine, under your own Airflow", "## On a cluster"


def guide_blocks() -> list[tuple[str, str]]:
    text = GUIDE.read_text()
    section = text[text.index(START):text.index(END)]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def test_the_guide_has_the_steps_the_test_runs():
    blocks = guide_blocks()
    langs = [lang for lang, _ in blocks]
    assert langs.count("ini") == 1 and langs.count("bash") >= 5
    bash = "\n".join(body for lang, body in blocks if lang == "bash")
    for needed in ("AIRFLOW__API_AUTH__JWT_SECRET=", "AIRFLOW__API__SECRET_KEY=",
                   "AIRFLOW__CORE__EXECUTION_API_SERVER_URL=", "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=",
                   "elastic-ops pool add-host", "elastic-ops pool status", "airflow dags trigger",
                   "systemctl enable --now elastic-ops-agent", "pip install"):
        assert needed in bash, needed
    unit = parse_unit(next(body for lang, body in blocks if lang == "ini"))
    assert "PYTHONPATH" in unit["env"] and unit["exec"][1:3] == ["agent", "--socket"]


def parse_unit(text: str) -> dict:
    """The ``[Service]`` settings of a systemd unit that the test acts on."""
    name = re.search(r"/etc/systemd/system/([\w.-]+)\.service", text).group(1)
    env: dict[str, str] = {}
    files, runtime, exec_start = [], None, None
    section = None
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]" or "=" not in line:
            continue
        key, value = line.split("=", 1)
        if key == "Environment":
            env.update(dict(item.split("=", 1) for item in shlex.split(value)))
        elif key == "EnvironmentFile":
            files.append(value)
        elif key == "RuntimeDirectory":
            runtime = value
        elif key == "ExecStart":
            exec_start = shlex.split(value)
    return {"name": name, "env": env, "files": files, "runtime": runtime, "exec": exec_start}


def read_env_file(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


class Guide:
    """Runs the guide's blocks with its paths moved under a temporary folder."""

    def __init__(self, root: Path, run_dir: Path) -> None:
        self.root = root
        self.home = root / "airflow"
        self.bin = root / "bin"
        self.port = free_port()
        self.subst = {"/opt/airflow": str(self.home), "/opt/elastic-ops/bin/": f"{self.bin}/",
                      "/run/elastic-ops": str(run_dir), "8080": str(self.port)}
        self.run_dir = run_dir
        self.af: AirflowDeployment | None = None
        self.unit: dict | None = None
        self.agent: subprocess.Popen | None = None
        self.outputs: list[str] = []
        self.bin.mkdir(parents=True)
        # `elastic-ops` as the installed console script: this checkout's CLI, whatever PYTHONPATH says
        shim = self.bin / "elastic-ops"
        shim.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{REPO}" '
                        f'exec {sys.executable} -m elastic_ops.cli "$@"\n')
        shim.chmod(0o755)

    def moved(self, text: str) -> str:
        for old, new in self.subst.items():
            text = text.replace(old, new)
        return text

    def env(self) -> dict[str, str]:
        if self.af:
            env = self.af.env()
        else:
            env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env["AIRFLOW_HOME"] = str(self.home)
        env["PATH"] = f"{self.bin}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
        return env

    def bash(self, script: str) -> str:
        script = re.sub(r"^pip install ", f"{sys.executable} -m pip install --dry-run --no-deps "
                        "--no-build-isolation --quiet ", script, flags=re.M)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=self.env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (f"guide block failed ({proc.returncode}):\n{script}\n"
                                      f"{proc.stdout}\n{proc.stderr}")
        self.outputs.append(proc.stdout)
        return proc.stdout

    def block(self, body: str) -> None:
        """A bash block: its `sudo systemctl` lines act on the unit, the rest runs in bash."""
        chunk: list[str] = []
        for line in self.moved(body).splitlines(keepends=True):
            if line.startswith("sudo systemctl "):
                if chunk:
                    self.bash("".join(chunk))
                    chunk = []
                self.systemctl(shlex.split(line.split(" #", 1)[0])[2:])
            else:
                chunk.append(line)
        if "".join(chunk).strip():
            self.bash("".join(chunk))

    def systemctl(self, args: list[str]) -> None:
        if args == ["daemon-reload"]:
            assert self.unit is not None, "daemon-reload before the unit file is written"
            return
        assert self.unit and args[-1] == self.unit["name"], f"systemctl {args}: not the guide's unit"
        if args[:2] == ["enable", "--now"]:
            self.start_unit()
        elif args[0] == "restart":
            self.stop_unit()
            self.start_unit()
        else:
            pytest.fail(f"the test does not know `systemctl {' '.join(args)}`")

    def start_unit(self) -> None:
        unit = self.unit
        env = self.env()
        for f in unit["files"]:
            env.update(read_env_file(Path(f)))
        env.update(unit["env"])
        if unit["runtime"]:  # systemd creates /run/<RuntimeDirectory> for the service (mode 0700)
            assert self.run_dir.name == "elastic-ops" and unit["runtime"] == "elastic-ops"
            self.run_dir.mkdir(mode=0o700, exist_ok=True)
        log = open(self.home / "logs" / "agent.log", "ab")  # noqa: SIM115 - owned by the child
        self.agent = subprocess.Popen(unit["exec"], env=env, cwd="/", stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        log.close()
        from elastic_ops.agent.client import AgentClient
        from elastic_ops.errors import AgentUnavailableError

        client = AgentClient(env["ELASTIC_OPS_AGENT_SOCKET"])
        deadline = time.monotonic() + 180
        while True:
            assert self.agent.poll() is None, (self.home / "logs" / "agent.log").read_text()[-3000:]
            with contextlib.suppress(AgentUnavailableError):
                client.ping()
                return
            assert time.monotonic() < deadline, "the agent does not answer"
            time.sleep(0.5)

    def stop_unit(self) -> None:
        if self.agent is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agent.pid, signal.SIGTERM)  # KillSignal=SIGTERM
        try:
            self.agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.agent.pid, signal.SIGKILL)
            self.agent.wait(timeout=10)
        self.agent = None


def test_the_one_machine_guide_runs_as_written(tmp_path):
    run_parent = Path(tempfile.mkdtemp(prefix="eo-guide-", dir="/tmp"))  # a short socket path
    guide = Guide(tmp_path, run_parent / "elastic-ops")
    (guide.home / "dags").mkdir(parents=True)
    # the existing Airflow: its own settings (metadata, executor, users), none of the guide's
    af = AirflowDeployment(home=guide.home, dags_folder=guide.home / "dags", port=guide.port, agent=False,
                           parallelism=4)
    af.setup()
    blocks = guide_blocks()
    started = False
    # what `pip install --dry-run .` leaves in the checkout (setuptools' build folders), if new
    made = [p for p in (REPO / "build", REPO / "elastic_ops.egg-info") if not p.exists()]
    try:
        for lang, body in blocks:
            if lang == "ini":
                guide.unit = parse_unit(guide.moved(body))
                continue
            if not started and "elastic-ops " in body:  # "then restart them": with the guide's file
                af.extra_env = read_env_file(guide.home / "elastic-ops.env")
                guide.af = af
                af.start()
                started = True
            if "airflow dags unpause" in body:
                af.wait_dag("elastic_seed_job1", timeout=180)
            guide.block(body)
            if "airflow dags trigger" in body:
                check_the_first_run(guide, af)
        assert started and guide.agent is not None
        env_file = guide.home / "elastic-ops.env"
        assert env_file.stat().st_mode & 0o077 == 0  # umask 077: the secrets are the owner's only
        settings = read_env_file(env_file)
        assert len(settings["AIRFLOW__API_AUTH__JWT_SECRET"]) == 64
        # the upgrade's `pool status` (after the agent's restart) still sees the host
        assert guide.outputs[-1].count(os.uname().nodename) >= 1
    finally:
        guide.stop_unit()
        af.stop()
        import shutil

        for path in (run_parent, *made):
            shutil.rmtree(path, ignore_errors=True)


def check_the_first_run(guide: Guide, af: AirflowDeployment) -> None:
    runs = af.api("GET", "/dags/elastic_seed_job1/dagRuns")["dag_runs"]
    assert len(runs) == 1, runs
    run = runs[0]["dag_run_id"]
    assert af.wait_run("elastic_seed_job1", run, timeout=600) == "success"
    final = af.xcom("elastic_seed_job1", run, "train_digits.finalize")
    assert final["iteration"] == 30
    agent_log = (guide.home / "logs" / "agent.log").read_text()
    assert "job elastic_seed_job1" in agent_log and "pids rank0=" in agent_log  # trained on the agent
    listed = guide.bash("airflow dags list-runs elastic_seed_job1")
    assert run in listed and "success" in listed
