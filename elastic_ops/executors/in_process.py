"""The chunk trains in the Airflow task's own process (no agent configured, or none answered)."""

from __future__ import annotations

from elastic_ops.executors.api import ChunkExecutor, ChunkRequest, LatestCheckpoint, Lease
from elastic_ops.runtime.outcome import ChunkResult
from elastic_ops.spec import JobSpec


class InProcessExecutor(ChunkExecutor):
    """Workers are this task's child processes, on the GPUs the grant names on this host."""

    def latest(self, spec: JobSpec) -> LatestCheckpoint | None:
        store = self.stores.store(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)
        ref = store.latest(spec_hash=spec.spec_hash(), decode=False)
        return None if ref is None else LatestCheckpoint(ref.iteration, ref.uri, dict(ref.metrics))

    def run(self, request: ChunkRequest, lease: Lease) -> ChunkResult:
        from elastic_ops.runtime import run_chunk

        spec = request.spec
        store = self.stores.store(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)
        # the warm-start model is read with the same Airflow connection (credentials, endpoint)
        warm_store = self.stores.store(request.warm_start) if request.warm_start else None
        return run_chunk(
            spec, request.start, request.end, target=lease.target, store=store, epoch=request.epoch,
            on_progress=self._progress(request, lease), host=request.host, warm_start=request.warm_start,
            # workers on the GPUs granted on this host (a move relaunches them)
            warm_start_store=warm_store,
            on_segment=lease.applied,  # report a shrink or move once the old workers have exited
        )
