"""A chunk's own work directory (staged states, logs) and the sweep of those that chunks of
processes killed outright left behind."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger("elastic_ops.runtime")

WORKDIR_PREFIX = "elastic-ops-"  # a chunk's own work directory in the temp folder
OWNER_FILE = "owner.pid"  # in it: the pid of the process running the chunk (stale-directory sweep)


def sweep_stale_workdirs(root: str | None = None) -> list[Path]:
    """Remove the work directories (staged checkpoints, logs) that chunks of processes killed
    outright left behind: those whose owner process, on this host, is gone. A directory
    without an owner file, of another host (a temp folder shared between containers), or whose
    owner lives (or cannot be checked), is left alone."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            pid_text, _, host = (d / OWNER_FILE).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if host != socket.gethostname() or pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        log.info("removed %d work directories of chunks whose processes are gone", len(removed))
    return removed


def owner() -> str:
    return f"{os.getpid()} {socket.gethostname()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive as far as we may know
        return True
    return True
