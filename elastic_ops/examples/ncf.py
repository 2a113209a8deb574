"""Neural collaborative filtering (NeuMF: a GMF and an MLP tower over shared user and item
embeddings; He et al. 2017) on synthetic implicit feedback the example generates: nothing is
downloaded. Its parameters are almost all embedding rows (91 % with the shipped spec), each batch
touches a few of them: the model the parameter-server strategy is for (``examples/ncf.yaml``).

The data (deterministic from ``data_seed``): ``users`` x ``items`` with hidden taste vectors
(``factors`` dimensions) and item popularity; each user interacts with ``per_user`` items, drawn
by taste (Gumbel top-k over ``taste * <user, item> + popularity``). Leave-one-out: one
interaction per user is held out for the test. Each training interaction is a positive sample
with ``negatives`` fixed negative samples (items the user did not interact with), drawn once at
generation, so the data set, like every sample order, is the same in every process. A catalogue
of more than 5,000 items (the benchmark's) draws each user's interactions from 2,000 random
candidates and the negatives uniformly (one may then be an item the user interacted with, at
odds ``per_user / items``), so generating it costs users x 2,000, not users x items.

Evaluation (``evaluate()``): the held-out item of each user ranked among 99 items the user never
interacted with (fixed too): ``hit_rate`` is HR@10 (the share of users whose held-out item ranks
in the top 10; chance is 0.10), ``ndcg`` is NDCG@10.

Parameters (``JobSpec.params``): ``users`` (1000), ``items`` (1000), ``dim`` (32, the embedding
width), ``hidden`` (64, the MLP tower's first layer; a large one makes a dense model),
``per_user`` (40), ``negatives`` (4), ``factors`` (8), ``taste`` (3.0), ``lr`` (0.1, Adagrad),
``data_seed`` (0), ``init_seed`` (0), ``sparse`` (true: ``nn.Embedding(sparse=True)``, whose
sparse gradient Adagrad steps row by row; false: a dense one).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastic_ops.errors import SpecError
from elastic_ops.examples import params as P
from elastic_ops.runtime.trainable import Trainable

SCHEMA = {
    "users": (1000, P.positive_int),
    "items": (1000, P.positive_int),
    "dim": (32, P.positive_int),
    "hidden": (64, P.positive_int),
    "per_user": (40, P.positive_int),
    "negatives": (4, P.non_negative_int),
    "factors": (8, P.positive_int),
    "taste": (3.0, P.non_negative_float),
    "lr": (0.1, P.positive_float),
    "data_seed": (0, P.non_negative_int),
    "init_seed": (0, P.non_negative_int),
    "sparse": (True, P.flag),
}

TEST_NEGATIVES = 99
TOP_K = 10
LARGE_CATALOGUE = 5000  # more items than this: interactions drawn from CANDIDATES random items each
CANDIDATES = 2000


@functools.lru_cache(maxsize=4)
def generate(users: int, items: int, per_user: int, negatives: int, factors: int, taste: float,
             seed: int) -> dict[str, torch.Tensor]:
    """The synthetic data: ``train`` (user, item, label) tensors and ``test`` (user, 100 items,
    the held-out one first). Cached per process; callers must not modify the tensors."""
    if per_user < 2 or per_user + TEST_NEGATIVES + 1 > items:
        raise SpecError("params.per_user", per_user, f"must be >= 2 and leave {TEST_NEGATIVES + 1} items a "
                        f"user never saw (items is {items})")
    g = torch.Generator().manual_seed(seed)
    pu = torch.randn(users, factors, generator=g)
    qi = torch.randn(items, factors, generator=g)
    popularity = torch.randn(items, generator=g)
    if items <= LARGE_CATALOGUE:
        candidates = torch.arange(items).expand(users, items)
    else:  # a user's interactions come from random candidates: O(users x CANDIDATES), not x items
        candidates = torch.randint(items, (users, CANDIDATES), generator=g)
    score = taste * (pu.unsqueeze(1) * qi[candidates]).sum(-1) / factors**0.5 + popularity[candidates]
    gumbel = -torch.log(-torch.log(torch.rand(score.shape, generator=g).clamp_min(1e-12)))
    best = torch.topk(score + gumbel, per_user, dim=1).indices  # each user's interactions, by taste
    seen = candidates.gather(1, best)
    order = torch.argsort(torch.rand(users, per_user, generator=g), dim=1)  # a random one is held out
    seen = seen.gather(1, order)
    held = seen[:, -1]
    pos = seen[:, :-1]
    if items <= LARGE_CATALOGUE:
        mask = torch.zeros(users, items, dtype=torch.bool)
        mask.scatter_(1, seen, True)
        weights = (~mask).float()  # never an item the user interacted with
        neg_train = torch.multinomial(weights, (per_user - 1) * negatives, replacement=True, generator=g)
        neg_test = torch.multinomial(weights, TEST_NEGATIVES, replacement=False, generator=g)
    else:  # uniform: one of the user's own items, at odds per_user / items
        neg_train = torch.randint(items, (users, (per_user - 1) * negatives), generator=g)
        neg_test = torch.randint(items, (users, TEST_NEGATIVES), generator=g)
    u_pos = torch.arange(users).repeat_interleave(per_user - 1)
    u_neg = torch.arange(users).repeat_interleave((per_user - 1) * negatives)
    train = {
        "user": torch.cat([u_pos, u_neg]),
        "item": torch.cat([pos.reshape(-1), neg_train.reshape(-1)]),
        "label": torch.cat([torch.ones(len(u_pos)), torch.zeros(len(u_neg))]),
    }
    test_items = torch.cat([held.unsqueeze(1), neg_test], dim=1)
    return {**train, "test_items": test_items}


class NeuMF(nn.Module):
    """GMF (``user * item``) beside an MLP tower over ``[user, item]``, one logit."""

    def __init__(self, users: int, items: int, dim: int, hidden: int, sparse: bool) -> None:
        super().__init__()
        self.user = nn.Embedding(users, dim, sparse=sparse)
        self.item = nn.Embedding(items, dim, sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden // 2 or 1),
                                 nn.ReLU())
        self.out = nn.Linear(dim + (hidden // 2 or 1), 1)
        for emb in (self.user, self.item):
            nn.init.normal_(emb.weight, std=0.1)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        eu, ei = self.user(user), self.item(item)
        h = torch.cat([eu * ei, self.mlp(torch.cat([eu, ei], dim=-1))], dim=-1)
        return self.out(h).squeeze(-1)


class NCF(Trainable):
    """NeuMF trained by Adagrad on binary cross-entropy over positives and fixed negatives."""

    PARAMS = SCHEMA

    def __init__(self, **params: object) -> None:
        super().__init__(**P.parse(params, SCHEMA))

    def _data(self) -> dict[str, torch.Tensor]:
        p = self.params
        return generate(p["users"], p["items"], p["per_user"], p["negatives"], p["factors"], p["taste"],
                        p["data_seed"])

    def build_model(self) -> nn.Module:
        p = self.params
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(p["init_seed"])
            return NeuMF(p["users"], p["items"], p["dim"], p["hidden"], p["sparse"])

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(model.parameters(), lr=self.params["lr"])

    def train_dataset(self) -> TensorDataset:
        d = self._data()
        return TensorDataset(d["user"], d["item"], d["label"])

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        user, item, label = batch
        return F.binary_cross_entropy_with_logits(model(user, item), label)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``hit_rate`` (HR@10) and ``ndcg`` (NDCG@10) of the held-out items (see the module doc)."""
        items = self._data()["test_items"]
        users = torch.arange(len(items)).unsqueeze(1).expand_as(items)
        with torch.no_grad():
            scores = model(users.reshape(-1), items.reshape(-1)).view_as(items)
        rank = (scores[:, 1:] > scores[:, :1]).sum(dim=1)  # items scored above the held-out one
        hit = rank < TOP_K
        ndcg = torch.where(hit, 1.0 / torch.log2(rank.double() + 2.0), torch.zeros((), dtype=torch.float64))
        return {"hit_rate": float(hit.double().mean()), "ndcg": float(ndcg.mean())}

    def parameter_share(self) -> float:
        """The share of the model's parameters that are embedding rows."""
        model = self.build_model()
        tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        return tables / sum(p.numel() for p in model.parameters())
