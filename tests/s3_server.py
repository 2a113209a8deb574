"""A real S3 HTTP endpoint for tests: moto's server, in a thread, on 127.0.0.1 and a free port.

Use it as a context manager or through the pytest fixtures::

    from tests.s3_server import S3Server, s3_server, s3_endpoint   # noqa: F401 (fixtures)

    def test_x(s3_endpoint):                       # fresh bucket per test, shared server
        client = s3_endpoint.client()              # boto3 client, botocore retries off
        uri = s3_endpoint.uri("job-1")             # "s3://<bucket>/job-1"
        s3_endpoint.endpoint_url, s3_endpoint.bucket, s3_endpoint.credentials  # for an aws connection

    with S3Server() as server:                     # outside pytest
        ep = server.endpoint("my-bucket")
    with S3ServerProcess() as server:              # moto in a child process (no fault injection)
        ep = server.endpoint("my-bucket")

Extras that a plain moto server lacks:

* Fault injection at the HTTP level, against the real endpoint: ``server.inject(count, status=503,
  code="SlowDown")`` answers the next ``count`` matching requests with that S3 error;
  ``kind="drop"`` closes the connection without an answer (a dropped connection);
  ``kind="hold"`` keeps the request, its body unread (a large body's sender is stuck mid-send),
  sets the rule's ``arrived`` and drops the connection once ``release`` is set (at most 120 s);
  ``method=`` / ``path_contains=`` restrict which requests are hit. ``server.requests`` logs
  ``(method, path, query, status)`` of every request.
* Mutating requests (PUT, POST, DELETE) are served one at a time. Moto checks
  ``If-None-Match: *`` and then writes, without a lock between; serialising writes gives the
  atomic conditional write that real S3 guarantees, so two-writer races test our protocol and
  not a moto race. Reads (GET, HEAD) run concurrently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

ACCESS_KEY = "testing-access-key"
SECRET_KEY = "testing-secret-key"
REGION = "us-east-1"


@dataclasses.dataclass
class Fault:
    remaining: int
    status: int = 503
    code: str = "SlowDown"
    kind: str = "error"  # "error" | "drop" | "hold" | "lost_reply" (done, then answered with the error)
    method: str | None = None
    path_contains: str | None = None
    arrived: threading.Event = dataclasses.field(default_factory=threading.Event)  # a "hold" caught one
    release: threading.Event = dataclasses.field(default_factory=threading.Event)  # ... let it go

    def matches(self, method: str, path: str) -> bool:
        return (
            self.remaining > 0
            and (self.method is None or self.method == method)
            and (self.path_contains is None or self.path_contains in path)
        )


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """One bucket on a running server: everything a client or an Airflow aws connection needs."""

    server: S3Server
    endpoint_url: str
    bucket: str
    region: str = REGION
    access_key_id: str = ACCESS_KEY
    secret_access_key: str = SECRET_KEY

    @property
    def credentials(self) -> dict[str, str]:
        return {"aws_access_key_id": self.access_key_id, "aws_secret_access_key": self.secret_access_key}

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this endpoint. botocore retries are off unless ``config`` says."""
        import boto3
        from botocore.config import Config

        cfg = {"retries": {"total_max_attempts": 1, "mode": "standard"}, "s3": {"addressing_style": "path"},
               "connect_timeout": 5, "read_timeout": 30, **config}
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=Config(**cfg),
            **self.credentials,
        )

    def inject(self, count: int, **fault: Any) -> Fault:
        return self.server.inject(count, **fault)


