"""The runtime on one GPU: what a user relies on when a job's workers train on CUDA.

One worker per GPU (NCCL refuses two ranks on one GPU), so these run on a machine with a single
GPU; the multi-worker CUDA checks (``test_chunk``, ``test_span``) need two. Marked ``cuda``:
``benchmarks/device_check.sh`` runs them on a lent GPU machine. ``ELASTIC_OPS_TEST_DEVICE=cpu``
runs the same steps on the CPU (the script's dry run), where the CPU/GPU comparisons compare the
CPU with itself.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic_ops.checkpoint import open_store
from elastic_ops.errors import SpecError, WorkerLostError
from elastic_ops.runtime import ChunkStatus, run_chunk
from elastic_ops.runtime.allocation import Allocation
from tests.runtime.builders import RecordingLauncher, final_state, make_spec

DEVICE = os.environ.get("ELASTIC_OPS_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_gpu_slots = pytest.mark.skipif(DEVICE != "cuda", reason="slots name GPUs on CUDA only")
NO_DROPOUT = {"dropout": 0.0}  # CPU and GPU draw dropout masks from different generators


def one(_: int) -> int:
    return 1


def assert_models_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol)


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory) -> dict:
    """Uninterrupted 1-worker runs on the GPU: bitwise with dropout, bitwise without, fast."""
    out = {}
    for name, fields in {
        "bitwise": {},
        "bitwise-nodrop": {"params": NO_DROPOUT},
        "fast": {"consistency": "fast", "virtual_shards": None, "params": NO_DROPOUT},
    }.items():
        spec = make_spec(tmp_path_factory.mktemp(name), device=DEVICE, **fields)
        result = run_chunk(spec, 0, 30, target=one)
        assert result.status is ChunkStatus.COMPLETED and result.iteration == 30
        out[name] = (result.param_sha256, final_state(spec))
    return out


def test_a_checkpoint_written_on_the_gpu_resumes_on_a_cpu_host_and_back(tmp_path, gpu_runs):
    """A retry may land on a host of the other kind: the checkpoint holds CPU tensors and the
    GPU's RNG state apart, so either resumes the other's (within float tolerance: other kernels)."""
    on_gpu = make_spec(tmp_path, device=DEVICE, params=NO_DROPOUT)
    on_cpu = make_spec(tmp_path, device="cpu", params=NO_DROPOUT)  # the same checkpoint root
    assert run_chunk(on_gpu, 0, 12, target=one).iteration == 12
    assert run_chunk(on_cpu, 12, 20, target=one).workers_timeline[0][0] == 12
    assert run_chunk(on_gpu, 20, 30, target=one).workers_timeline[0][0] == 20
    state = final_state(on_gpu)
    assert state["iteration"] == 30 and state["cursor"] == 30 * 12
    assert all(t.device.type == "cpu" for t in state["model"].values())
    assert_models_close(state["model"], gpu_runs["bitwise-nodrop"][1]["model"], rtol=1e-4, atol=1e-5)


def test_a_bitwise_job_resumed_on_the_gpu_ends_on_the_uninterrupted_runs_bits(tmp_path, gpu_runs):
    """Dropout masks come from the GPU's generator: its state travels in the checkpoint."""
    spec = make_spec(tmp_path, device=DEVICE)
    for start, end in ((0, 7), (7, 19), (19, 30)):
        result = run_chunk(spec, start, end, target=one)
    assert result.param_sha256 == gpu_runs["bitwise"][0]


def test_fast_mode_on_the_gpu_resumes_within_tolerance(tmp_path, gpu_runs):
    spec = make_spec(tmp_path, device=DEVICE, consistency="fast", virtual_shards=None, params=NO_DROPOUT)
    run_chunk(spec, 0, 12, target=one)
    run_chunk(spec, 12, 30, target=one)
    assert_models_close(final_state(spec)["model"], gpu_runs["fast"][1]["model"], rtol=1e-5, atol=1e-6)


