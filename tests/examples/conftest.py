"""Builders for the example-model tests: a plain single-process training loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.data import default_collate


def _plain_train(trainable, *, global_batch: int, iterations: int, seed: int = 0):
    """Train ``trainable`` single-process: reshuffle every epoch from ``seed``, one optimizer
    step per global batch of ``global_batch`` samples. Returns ``(model, losses)``."""
    model = trainable.build_model()
    optimizer = trainable.build_optimizer(model)
    scheduler = trainable.build_scheduler(optimizer)
    dataset = trainable.train_dataset()
    generator = torch.Generator().manual_seed(seed)
    order, cursor, losses = torch.randperm(len(dataset), generator=generator), 0, []
    for _ in range(iterations):
        if cursor + global_batch > len(order):
            order, cursor = torch.randperm(len(dataset), generator=generator), 0
        batch = default_collate([dataset[int(i)] for i in order[cursor : cursor + global_batch]])
        cursor += global_batch
        loss = trainable.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
    return model, losses


@pytest.fixture
def plain_train() -> Callable:
    return _plain_train


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and the test machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