class _FaultApp:
    """WSGI middleware: serialise writes, log requests, and answer some with injected faults."""

    def __init__(self, app: Any, server: S3Server) -> None:
        self.app = app
        self.server = server

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        with self.server.fault_lock:
            fault = next((f for f in self.server.faults if f.matches(method, path)), None)
            if fault is not None:
                fault.remaining -= 1
                label = f"fault:{fault.kind}" if fault.kind in ("drop", "hold") else \
                    f"fault:{fault.status}:{fault.code}"
                self.server.requests.append((method, path, query, label))
        if fault is not None:
            if fault.kind == "lost_reply":  # the store does the request; its reply never arrives
                with self.server.write_lock:
                    list(self.app(environ, lambda *_args, **_kw: None))
            if fault.kind == "hold":
                fault.arrived.set()
                fault.release.wait(120)
            if fault.kind in ("drop", "hold"):
                sock = environ.get("werkzeug.socket")
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
                # werkzeug treats ConnectionError as "client went away" and stays quiet
                raise ConnectionResetError("injected connection drop")
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                "<Message>injected fault</Message><RequestId>fault</RequestId></Error>"
            ).encode()
            start_response(
                f"{fault.status} Injected",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [body]

        status: list[str] = []

        def recording_start_response(st: str, headers: Any, exc_info: Any = None) -> Any:
            status.append(st.split(" ", 1)[0])
            return start_response(st, headers, exc_info)

        # mutating requests run one at a time (see the module doc); reads run concurrently
        lock = self.server.write_lock if method in ("PUT", "POST", "DELETE") else contextlib.nullcontext()
        with lock:
            result = list(self.app(environ, recording_start_response))  # consumed inside the lock
        with self.server.fault_lock:
            self.server.requests.append((method, path, query, status[0] if status else "?"))
        return result


class S3Server:
    """moto's S3 in server mode with fault injection. ``start()``/``stop()`` or ``with``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.write_lock = threading.Lock()
        self.fault_lock = threading.Lock()
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, str, str]] = []
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> S3Server:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class QuietHandler(MotoRequestHandler):
            def log(self, *args: Any, **kwargs: Any) -> None:  # keep test output readable
                pass

        app = _FaultApp(DomainDispatcherApplication(create_backend_app), self)
        self._server = make_server(self.host, self.port, app, threaded=True, request_handler=QuietHandler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="moto-s3")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def endpoint(self, bucket: str | None = None) -> S3Endpoint:
        """Create ``bucket`` (a fresh unique one by default) and describe it."""
        bucket = bucket or f"test-{uuid.uuid4().hex[:12]}"
        ep = S3Endpoint(self, self.endpoint_url, bucket)
        ep.client().create_bucket(Bucket=bucket)
        return ep

    def inject(
        self,
        count: int,
        *,
        status: int = 503,
        code: str = "SlowDown",
        kind: str = "error",
        method: str | None = None,
        path_contains: str | None = None,
    ) -> Fault:
        """Fail the next ``count`` matching requests. Returns the rule (``.remaining`` counts down)."""
        if kind not in ("error", "drop", "hold", "lost_reply"):
            raise ValueError(f"kind={kind!r}: must be 'error', 'drop', 'hold' or 'lost_reply'")
        fault = Fault(count, status, code, kind, method, path_contains)
        with self.fault_lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.fault_lock:
            for fault in self.faults:
                fault.release.set()  # no held request outlives its test
            self.faults.clear()


class S3ServerProcess:
    """moto's server in a child process: S3 as a separate service (no fault injection).

    For benchmarks, and for tests whose S3 endpoint must outlive or be independent of the test
    process's GIL. Same ``endpoint()`` API as :class:`S3Server`.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> S3ServerProcess:
        with socket.socket() as sock:
            sock.bind((self.host, 0))
            self.port = sock.getsockname()[1]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()",
             "-H", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with code {self._proc.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not listen on {self.endpoint_url} within {timeout_s} s")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None

    def __enter__(self) -> S3ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def endpoint(self, bucket: str | None = None) -> S3Endpoint:
        bucket = bucket or f"test-{uuid.uuid4().hex[:12]}"
        ep = S3Endpoint(self, self.endpoint_url, bucket)  # type: ignore[arg-type]
        ep.client().create_bucket(Bucket=bucket)
        return ep

    def inject(self, count: int, **fault: Any) -> Fault:
        raise NotImplementedError("fault injection needs the in-process S3Server")


@contextmanager
def running_s3_server() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the whole test session."""
    with running_s3_server() as server:
        yield server


@pytest.fixture
def s3_endpoint(s3_server: S3Server) -> Iterator[S3Endpoint]:
    """A fresh bucket on the session's server; faults injected by the test are cleared after it."""
    yield s3_server.endpoint()
    s3_server.clear_faults()
