"""The container cluster (docker/compose.yaml) end to end, under Docker Compose or Podman.

Builds the images (docker/Dockerfile; the layer cache makes a rebuild after a code change take
about a minute), brings the whole cluster up (PostgreSQL, Redis, an S3 endpoint, Airflow's
api-server, scheduler, dag-processor, triggerer, a Celery worker, two "GPU hosts" running
``elastic-ops node`` with 2 CPU slots each), and runs ``make cluster-demo --short``: two seed-DAG
jobs at once with ``s3://`` checkpoints; once one has a checkpoint of its first chunk in S3 the
container of a host it trains on is killed; the chunk is retried on the other host from that
checkpoint; both final models are bitwise the uninterrupted run's. Then the cluster is torn
down, and no container, volume or network of it may be left.

Skipped (with the reason) where neither Docker nor Podman can run containers; a failure in CI
(``ELASTIC_OPS_REQUIRE_SERVICES=1``: ``.ci/run`` installs Podman).
"""

from __future__ import annotations

import secrets

import pytest

from devtools import cluster as cl
from devtools import cluster_demo
from tests.conftest import REQUIRE_SERVICES

pytestmark = [pytest.mark.container, pytest.mark.e2e, pytest.mark.timeout(2400)]

# ports of the test's own cluster: clear of a demo cluster (docker/cluster.env) and the host's services
TEST_PORTS = {"POSTGRES_PORT": 25432, "REDIS_PORT": 26379, "S3_PORT": 25000, "API_PORT": 28080,
              "WORKER_LOG_PORT": 28793, "TRIGGERER_LOG_PORT": 28794}


@pytest.fixture(scope="module")
def engine():
    found = cl.find_engine()
    if found is None:
        msg = f"needs Docker or Podman able to run containers: {cl.why_no_engine()} (see docker/README.md)"
        if REQUIRE_SERVICES:
            pytest.fail(f"ELASTIC_OPS_REQUIRE_SERVICES=1 and {msg}")
        pytest.skip(msg)
    return found


def test_the_settings_are_checked_before_anything_starts(tmp_path):
    env = tmp_path / "cluster.env"
    cl.write_env_file(env)
    assert env.stat().st_mode & 0o077 == 0
    values = cl.settings(env, create=False)
    assert set(values) == set(cl.read_env(cl.ENV_EXAMPLE))
    for key, bad, allowed in (("REDIS_PORT", "6379", "the host's Redis"), ("API_PORT", "80", "1024..65535"),
                              ("S3_PORT", values["POSTGRES_PORT"], "POSTGRES_PORT has it"),
                              ("POSTGRES_PASSWORD", "change-me-postgres", "at least 16"),
                              ("REDIS_PASSWORD", "p@ss:word/12345678", "at least 16"),
                              ("S3_BUCKET", "Bad_Bucket", "bucket name"), ("HOST_SLOTS", "0", "1..64")):
        with pytest.raises(cl.ClusterError) as err:
            cl.check_settings({**values, key: bad}, "cluster.env")
        assert key in str(err.value) and allowed in str(err.value), str(err.value)
        if "PASSWORD" in key:
            assert bad not in str(err.value)  # a secret is never echoed
    missing = dict(values)
    del missing["S3_BUCKET"]
    with pytest.raises(cl.ClusterError, match="missing S3_BUCKET"):
        cl.check_settings(missing, "cluster.env")


def test_the_cluster_trains_across_two_hosts_and_survives_one_dying(engine, tmp_path, capsys):
    env = tmp_path / "cluster.env"
    cl.write_env_file(env)
    text = env.read_text()
    for key, port in TEST_PORTS.items():
        text = text.replace(f"{key}={cl.read_env(cl.ENV_EXAMPLE)[key]}", f"{key}={port}")
    env.write_text(text)
    project = f"elastic-ops-test-{secrets.token_hex(4)}"
    cluster = cl.Cluster(engine, env, cl.settings(env, create=False), project=project)
    try:
        rc = cluster_demo.main(["--short", "--env-file", str(env), "--project", project,
                                "--timeout", "900"])
        out = capsys.readouterr().out
        print(out)
        assert rc == 0, out[-6000:]
        assert "NO " not in out and out.count("OK ") == 6
        assert "killing the container of gpu-host-" in out and "s3://" in out
    finally:
        cluster.down()
    left = cluster.leftovers()
    assert left == {"containers": [], "volumes": [], "networks": []}, left
