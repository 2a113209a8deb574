"""``ElasticOpsHook``: resolves the pool ledger and the checkpoint store from Airflow connections.

The pool ledger URL comes from a connection of type ``elastic_ops_pool`` (default id
``elastic_ops_pool_default``): either ``extra={"url": "..."}`` or the usual host/login/password/
port/schema fields, which build a PostgreSQL URL. Without that connection the ledger is the
embedded default, ``sqlite:///$AIRFLOW_HOME/elastic_ops_pool.db``.

``s3://`` checkpoints get a boto3 client built from an Airflow ``aws`` connection through the
Amazon provider's ``S3Hook`` (so ``endpoint_url`` in the connection's extra is honoured and any
S3-compatible store works); ``file://`` checkpoints need no connection.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from elastic_ops.errors import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Connection

DEFAULT_CONN_ID = "elastic_ops_pool_default"
CONN_TYPE = "elastic_ops_pool"
LEDGER_FILE = "elastic_ops_pool.db"


def airflow_home() -> Path:
    return Path(os.environ.get("AIRFLOW_HOME") or Path.home() / "airflow")


def default_ledger_url() -> str:
    """The embedded default ledger: a SQLite file beside ``AIRFLOW_HOME``."""
    return f"sqlite:///{airflow_home() / LEDGER_FILE}"


CHECKPOINT_DIR = "elastic_ops_checkpoints"


CHECKPOINT_ROOT_ENV = "ELASTIC_OPS_CHECKPOINT_ROOT"


def default_checkpoint_root() -> str:
    """Where jobs without a ``checkpoint`` keep their checkpoints: ``$ELASTIC_OPS_CHECKPOINT_ROOT``
    (a cluster's ``s3://bucket/prefix``, which every host reaches), else
    ``file://$AIRFLOW_HOME/elastic_ops_checkpoints``. Not ``elastic_ops/``: Python puts the
    working directory first on ``sys.path`` for ``python -m``, and a folder of the package's name
    there (Airflow and the agents are often started from ``AIRFLOW_HOME``) hid the installed
    package."""
    from elastic_ops.spec import check_checkpoint_uri

    root = os.environ.get(CHECKPOINT_ROOT_ENV)
    if root:
        return check_checkpoint_uri(CHECKPOINT_ROOT_ENV, root.rstrip("/"))
    return f"file://{airflow_home() / CHECKPOINT_DIR}"


def url_from_connection(conn: Connection) -> str:
    """A SQLAlchemy URL from an ``elastic_ops_pool`` connection (``extra.url`` wins)."""
    extra = conn.extra_dejson or {}
    if extra.get("url"):
        return str(extra["url"])
    if not conn.host:
        raise SpecError(
            "connection",
            conn.conn_id,
            f"a connection of type {CONN_TYPE!r} needs extra {{'url': ...}} or a host",
        )
    auth = ""
    if conn.login:
        auth = quote(conn.login, safe="")
        if conn.password:
            auth += ":" + quote(conn.password, safe="")
        auth += "@"
    port = f":{conn.port}" if conn.port else ""
    return f"postgresql+psycopg2://{auth}{conn.host}{port}/{conn.schema or 'postgres'}"


class ElasticOpsHook(BaseHook):
    """Gives operators, sensors and triggers a ``PoolClient`` and checkpoint stores."""

    conn_name_attr = "elastic_ops_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = CONN_TYPE
    hook_name = "Elastic Ops pool ledger"

    def __init__(
        self,
        elastic_ops_conn_id: str = DEFAULT_CONN_ID,
        aws_conn_id: str | None = "aws_default",
        ledger_url: str | None = None,
    ) -> None:
        super().__init__()
        self.elastic_ops_conn_id = elastic_ops_conn_id
        self.aws_conn_id = aws_conn_id
        self._ledger_url = ledger_url
        self._pool = None

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": [],
            "relabeling": {"schema": "Database"},
            "placeholders": {
                "extra": '{"url": "postgresql+psycopg2://user:pass@host:5432/pool"}',
                "host": "pool-db.example.com",
            },
        }

    # --- pool ------------------------------------------------------------------------------

    def ledger_url(self) -> str:
        """The ledger URL: explicit, else the connection, else (the default connection id only)
        the embedded SQLite default. A connection id named but not found is an error: falling
        back would give each machine a pool of its own, granting the same GPUs twice."""
        if self._ledger_url is None:
            try:
                conn = self.get_connection(self.elastic_ops_conn_id)
            except AirflowNotFoundException:
                if self.elastic_ops_conn_id != DEFAULT_CONN_ID:
                    raise SpecError(
                        "elastic_ops_conn_id", self.elastic_ops_conn_id, "an Airflow connection that exists",
                        hint=f"create it (type {CONN_TYPE}), or leave the argument out for "
                        f"{DEFAULT_CONN_ID!r}, whose absence means the embedded SQLite ledger",
                    ) from None
                self._ledger_url = default_ledger_url()
            else:
                self._ledger_url = url_from_connection(conn)
        return self._ledger_url

    def pool(self):
        """A ``PoolClient`` on the ledger (created and migrated on first use)."""
        if self._pool is None:
            from elastic_ops.pool import PoolClient

            self._pool = PoolClient(self.ledger_url(), metrics=self.metrics())
        return self._pool

    @staticmethod
    def metrics():
        """Where elastic_ops' metrics go: Airflow's Stats (the deployment's ``[metrics]``)."""
        from elastic_ops.hooks.metrics import AirflowMetrics

        return AirflowMetrics()

    def executor(self, log: Any):
        """Where this task's grants train (:func:`elastic_ops.executors.executor_from_env`): the
        cluster's node agents, this host's agent, or the task process; ``log``: the task's logger."""
        from elastic_ops.executors import executor_from_env

        return executor_from_env(self, self.pool, log)

    # --- checkpoints -----------------------------------------------------------------------

    def s3_client(self):
        """A boto3 S3 client from the Airflow ``aws`` connection (credentials, endpoint_url and
        botocore config honoured), with the store's own settings merged over the latter (one
        retry loop, no redundant download CRC32; ``elastic_ops.checkpoint.s3.client_config``)."""
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        from elastic_ops.checkpoint.s3 import client_config

        hook = S3Hook(aws_conn_id=self.aws_conn_id)
        return hook.get_client_type(config=hook.config.merge(client_config()))

    def store_config(self, uri: str, *, keep_last: int = 3, keep_every: int | None = None):
        """What :meth:`store` would open, as plain data for the per-host agent (which opens it):
        for ``s3://``, the ``aws`` connection's endpoint, region and credentials (never logged)."""
        from elastic_ops.agent.protocol import S3Config, StoreConfig

        s3 = None
        if uri.startswith("s3://") and self.aws_conn_id:
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook

            aws = S3Hook(aws_conn_id=self.aws_conn_id)
            try:
                creds = aws.get_credentials()
            except AttributeError:  # no credentials anywhere: boto3's chain finds none in the agent either
                creds = None
            s3 = S3Config(
                endpoint_url=aws.conn_config.get_service_endpoint_url(service_name="s3"),
                region_name=aws.conn_config.region_name,
                access_key_id=getattr(creds, "access_key", None),
                secret_access_key=getattr(creds, "secret_key", None),
                session_token=getattr(creds, "token", None),
            )
        return StoreConfig(uri, keep_last=keep_last, keep_every=keep_every, s3=s3)

    def store(self, uri: str, *, keep_last: int = 3, keep_every: int | None = None):
        """Open the checkpoint store at ``uri`` (``file://`` or ``s3://``)."""
        from elastic_ops.checkpoint import open_store

        client = self.s3_client() if uri.startswith("s3://") and self.aws_conn_id else None
        return open_store(uri, s3_client=client, keep_last=keep_last, keep_every=keep_every,
                          metrics=self.metrics())
