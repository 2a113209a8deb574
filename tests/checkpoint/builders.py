"""Small builders for checkpoint tests: real training state and a store on either backend."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from elastic_ops.checkpoint import CheckpointStore, capture_rng, open_store
from elastic_ops.checkpoint.retry import RetryPolicy


def make_model(seed: int = 0, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(width, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    """Steps that use the RNG (random data, dropout), so a resume must restore RNG state too."""
    model.train()
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def make_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, **extra: Any
) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": capture_rng(),
        "cursor": {"epoch": 0, "offset": 12},
        **extra,
    }


def small_state(value: float = 1.0, n: int = 8) -> dict[str, Any]:
    return {"w": torch.full((n,), float(value)), "step": int(value)}


def no_sleep(_seconds: float) -> None:
    return None


@dataclasses.dataclass
class StoreTarget:
    """Where a test's store lives, with raw access (bypassing the store) to damage or inspect it."""

    kind: str  # "file" | "s3"
    uri: str
    root: Path | None = None  # file
    endpoint: Any = None  # tests.s3_server.S3Endpoint
    prefix: str = ""

    def open(self, **kwargs: Any) -> CheckpointStore:
        if self.kind == "file":
            return open_store(self.uri, **kwargs)
        kwargs.setdefault("retry", RetryPolicy(sleep=no_sleep))
        return open_store(self.uri, s3_client=self.endpoint.client(), **kwargs)

    def child_args(self) -> tuple[str, str | None]:
        """What a child process needs to open the same store: (uri, endpoint_url)."""
        return self.uri, (self.endpoint.endpoint_url if self.endpoint else None)

    def keys(self) -> list[str]:
        if self.kind == "file":
            assert self.root is not None
            return sorted(
                str(p.relative_to(self.root)).replace(os.sep, "/")
                for p in self.root.rglob("*")
                if p.is_file()
            )
        resp = self.endpoint.client().list_objects_v2(Bucket=self.endpoint.bucket, Prefix=f"{self.prefix}/")
        return sorted(o["Key"][len(self.prefix) + 1 :] for o in resp.get("Contents", []))

    def read(self, key: str) -> bytes:
        if self.kind == "file":
            return (self.root / key).read_bytes()
        return self.endpoint.client().get_object(Bucket=self.endpoint.bucket, Key=f"{self.prefix}/{key}")[
            "Body"
        ].read()

    def write(self, key: str, data: bytes) -> None:
        if self.kind == "file":
            path = self.root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return
        self.endpoint.client().put_object(Bucket=self.endpoint.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def delete(self, key: str) -> None:
        if self.kind == "file":
            (self.root / key).unlink()
            return
        self.endpoint.client().delete_object(Bucket=self.endpoint.bucket, Key=f"{self.prefix}/{key}")


def child_open(uri: str, endpoint_url: str | None, **kwargs: Any) -> CheckpointStore:
    """Open a store in a child process (its own boto3 client)."""
    if endpoint_url is None:
        return open_store(uri, **kwargs)
    from tests.s3_server import S3Endpoint

    ep = S3Endpoint(None, endpoint_url, uri.split("/")[2])  # type: ignore[arg-type]
    return open_store(uri, s3_client=ep.client(), retry=RetryPolicy(sleep=no_sleep), **kwargs)
