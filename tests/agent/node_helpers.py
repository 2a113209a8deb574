"""Node agents served from threads of the test process, on the local Redis."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from pathlib import Path

from elastic_ops.agent.cluster import NodeConfig
from elastic_ops.agent.node import NodeAgent
from tests.runtime.agent_helpers import serving

SECRET = "test-secret-of-the-cluster-0123456789"
REDIS_URL = os.environ.get("ELASTIC_OPS_TEST_REDIS", "redis://127.0.0.1:6379/0")


def make_config(namespace: str | None = None, secret: str = SECRET) -> NodeConfig:
    return NodeConfig(url=REDIS_URL, secret=secret, namespace=namespace or f"test-{uuid.uuid4().hex[:12]}")


def running_node(host: str, config: NodeConfig, **options) -> contextlib.AbstractContextManager[NodeAgent]:
    """A node agent served from a thread of the test process (every progress message sent)."""
    options.setdefault("progress_every_s", 0.0)
    return serving(NodeAgent(host, config, **options), f"test-node-{host}")


REPO = Path(__file__).resolve().parents[2]


def cli_node(host: str, config: NodeConfig, **env: str) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of ``elastic-ops node --host host`` in a process of its own, in
    ``config``'s cluster (plus ``env``)."""
    environment = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        ELASTIC_OPS_NODE_REDIS_URL=config.url,
        ELASTIC_OPS_NODE_SECRET=config.secret,
        ELASTIC_OPS_NODE_NAMESPACE=config.namespace,
        **env,
    )
    return [sys.executable, "-m", "elastic_ops.cli", "node", "--host", host], environment


def drop_namespace(config: NodeConfig) -> None:
    r = config.redis()
    keys = list(r.scan_iter(f"{config.namespace}:*"))
    if keys:
        r.delete(*keys)