def test_a_killed_gpu_worker_is_retryable_and_the_rerun_matches_an_uninterrupted_run(tmp_path, gpu_runs):
    params = {"kill_at": 17, "kill_rank": 0, "marker": str(tmp_path / "killed-once")}
    spec = make_spec(tmp_path, device=DEVICE, params=params)
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 30, target=one, host="gpu-host")
    assert err.value.retryable and err.value.host == "gpu-host" and "SIGKILL" in str(err.value)
    assert open_store(spec.checkpoint).latest().iteration == 10  # the last commit before the kill
    result = run_chunk(spec, 0, 30, target=one)
    assert result.workers_timeline[0][0] == 10  # resumed, not restarted
    assert result.param_sha256 == gpu_runs["bitwise"][0]



def test_a_chunk_run_by_the_hosts_agent_trains_on_its_granted_gpu(tmp_path, gpu_runs):
    """Under Airflow a task hands its chunk to the host's warm agent (``elastic-ops agent``): its
    workers train on the GPU slot the pool granted and end on the in-process run's bits."""
    from elastic_ops.agent.client import AgentClient
    from elastic_ops.agent.protocol import StoreConfig
    from tests.runtime.agent_helpers import running_agent

    spec = make_spec(tmp_path, device=DEVICE)
    store = StoreConfig(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)
    applied = []
    (tmp_path / "agent").mkdir()
    with running_agent(tmp_path / "agent") as agent:
        result = AgentClient(agent.path).run_chunk(
            spec.to_dict(), 0, 30, epoch=1, host="gpu-host", store=store,
            target=lambda: Allocation.split(1, "gpu-host", (0,)),
            on_applied=lambda i, a: applied.append((i, a.workers, a.on("gpu-host"))),
        )
    assert result.status is ChunkStatus.COMPLETED and result.param_sha256 == gpu_runs["bitwise"][0]
    assert applied == [(0, 1, (0,))]


def test_a_preempted_gpu_job_commits_gives_its_gpu_memory_back_and_resumes(tmp_path, gpu_runs):
    """Target 0 (a higher-priority job wants the GPU): the state at the boundary is committed and
    the workers have exited, their GPU memory freed, before the chunk returns."""
    free_before = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 0
    spec = make_spec(tmp_path, device=DEVICE)
    result = run_chunk(spec, 0, 30, target=lambda i: 0 if i >= 15 else 1)
    assert result.status is ChunkStatus.PREEMPTED and result.iteration == 15
    assert open_store(spec.checkpoint).latest().iteration == 15
    if DEVICE == "cuda":  # a worker still alive would hold its context (hundreds of MiB) and more
        assert torch.cuda.mem_get_info()[0] > free_before - 256 * 2**20
    assert run_chunk(spec, 0, 30, target=one).param_sha256 == gpu_runs["bitwise"][0]


def test_bf16_autocast_trains_bitwise_on_the_gpu_across_a_resume(tmp_path, gpu_runs):
    """Mixed precision as a user writes it (``torch.autocast`` in ``loss``; bf16 needs no
    GradScaler): parameters and gradients stay float32 in the flat buffer, autocast takes effect
    (other bits than the float32 run), and a run split by a checkpoint ends on the same bits."""
    whole = make_spec(tmp_path / "whole", device=DEVICE, params={"autocast": "bfloat16"})
    ref = run_chunk(whole, 0, 30, target=one)
    split = make_spec(tmp_path / "split", device=DEVICE, params={"autocast": "bfloat16"})
    run_chunk(split, 0, 12, target=one)
    assert run_chunk(split, 12, 30, target=one).param_sha256 == ref.param_sha256
    assert ref.param_sha256 != gpu_runs["bitwise"][0]
    state = final_state(whole)
    assert {t.dtype for t in state["model"].values()} == {torch.float32}
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in state["metrics"]["loss"])

