"""docker/: what the compose file and the Dockerfile promise, checked without a container engine
(tests/e2e/test_container_cluster.py runs them)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from devtools import cluster as cl

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()


def test_the_cluster_has_every_part_and_each_runs_on_the_hosts_network():
    services = COMPOSE["services"]
    assert set(services) == {"postgres", "redis", "s3", "init", "api-server", "scheduler", "dag-processor",
                             "triggerer", "worker", "gpu-host-1", "gpu-host-2"}
    assert all(s["network_mode"] == "host" for s in services.values())
    for host in ("gpu-host-1", "gpu-host-2"):
        command = services[host]["command"]
        assert command[:2] == ["elastic-ops", "node"] and "--register-slots" in command
    assert services["worker"]["command"] == ["airflow", "celery", "worker"]
    assert services["scheduler"]["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert services["scheduler"]["environment"]["ELASTIC_OPS_CHECKPOINT_ROOT"].startswith("s3://")
    # start order: the services first, then init, then Airflow and the hosts
    assert set(services["init"]["depends_on"]) == {"postgres", "redis", "s3"}
    assert all(services[s]["depends_on"] == {"init": {"condition": "service_completed_successfully"}}
               for s in ("api-server", "scheduler", "dag-processor", "triggerer", "worker", "gpu-host-1"))
    assert all("healthcheck" in services[s] for s in services if s != "init")


def test_no_secret_or_port_is_written_into_the_compose_file_or_the_images():
    text = (REPO / "docker" / "compose.yaml").read_text()
    for key in cl.SECRETS:
        assert f"${{{key}}}" in text, key
    # every password in a URL is a variable
    assert not re.findall(r"://[^:/@\s]*:(?!\$\{)[^@\s]+@", text)
    assert not re.search(r"^\s*(ENV|ARG)\s+[^\n]*(PASSWORD|SECRET|_KEY)", DOCKERFILE, re.M | re.I)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") + 1:] == ["!pyproject.toml", "!README.md", "!constraints.txt",
                                                "!elastic_ops", "!dags", "!docker/*.sh", "**/__pycache__"]
    assert "docker/cluster.env" in (REPO / ".gitignore").read_text().split()
    for key in cl.PORTS:
        assert f"${{{key}}}" in text


def test_the_image_runs_as_a_user_and_takes_its_base_and_pip_options_as_arguments():
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in DOCKERFILE
    assert re.search(r"ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu", DOCKERFILE)
    assert "ARG PIP_OPTIONS" in DOCKERFILE
    runtime = DOCKERFILE[DOCKERFILE.index("FROM base AS runtime"):]
    assert "USER 50000" in runtime and "/opt/airflow/dags" in runtime
    assert DOCKERFILE.rstrip().endswith('CMD ["elastic-ops", "--help"]')  # runtime: the default target


def test_the_example_settings_pass_the_checks_once_their_secrets_are_set(tmp_path):
    env = tmp_path / "cluster.env"
    cl.write_env_file(env)
    values = cl.settings(env, create=False)
    example = cl.read_env(cl.ENV_EXAMPLE)
    assert {k: v for k, v in values.items() if k not in cl.SECRETS} == \
        {k: v for k, v in example.items() if k not in cl.SECRETS}
    assert all(values[k] != example[k] for k in cl.SECRETS)
    assert not set(map(int, (values[k] for k in cl.PORTS))) & set(cl.RESERVED_PORTS)
