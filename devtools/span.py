"""A launcher that runs every "host" of a spanning segment on this machine (tests, benchmarks and
single-machine trials of multi-host layouts; a cluster uses node agents, :mod:`elastic_ops.agent.span`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from elastic_ops.runtime.launcher import LaunchRequest
from elastic_ops.runtime.span import FollowerRanks, SpanningContext, follower_request


class LoopbackSpanLauncher:
    """Runs every "host" of a spanning segment on this machine: the other hosts' parts are
    :class:`FollowerRanks` here. For tests and single-machine trials of multi-host layouts; a
    cluster uses node agents (:mod:`elastic_ops.agent.span`)."""

    address = "127.0.0.1"

    def __init__(self, base: Any = None) -> None:
        from elastic_ops.runtime.launcher import LocalLauncher

        self.base = base or LocalLauncher()
        self.hosts_started: list[tuple[str, int, int]] = []  # (host, rank offset, count) per part

    def start(self, req: LaunchRequest) -> Any:
        leader_cfg = json.loads(Path(req.env["ELASTIC_OPS_SEGMENT"]).read_text())
        remotes = []
        try:
            for g, part in enumerate(req.remote, start=1):
                directory = Path(leader_cfg["dir"]).parent / f"{Path(leader_cfg['dir']).name}-{part.host}"
                remotes.append(FollowerRanks(self.base, follower_request(req, part, g, directory),
                                             leader_cfg, part.host))
                self.hosts_started.append((part.host, part.rank_offset, part.count))
            local = self.base.start(dataclasses.replace(req, remote=()))
        except BaseException:
            for r in remotes:
                r.close()
            raise
        return SpanningContext(local, remotes)