DDP_SCRIPT = """
import json, os
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import elastic_ops.runtime.script as elastic

g = torch.Generator().manual_seed(5)
x = torch.randn(60, 4, generator=g)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
ctx = elastic.init(num_samples=len(x))
x, y = x.to(ctx.device), y.to(ctx.device)
torch.manual_seed(0)
model = DDP(nn.Linear(4, 1).to(ctx.device), device_ids=[0] if ctx.device.type == "cuda" else None)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
ctx.restore(model, optimizer)
with open(ctx.params["seen"], "a") as fh:
    fh.write(json.dumps({"device": str(ctx.device), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                         "gpus": torch.cuda.device_count(), "backend": torch.distributed.get_backend(),
                         "params_on": str(next(model.parameters()).device)}) + "\\n")
for it in ctx.iterations():
    idx = torch.as_tensor(ctx.my_samples(it), device=ctx.device)
    optimizer.zero_grad()
    loss = F.mse_loss(model(x[idx]), y[idx])
    (loss * ctx.loss_weight()).backward()
    optimizer.step()
    ctx.commit(it, loss.item())
"""


def test_a_ddp_script_trains_on_its_one_gpu_like_on_the_cpu(tmp_path):
    """Script mode: the worker sees exactly its granted GPU as cuda:0 and DDP runs over NCCL; the
    model it trains (and checkpoints, resumed mid-run) matches the same script on the CPU."""
    from elastic_ops.spec import JobSpec

    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)

    def spec(name: str, device: str) -> JobSpec:
        return JobSpec(name="script", entrypoint=str(script), total_iterations=24, global_batch=12,
                       max_workers=1, consistency="fast", checkpoint=f"file://{tmp_path}/{name}",
                       checkpoint_interval=8, data_seed=1, device=device,
                       params={"seen": str(tmp_path / f"{name}.jsonl")})

    gpu, cpu = spec("gpu", DEVICE), spec("cpu", "cpu")
    run_chunk(gpu, 0, 10, target=one)
    assert run_chunk(gpu, 10, 24, target=one).workers_timeline[0][0] == 10  # from the chunk's commit
    run_chunk(cpu, 0, 24, target=one)
    seen = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    if DEVICE == "cuda":
        assert {(s["device"], s["gpus"], s["backend"], s["params_on"]) for s in seen} == {
            ("cuda:0", 1, "nccl", "cuda:0")
        }
        assert all(s["visible"] is not None for s in seen)
    got, want = final_state(gpu), final_state(cpu)
    assert got["iteration"] == want["iteration"] == 24
    assert_models_close(got["model"], want["model"], rtol=1e-4, atol=1e-5)
    losses = [loss for _, loss in got["metrics"]["loss"]]
    assert losses[-1] < losses[0] / 4  # it learns


def test_the_transformer_example_is_bitwise_reproducible_on_the_gpu_across_a_resume(tmp_path):
    """Deterministic kernels only (``use_deterministic_algorithms`` in bitwise mode): attention,
    embeddings, layer norm and dropout on CUDA end on the same bits when split by a checkpoint."""
    fields = dict(
        entrypoint="elastic_ops.examples.chartransformer:CharTransformer",
        total_iterations=12, global_batch=8, virtual_shards=4, checkpoint_interval=4, device=DEVICE,
        params={"context": 32, "stride": 32, "d_model": 32, "heads": 2, "layers": 1, "dropout": 0.1,
                "warmup": 2},
    )
    whole = make_spec(tmp_path / "whole", **fields)
    ref = run_chunk(whole, 0, 12, target=one)
    split = make_spec(tmp_path / "split", **fields)
    run_chunk(split, 0, 5, target=one)
    got = run_chunk(split, 5, 12, target=one)
    assert got.workers_timeline[0][0] == 5 and got.param_sha256 == ref.param_sha256
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in final_state(whole)["metrics"]["loss"])


