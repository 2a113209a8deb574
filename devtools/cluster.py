"""The container cluster of ``docker/compose.yaml``: settings, images, up and down.

``make cluster-demo`` (``devtools.cluster_demo``) and the ``container`` test use it. It works with
Docker (``docker compose``) and with Podman (``podman-compose``); ``ENGINE=docker|podman`` picks
one where both are installed.

Settings come from ``docker/cluster.env`` (the user copies ``docker/cluster.env.example``; the
demo writes one with random secrets when there is none). They are checked before anything starts:
a bad value is reported with its name, its value (secrets not shown) and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
ENV_FILE = DOCKER / "cluster.env"
ENV_EXAMPLE = DOCKER / "cluster.env.example"
# the images of compose.yaml: Dockerfile target -> image name (tag from ELASTIC_OPS_TAG)
TARGETS = {"runtime": "elastic-ops", "postgres": "elastic-ops-postgres", "redis": "elastic-ops-redis",
           "s3": "elastic-ops-s3"}
SECRETS = ("POSTGRES_PASSWORD", "REDIS_PASSWORD", "S3_SECRET_KEY", "AIRFLOW_JWT_SECRET",
           "AIRFLOW_SECRET_KEY", "AIRFLOW_ADMIN_PASSWORD", "ELASTIC_OPS_NODE_SECRET")
PORTS = ("POSTGRES_PORT", "REDIS_PORT", "S3_PORT", "API_PORT", "WORKER_LOG_PORT", "TRIGGERER_LOG_PORT")
SERVICES = ("postgres", "redis", "s3")
AIRFLOW = ("api-server", "scheduler", "dag-processor", "triggerer", "worker")
HOSTS = ("gpu-host-1", "gpu-host-2")
# the machine's own services, which the cluster (host networking) must leave alone
RESERVED_PORTS = {5432: "the host's PostgreSQL", 6379: "the host's Redis"}


class ClusterError(Exception):
    """A problem the user can fix (a setting, a missing tool): printed without a traceback."""


def say(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- settings --------------------------------------------------------------------------------


def read_env(path: Path) -> dict[str, str]:
    values = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key.strip()):
            raise ClusterError(f"{path}:{n}: not a KEY=value line: {line[:40]!r}")
        values[key.strip()] = value.strip()
    return values


def check_settings(values: dict[str, str], where: str) -> dict[str, str]:
    """The settings, checked: every key of the example present, secrets of 16+ URL-safe
    characters, ports that are numbers in 1024..65535, distinct, none of the host's services'."""
    example = read_env(ENV_EXAMPLE)
    missing = sorted(set(example) - set(values))
    if missing:
        raise ClusterError(f"{where}: missing {', '.join(missing)} (see {ENV_EXAMPLE.relative_to(REPO)})")
    for key in SECRETS:
        value = values[key]
        if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", value) or value.startswith("change-me"):
            raise ClusterError(f"{where}: {key}: not shown; allowed: at least 16 of A-Z a-z 0-9 _ - "
                               "(it goes into URLs), not the example's placeholder "
                               "(e.g. python3 -c 'import secrets; print(secrets.token_hex(24))')")
    seen: dict[int, str] = {}
    for key in PORTS:
        value = values[key]
        if not value.isdigit() or not 1024 <= int(value) <= 65535:
            raise ClusterError(f"{where}: {key}={value!r}; allowed: a port number, 1024..65535")
        port = int(value)
        if port in RESERVED_PORTS:
            raise ClusterError(f"{where}: {key}={port}; allowed: a port other than {port} "
                               f"({RESERVED_PORTS[port]}: the cluster uses the host's network)")
        if port in seen:
            raise ClusterError(f"{where}: {key}={port}; allowed: a port no other setting uses "
                               f"({seen[port]} has it)")
        seen[port] = key
    slots = values["HOST_SLOTS"]
    if not slots.isdigit() or not 1 <= int(slots) <= 64:
        raise ClusterError(f"{where}: HOST_SLOTS={slots!r}; allowed: a whole number of slots, 1..64")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{2,62}", values["S3_BUCKET"]):
        raise ClusterError(f"{where}: S3_BUCKET={values['S3_BUCKET']!r}; allowed: an S3 bucket name "
                           "(3-63 of a-z 0-9 . -)")
    return values


def write_env_file(path: Path = ENV_FILE) -> None:
    """``docker/cluster.env`` from the example, with a fresh random value for every secret."""
    text = ENV_EXAMPLE.read_text()
    for key in SECRETS:
        text = re.sub(rf"^{key}=.*$", f"{key}={secrets.token_hex(24)}", text, flags=re.M)
    old = os.umask(0o077)
    try:
        path.write_text(text)
    finally:
        os.umask(old)


def settings(path: Path = ENV_FILE, create: bool = True) -> dict[str, str]:
    if not path.exists():
        if not create:
            raise ClusterError(f"no {path}: cp {ENV_EXAMPLE} {path} and set its secrets")
        write_env_file(path)
        say(f"wrote {path.relative_to(REPO)} with random secrets (from cluster.env.example)")
    return check_settings(read_env(path), str(path.relative_to(REPO) if path.is_relative_to(REPO) else path))


# --- the container engine --------------------------------------------------------------------


@dataclasses.dataclass
class Engine:
    """``docker`` with ``docker compose``, or ``podman`` with ``podman-compose``."""

    name: str
    compose: list[str]
    env: dict[str, str]

    def run(self, *args: str, check: bool = True, capture: bool = False,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.name, *args], env=self.env, text=True, timeout=timeout,
                              capture_output=capture)
        if check and proc.returncode:
            detail = (proc.stderr or "")[-3000:] if capture else ""
            raise ClusterError(f"`{self.name} {' '.join(args[:3])} …` failed ({proc.returncode}) {detail}")
        return proc

    def compose_run(self, project: str, env_file: Path, *args: str, check: bool = True,
                    capture: bool = False, timeout: float | None = None) -> subprocess.CompletedProcess:
        cmd = [*self.compose, "--env-file", str(env_file), "-p", project, "-f", str(COMPOSE_FILE), *args]
        proc = subprocess.run(cmd, env=self.env, text=True, capture_output=capture, timeout=timeout,
                              cwd=DOCKER)
        if check and proc.returncode:
            detail = ((proc.stdout or "") + (proc.stderr or ""))[-3000:] if capture else ""
            shown = f"{' '.join(cmd[:2])} … {' '.join(args)}"
            raise ClusterError(f"`{shown}` failed ({proc.returncode}) {detail}")
        return proc


def podman_env() -> dict[str, str]:
    """Podman's settings for this kind of machine (docker/README.md, "Podman"): runc, no default
    ulimits, unless CONTAINERS_CONF names a file of the user's own."""
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env:
        conf = REPO / ".demo" / "containers.conf"
        conf.parent.mkdir(exist_ok=True)
        conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n')
        env["CONTAINERS_CONF"] = str(conf)
    return env


