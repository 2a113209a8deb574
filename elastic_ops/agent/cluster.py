"""Where the tasks and the node agents of a cluster meet: a Redis server, a namespace, a secret.

The tasks (``ElasticChunkOperator``) and every ``elastic-ops node`` read the same three settings
(:func:`node_config_from_env`). The key names live here so both sides agree on them::

    {ns}:node:{host}               the node agent of ``host`` is alive (JSON; expires 10 s after
                                   its last refresh, every 2 s)
    {ns}:node:{host}:runs          run requests for ``host`` (sealed envelopes; the node pops)
    {ns}:session:{id}:claimed      a request was taken (SET NX: a replayed request runs nothing)
    {ns}:session:{id}:refused      why a node refused a genuine request it got no answer to (signed)
    {ns}:session:{id}:to_node      targets, task → node    (``RedisChannel`` lists)
    {ns}:session:{id}:to_task      progress, outcome, node → task

Never imports torch or Airflow.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from elastic_ops.agent.redis_channel import SECRET_ENV, Signer
from elastic_ops.errors import SpecError
from elastic_ops.urls import shown_url

URL_ENV = "ELASTIC_OPS_NODE_REDIS_URL"
NAMESPACE_ENV = "ELASTIC_OPS_NODE_NAMESPACE"
DEFAULT_NAMESPACE = "elastic_ops"
ALIVE_TTL_S = 10
ALIVE_EVERY_S = 2.0
# the clock skew tolerated between the cluster's hosts (a run request older than this by its
# sender's clock is refused). An announcement older than the TTL plus this by its own signed
# clock is stale, whatever Redis holds: a captured one re-SET by someone without the secret
# keeps a stopped node "alive" no longer
CLOCK_SKEW_S = 120.0
ANNOUNCEMENT_MAX_AGE_S = ALIVE_TTL_S + CLOCK_SKEW_S
URL_SCHEMES = ("redis", "rediss", "unix")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """The Redis server (URL, may carry a password), namespace and shared secret of a cluster."""

    url: str = dataclasses.field(repr=False)
    secret: str = dataclasses.field(repr=False)
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or urlsplit(self.url).scheme not in URL_SCHEMES:
            raise SpecError(
                URL_ENV,
                shown_url(self.url) if isinstance(self.url, str) else self.url,
                f"a Redis URL ({', '.join(s + '://' for s in URL_SCHEMES)}), e.g. redis://redis-host:6379/0",
            )
        try:
            parts = urlsplit(self.url)  # as redis-py parses it: a '/' in a password cuts the host off
            if parts.scheme != "unix" and not parts.hostname:
                raise ValueError("no host")
            parts.port  # noqa: B018 - a port that is not a number raises
        except ValueError:
            raise SpecError(
                URL_ENV, shown_url(self.url), "a Redis URL with a host and a port in 0..65535",
                hint="percent-encode '/', '?' and '#' in the password (%2F, %3F, %23)",
            ) from None
        _check_options(self.url)
        if not isinstance(self.namespace, str) or not _NAMESPACE_RE.fullmatch(self.namespace):
            raise SpecError(NAMESPACE_ENV, self.namespace, "1-64 letters, digits, '_', '.', '-'")
        Signer(self.secret)  # validates it

    def __repr__(self) -> str:
        return f"NodeConfig(url={shown_url(self.url)!r}, namespace={self.namespace!r}, secret=***)"

    def signer(self) -> Signer:
        return Signer(self.secret)

    def redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_connect_timeout=5, health_check_interval=30)

    # --- key names -------------------------------------------------------------------------------

    def announcement(self, host: str, info: dict[str, Any]) -> bytes:
        """``host``'s announcement as its node agent writes it: signed, so that whoever can write
        to Redis without the secret cannot announce a node (or its address) that is not there."""
        return self.signer().seal(self.alive_key(host), info)

    def alive_key(self, host: str) -> str:
        return f"{self.namespace}:node:{host}"

    def runs_key(self, host: str) -> str:
        return f"{self.namespace}:node:{host}:runs"

    def session_key(self, session: str, part: str) -> str:
        return f"{self.namespace}:session:{session}:{part}"


def _check_options(url: str) -> None:
    """The URL's query parameters that redis-py reads as numbers (``?socket_timeout=5``) must be
    numbers: redis-py's ValueError, raised when a client is made, names no setting."""
    try:
        from redis.connection import URL_QUERY_ARGUMENT_PARSERS
    except ImportError:  # no redis-py: nothing can connect, and NodeConfig.redis() says so
        return
    for name, values in parse_qs(urlsplit(url).query).items():
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        if parser not in (int, float):
            continue
        try:
            parser(unquote(values[0]))
        except ValueError:
            raise SpecError(
                f"{URL_ENV} parameter {name}", values[0],
                f"a {'whole number' if parser is int else 'number'} (redis-py reads it as one)",
            ) from None


def node_config_from_env(environ: Mapping[str, str] | None = None) -> NodeConfig | None:
    """The cluster settings if ``ELASTIC_OPS_NODE_REDIS_URL`` is set (then the secret must be
    too), else ``None``: chunks run on this host."""
    env = os.environ if environ is None else environ
    url = env.get(URL_ENV)
    if not url:
        return None
    namespace = env.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE
    return NodeConfig(url=url, secret=env.get(SECRET_ENV, ""), namespace=namespace)
