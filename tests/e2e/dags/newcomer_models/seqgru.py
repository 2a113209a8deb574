"""``SeqGRU``: a small GRU that learns whether a random sequence's sum is positive."""

from __future__ import annotations

import torch
from torch import nn

from elastic_ops.runtime import Trainable


class GRUNet(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


class SeqGRU(Trainable):
    def __init__(self, *, hidden: int = 16, lr: float = 0.01) -> None:  # declared: a typo is refused
        super().__init__(hidden=hidden, lr=lr)

    def build_model(self) -> nn.Module:
        return GRUNet(self.params["hidden"])

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.params["lr"])

    def train_dataset(self) -> torch.utils.data.Dataset:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 12, 1, generator=g)
        return torch.utils.data.TensorDataset(x, (x.sum(dim=(1, 2)) > 0).long())

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)