def find_engine() -> Engine | None:
    """The first engine that can run a container here (``ENGINE`` to choose), or None."""
    wanted = os.environ.get("ENGINE")
    if wanted and wanted not in ("docker", "podman"):
        raise ClusterError(f"ENGINE={wanted!r}; allowed: docker, podman")
    for name in [wanted] if wanted else ["docker", "podman"]:
        if not shutil.which(name):
            continue
        env = podman_env() if name == "podman" else dict(os.environ)
        try:
            ok = subprocess.run([name, "info"], env=env, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            continue
        if name == "docker":
            if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
                return Engine("docker", ["docker", "compose"], env)
            continue
        compose = shutil.which("podman-compose") or _venv_tool("podman-compose")
        if compose:
            return Engine("podman", [compose], env)
    return None


def _venv_tool(name: str) -> str | None:
    import sys

    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else None


def why_no_engine() -> str:
    found = [n for n in ("docker", "podman") if shutil.which(n)]
    if not found:
        return "neither docker nor podman is installed"
    hints = []
    if "podman" in found and not (shutil.which("podman-compose") or _venv_tool("podman-compose")):
        hints.append("podman-compose is not installed (pip install podman-compose)")
    return f"{' and '.join(found)} cannot run containers here" + (f"; {'; '.join(hints)}" if hints else "")


# --- images ----------------------------------------------------------------------------------


def host_pip_mounts() -> tuple[list[str], str]:
    """Podman build volumes and pip options that give the image build this machine's pip settings
    (``pip config list``: its CA bundle, find-links folders, file:// indexes), for a machine that
    reaches PyPI only through them (ELASTIC_OPS_PIP_FROM_HOST=1)."""
    out = subprocess.run(["pip", "config", "list"], capture_output=True, text=True).stdout
    conf: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        conf[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    volumes, options = [], []
    if conf.get("cert") and Path(conf["cert"]).is_file():
        volumes += ["-v", f"{conf['cert']}:/run/pip/ca.crt:ro"]
        options += ["--cert", "/run/pip/ca.crt"]
    for folder in conf.get("find-links", "").split():
        if Path(folder).is_dir():
            volumes += ["-v", f"{folder}:{folder}:ro"]
            options += ["--find-links", folder]
    for url in conf.get("extra-index-url", "").split():
        if url.startswith("file://") and Path(url[7:]).is_dir():
            root = str(Path(url[7:]).parent)  # the index's files lie beside its simple/ folder
            volumes += ["-v", f"{root}:{root}:ro"]
            options += ["--extra-index-url", url]
    return volumes, " ".join(options)


def build_args() -> dict[str, str]:
    args = {k: os.environ[k] for k in ("BASE_IMAGE", "TORCH_INDEX_URL", "PIP_OPTIONS") if k in os.environ}
    return args


def build_images(engine: Engine, tag: str) -> float:
    """Build the four images (layer cache: a second build takes seconds); returns the seconds."""
    t0 = time.monotonic()
    args = build_args()
    volumes: list[str] = []
    if os.environ.get("ELASTIC_OPS_PIP_FROM_HOST") == "1":
        if engine.name != "podman":
            raise ClusterError("ELASTIC_OPS_PIP_FROM_HOST=1 needs podman (docker build mounts no volumes): "
                               "give PIP_OPTIONS a mirror instead")
        volumes, options = host_pip_mounts()
        args["PIP_OPTIONS"] = " ".join(filter(None, [options, args.get("PIP_OPTIONS", "")]))
        args.setdefault("TORCH_INDEX_URL", "")  # torch's CPU build lies in the find-links folder
    extra = ["--network=host", *volumes] if engine.name == "podman" else ["--network=host"]
    for target, image in TARGETS.items():
        say(f"building {image}:{tag} (target {target})")
        cmd = ["build", *extra, "-f", str(DOCKER / "Dockerfile"), "--target", target, "-t", f"{image}:{tag}"]
        for key, value in args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        proc = subprocess.run([engine.name, *cmd, str(REPO)], env=engine.env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode:
            raise ClusterError(f"building {image} failed:\n{proc.stdout[-4000:]}")
    return time.monotonic() - t0


# --- the cluster -----------------------------------------------------------------------------


@dataclasses.dataclass
class Cluster:
    """One compose project: ``up()``, ``down()`` (containers, volumes and network removed)."""

    engine: Engine
    env_file: Path
    values: dict[str, str]
    project: str = "elastic-ops"
    tag: str = "local"

    def __post_init__(self) -> None:
        # the settings file is what compose interpolates: the same names in our environment would win
        env = {k: v for k, v in self.engine.env.items() if k not in self.values}
        self.engine = dataclasses.replace(self.engine, env={**env, "ELASTIC_OPS_TAG": self.tag})

    def compose(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return self.engine.compose_run(self.project, self.env_file, *args, **kwargs)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.values['API_PORT']}"

    def up(self, timeout: float = 600) -> None:
        """Start the services in the order of their health checks, one stage at a time, each
        stage without its dependencies (Podman before 4.6 cannot wait for health checks, and a
        container that requires a one-shot container that has exited cannot start)."""
        self.compose("up", "-d", "--no-deps", *SERVICES, capture=True)
        for key in ("POSTGRES_PORT", "REDIS_PORT", "S3_PORT"):
            self.wait_port(int(self.values[key]), timeout)
        self.compose("up", "-d", "--no-deps", "init", capture=True)
        deadline = time.monotonic() + timeout
        while self.state("init") != "exited":
            if time.monotonic() > deadline:
                raise ClusterError(f"init not done after {timeout:.0f}s:\n{self.logs('init')[-3000:]}")
            time.sleep(1)
        if self.exit_code("init") != 0:
            raise ClusterError(f"init failed:\n{self.logs('init')[-3000:]}")
        self.compose("up", "-d", "--no-deps", *AIRFLOW, *HOSTS, capture=True)

    def wait_port(self, port: int, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"nothing answers on port {port} after {timeout:.0f}s")
            time.sleep(1)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "10", check=False, capture=True, timeout=300)

    def container(self, service: str) -> str:
        """The container name of ``service`` (one replica)."""
        proc = self.engine.run("ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                               "--filter", f"label=com.docker.compose.service={service}",
                               "--format", "{{.Names}}", capture=True)
        names = proc.stdout.split()
        if len(names) != 1:
            raise ClusterError(f"service {service}: containers {names}")
        return names[0]

    def kill(self, service: str) -> None:
        """SIGKILL the service's container: the host dies, its node agent and workers at once."""
        self.engine.run("kill", self.container(service), capture=True)

    def logs(self, service: str) -> str:
        proc = self.engine.run("logs", self.container(service), check=False, capture=True)
        return proc.stdout + proc.stderr

    def state(self, service: str) -> str:
        proc = self.engine.run("inspect", "--format", "{{.State.Status}}", self.container(service),
                               check=False, capture=True)
        return proc.stdout.strip()

    def exit_code(self, service: str) -> int:
        proc = self.engine.run("inspect", "--format", "{{.State.ExitCode}}", self.container(service),
                               check=False, capture=True)
        return int(proc.stdout.strip() or -1)

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers, volumes and networks that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, args in (("containers", ["ps", "-a", "--filter", label, "--format", "{{.Names}}"]),
                           ("volumes", ["volume", "ls", "--filter", label, "--format", "{{.Name}}"]),
                           ("networks", ["network", "ls", "--format", "{{.Name}}"])):
            names = self.engine.run(*args, capture=True).stdout.split()
            if kind == "networks":
                names = [n for n in names if n.startswith(f"{self.project}_")]
            found[kind] = names
        return found

    def wait_api(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{self.api_url}/api/v2/monitor/health", timeout=5)
                if r.status_code == 200 and r.json().get("scheduler", {}).get("status") == "healthy":
                    return
            if self.state("init") == "exited" and self.exit_code("init") != 0:
                raise ClusterError(f"init failed:\n{self.logs('init')[-3000:]}")
            for service in ("postgres", "redis", "s3", "api-server", "scheduler"):
                if self.state(service) == "exited":
                    raise ClusterError(f"{service} exited:\n{self.logs(service)[-3000:]}")
            time.sleep(2)
        raise ClusterError(f"the api-server is not healthy at {self.api_url} after {timeout:.0f}s")


@contextlib.contextmanager
def running(cluster: Cluster, keep: bool = False) -> Iterator[Cluster]:
    """The cluster up for the block; down (volumes too) afterwards, unless ``keep``."""
    cluster.down()  # what an interrupted run left behind
    try:
        cluster.up()
        yield cluster
    finally:
        if keep:
            say(f"KEEP=1: the cluster keeps running; stop it with: {' '.join(cluster.engine.compose)} "
                f"--env-file {cluster.env_file} -p {cluster.project} -f {COMPOSE_FILE} down -v")
        else:
            say("tearing down (containers, volumes, network)")
            cluster.down()


def dumps(obj: object) -> str:
    return json.dumps(obj, sort_keys=True)