@needs_gpu_slots
def test_a_granted_slot_runs_on_its_gpu_and_slots_without_one_are_refused(tmp_path):
    gpus = torch.cuda.device_count()
    launcher = RecordingLauncher()
    spec = make_spec(tmp_path / "ok", device="cuda", max_workers=gpus + 1, virtual_shards=gpus + 1)
    last = lambda i: Allocation.split(1, "localhost", (gpus - 1,))  # noqa: E731
    assert run_chunk(spec, 0, 10, target=last, launcher=launcher).iteration == 10
    assert [r.slots for r in launcher.requests] == [(gpus - 1,)]

    refused = make_spec(tmp_path / "refused", device="cuda", max_workers=gpus + 1, virtual_shards=gpus + 1)
    with pytest.raises(WorkerLostError, match=rf"no GPU for granted slot\(s\) \[{gpus}\] on this") as err:
        # one past the last
        run_chunk(refused, 0, 10, target=lambda i: Allocation.split(1, "gpu-host", (gpus,)), host="gpu-host")
    assert err.value.retryable and err.value.host == "gpu-host"  # the host's fault: retried elsewhere
    with pytest.raises(SpecError, match=f"needs one GPU per worker; {gpus} visible"):
        run_chunk(refused, 0, 10, target=lambda i: gpus + 1)  # more workers than GPUs
    assert open_store(refused.checkpoint).latest() is None  # refused before any worker trained


@needs_gpu_slots
def test_a_worker_given_a_gpu_cuda_does_not_have_is_a_retryable_worker_lost(tmp_path, monkeypatch):
    """A worker whose GPU cannot be used (gone, busy in exclusive-process mode, broken) fails
    before any user code, as the host's fault: a retryable ``WorkerLostError`` naming the host."""
    from elastic_ops.runtime import launcher

    monkeypatch.setattr(launcher, "visible_gpus", lambda: [str(torch.cuda.device_count() + 7)])
    spec = make_spec(tmp_path, device="cuda")
    with pytest.raises(WorkerLostError, match="rank 0 cannot use its GPU: DeviceUnusable: ") as err:
        run_chunk(spec, 0, 10, target=one, host="gpu-host")
    assert err.value.retryable and err.value.host == "gpu-host"


# CUDA_VISIBLE_DEVICES forms, and how many GPUs visible_gpus() hands out for each on a host with
# ``n`` GPUs (its own reading, cut to the devices that exist); the driver must count the same
CVD_FORMS = [
    (None, lambda n: n),
    ("", lambda n: 0),
    ("-1", lambda n: 0),
    ("0", lambda n: 1),
    (" 0", lambda n: 1),
    ("0,0", lambda n: 0),
    ("0,-1,1", lambda n: 1),
    ("0,{n}", lambda n: 1),  # an ordinal past the last GPU ends the list
    ("{uuid}", lambda n: 1),
    ("{uuid},{uuid}", lambda n: 0),
]
DRIVER_COUNT = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
rc = cuda.cuInit(0)
n = ctypes.c_int(-1)
ok = rc == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0
print(0 if rc in (100, 101) else n.value if ok else f"rc {rc}")  # 100: no device, 101: invalid (a duplicate)
"""


def test_visible_gpus_counts_what_the_cuda_driver_sees_for_each_cuda_visible_devices_form(tmp_path):
    """``""`` and ``"-1"`` hide every GPU (not "no restriction"), a duplicate hides them all, and
    the list ends at the first entry that is not a device: the driver (``cuInit`` in a fresh
    process, about 50 ms each) must agree with :func:`parse_visible_devices` on every form."""
    import subprocess
    import sys

    from elastic_ops.runtime.launcher import parse_visible_devices

    n = torch.cuda.device_count() if DEVICE == "cuda" else 1
    uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}" if DEVICE == "cuda" else "GPU-0000"
    for form, want in CVD_FORMS:
        listed = None if form is None else form.format(n=n, uuid=uuid)
        if listed is not None:
            parsed = parse_visible_devices(listed)
            real = [g for g in parsed if g == uuid or (g.isdigit() and int(g) < n)]
            ours = real[: next((i for i, g in enumerate(parsed) if g not in real), len(parsed))]
            assert len(ours) == want(n), (listed, parsed)
        if DEVICE != "cuda":
            continue
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if listed is not None:
            env["CUDA_VISIBLE_DEVICES"] = listed
        out = subprocess.run([sys.executable, "-c", DRIVER_COUNT], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.strip() == str(want(n)), (listed, out.stdout, out.stderr)
