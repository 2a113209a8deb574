"""A StatsD server for tests: where Airflow's Stats (and so elastic_ops' metrics) are sent."""

from __future__ import annotations

import socket
import sys
import threading


class StatsdListener:
    """A StatsD server as far as Airflow can tell: a UDP socket that keeps every line it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # room for bursts while this thread waits for the GIL: a datagram dropped would fail the
        # exact sum below (SO_RCVBUFFORCE needs CAP_NET_ADMIN; without it the kernel's cap applies)
        force = 33 if sys.platform == "linux" else None  # SO_RCVBUFFORCE, which socket does not name
        for opt in (force, socket.SO_RCVBUF):
            try:
                if opt is not None:
                    self.sock.setsockopt(socket.SOL_SOCKET, opt, 16 << 20)
                    break
            except OSError:
                continue
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.lines.extend(data.decode(errors="replace").splitlines())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def named(self, name: str) -> list[str]:
        """``value|type`` of every line for metric ``name``."""
        return [ln.split(":", 1)[1] for ln in list(self.lines) if ln.split(":", 1)[0] == name]
