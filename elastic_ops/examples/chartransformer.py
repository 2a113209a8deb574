"""A small character-level transformer language model on Python's own standard library source.

Data: :mod:`elastic_ops.examples.corpus` (about 232 000 characters of stdlib source that ships
with the interpreter). The first ``1 - val_fraction`` of the text is for training, the rest
for validation. A training sample is a window of ``context + 1`` token ids starting at a
multiple of ``stride``; the model predicts every next character of the window.

Architecture: token + learned position embeddings, ``layers`` pre-norm blocks (causal
multi-head self-attention written with plain matmul/softmax, GELU MLP), final LayerNorm and a
linear head. Only deterministic CPU/CUDA kernels are used; dropout (off by default) draws from
the torch RNG that the runtime seeds.

Parameters (``JobSpec.params``): ``context`` (64), ``stride`` (32), ``d_model`` (64),
``heads`` (4), ``layers`` (2), ``dropout`` (0.0), ``lr`` (0.003), ``weight_decay`` (0.01),
``warmup`` (50 iterations of linear learning-rate warmup, 0 = none), ``val_fraction`` (0.1),
``init_seed`` (0), ``corpus_sha256`` (None; when set, the corpus must hash to it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from elastic_ops.errors import SpecError
from elastic_ops.examples import corpus
from elastic_ops.examples import params as P
from elastic_ops.runtime.trainable import Trainable


def _optional_sha(key: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 64 or not all(c in "0123456789abcdef" for c in value):
        raise SpecError(f"params.{key}", value, "must be a lowercase hex SHA-256 (64 characters) or null")
    return value


SCHEMA = {
    "context": (64, P.positive_int),
    "stride": (32, P.positive_int),
    "d_model": (64, P.positive_int),
    "heads": (4, P.positive_int),
    "layers": (2, P.positive_int),
    "dropout": (0.0, P.probability),
    "lr": (0.003, P.positive_float),
    "weight_decay": (0.01, P.non_negative_float),
    "warmup": (50, P.non_negative_int),
    "val_fraction": (0.1, P.fraction),
    "init_seed": (0, P.non_negative_int),
    "corpus_sha256": (None, _optional_sha),
}


class Windows(Dataset):
    """Windows ``ids[i*stride : i*stride + length]`` of a token array, as int64 tensors."""

    def __init__(self, ids: torch.Tensor, length: int, stride: int) -> None:
        if len(ids) < length:
            raise ValueError(f"text of {len(ids)} tokens is shorter than one window ({length})")
        self.ids, self.length, self.stride = ids, length, stride
        self.count = (len(ids) - length) // stride + 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -self.count <= index < self.count:
            raise IndexError(index)
        start = (index % self.count) * self.stride
        return self.ids[start : start + self.length].long()

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """Windows ``indices`` stacked into ``[len(indices), length]`` with one gather."""
        starts = torch.as_tensor(indices, dtype=torch.long) * self.stride
        return self.ids[starts[:, None] + torch.arange(self.length)].long()


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = self.drop(scores.masked_fill(causal, float("-inf")).softmax(dim=-1))
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CharLM(nn.Module):
    def __init__(self, vocab: int, context: int, d_model: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, time, vocab]`` for the next character at every position."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CharTransformer(Trainable):
    """Next-character prediction on stdlib source; reports validation loss and bits per char."""

    PARAMS = SCHEMA  # the parameters it takes: a misspelt one is refused before workers start

    def __init__(self, **params: object) -> None:
        p = P.parse(params, SCHEMA)
        if p["d_model"] % p["heads"]:
            raise SpecError("params.heads", p["heads"], f"must divide params.d_model ({p['d_model']})")
        super().__init__(**p)

    def _ids(self) -> torch.Tensor:
        expected = self.params["corpus_sha256"]
        if expected is not None and corpus.corpus_sha256() != expected:
            raise SpecError(
                "params.corpus_sha256", expected,
                f"must match this interpreter's corpus ({corpus.corpus_sha256()})",
                hint="the stdlib sources differ between Python versions; run every worker on the same one",
            )
        return torch.from_numpy(corpus.corpus_ids().copy())

    def _split(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._ids()
        cut = int(len(ids) * (1 - self.params["val_fraction"]))
        return ids[:cut], ids[cut:]

    def build_model(self) -> nn.Module:
        p = self.params
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(p["init_seed"])
            return CharLM(
                corpus.VOCAB_SIZE, p["context"], p["d_model"], p["heads"], p["layers"], p["dropout"]
            )

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            model.parameters(), lr=self.params["lr"], weight_decay=self.params["weight_decay"]
        )

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
        """Linear warmup over ``warmup`` iterations (stepped once per iteration), then constant."""
        warmup = self.params["warmup"]
        if warmup == 0:
            return None
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(warmup))

    def train_dataset(self) -> Windows:
        """int64 windows of ``context + 1`` token ids from the training part of the corpus."""
        train, _ = self._split()
        return Windows(train, self.params["context"] + 1, self.params["stride"])

    def fetch(self, dataset: Dataset, indices: torch.Tensor) -> torch.Tensor:
        """The runtime's batch builder: one gather instead of collating window by window."""
        if isinstance(dataset, Windows):
            return dataset.gather(indices)
        return super().fetch(dataset, indices)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(next(model.parameters()).device)
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``val_loss`` (nats per character) and ``val_bpc`` (bits per character) on the
        validation text, cut into non-overlapping windows."""
        _, val = self._split()
        length = self.params["context"] + 1
        windows = Windows(val, length, length)
        batch = windows.gather(torch.arange(len(windows)))
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                val_loss = float(self.loss(model, batch))
        finally:
            model.train(was_training)
        return {"val_loss": val_loss, "val_bpc": val_loss / math.log(2)}


class _Warmup:
    """Picklable LambdaLR factor: ``min(1, (step + 1) / warmup)``."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup)
