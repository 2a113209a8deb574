"""Node agents served from threads of the test process, on the local Redis."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator

from elastic_ops.agent.cluster import NodeConfig
from elastic_ops.agent.node import NodeAgent

SECRET = "test-secret-of-the-cluster-0123456789"
REDIS_URL = os.environ.get("ELASTIC_OPS_TEST_REDIS", "redis://127.0.0.1:6379/0")


def make_config(namespace: str | None = None, secret: str = SECRET) -> NodeConfig:
    return NodeConfig(url=REDIS_URL, secret=secret, namespace=namespace or f"test-{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def running_node(host: str, config: NodeConfig, **options) -> Iterator[NodeAgent]:
    """A node agent served from a thread of the test process (every progress message sent)."""
    options.setdefault("progress_every_s", 0.0)
    node = NodeAgent(host, config, **options)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            node.serve()
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            node.ready.set()

    thread = threading.Thread(target=serve, name=f"test-node-{host}", daemon=True)
    thread.start()
    node.ready.wait(300)
    if errors:
        raise errors[0]
    try:
        yield node
    finally:
        node.stop()
        thread.join(120)


def drop_namespace(config: NodeConfig) -> None:
    r = config.redis()
    keys = list(r.scan_iter(f"{config.namespace}:*"))
    if keys:
        r.delete(*keys)


