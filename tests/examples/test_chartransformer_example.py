"""CharTransformer: a stable corpus, correct windows, a causal model that learns."""

from __future__ import annotations

import math

import pytest
import torch

from elastic_ops.errors import SpecError
from elastic_ops.examples import corpus
from elastic_ops.examples.chartransformer import CharTransformer, Windows

SMALL = {"context": 16, "stride": 8, "d_model": 32, "heads": 2, "layers": 1}


def _rebuilt_corpus() -> bytes:
    corpus.corpus_text.cache_clear()
    corpus.corpus_ids.cache_clear()
    return corpus.corpus_ids().tobytes()


def test_corpus_is_identical_across_loads():
    assert _rebuilt_corpus() == _rebuilt_corpus()
    assert len(corpus.corpus_text()) > 100_000


def test_encoding_round_trips_the_corpus():
    text = corpus.corpus_text()
    ids = corpus.corpus_ids()
    assert len(ids) == len(text) and int(ids.max()) < corpus.VOCAB_SIZE
    expected = "".join(c if c == "\n" or " " <= c <= "~" else "?" for c in text)
    assert corpus.decode(ids) == expected


def test_windows_are_consecutive_slices_at_stride():
    ids = torch.arange(100)
    w = Windows(ids, length=10, stride=7)
    assert len(w) == (100 - 10) // 7 + 1
    for i in range(len(w)):
        assert torch.equal(w[i], torch.arange(7 * i, 7 * i + 10))
    with pytest.raises(IndexError):
        w[len(w)]
    picked = torch.tensor([3, 0, 5])
    assert torch.equal(w.gather(picked), torch.stack([w[3], w[0], w[5]]))


def test_fetch_builds_the_same_batch_as_collating_windows():
    t = CharTransformer(**SMALL)
    ds = t.train_dataset()
    picked = torch.tensor([7, 2, len(ds) - 1])
    assert torch.equal(t.fetch(ds, picked), torch.stack([ds[7], ds[2], ds[len(ds) - 1]]))


def test_train_windows_stay_out_of_the_validation_text():
    t = CharTransformer(**SMALL)
    train = t.train_dataset()
    cut = int(len(corpus.corpus_ids()) * 0.9)
    last = train[len(train) - 1]
    assert last.shape == (17,) and last.dtype == torch.int64
    assert (len(train) - 1) * 8 + 17 <= cut


def test_model_is_causal():
    """Changing a later character never changes the prediction at an earlier position."""
    t = CharTransformer(**SMALL)
    model = t.build_model().eval()
    ids = t.train_dataset()[3][:-1].unsqueeze(0)
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % corpus.VOCAB_SIZE
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.equal(a[0, 10:], b[0, 10:])


def test_one_step_lowers_the_loss():
    t = CharTransformer(**SMALL)
    model = t.build_model()
    batch = torch.stack([t.train_dataset()[i] for i in range(16)])
    opt = t.build_optimizer(model)
    for group in opt.param_groups:  # skip the warmup so one step is a full step
        group["lr"] = t.params["lr"]
    before = t.loss(model, batch)
    opt.zero_grad()
    before.backward()
    opt.step()
    assert float(t.loss(model, batch).detach()) < float(before.detach())


def test_loss_is_the_mean_of_equal_shard_losses():
    t = CharTransformer(**SMALL)
    model = t.build_model()
    batch = torch.stack([t.train_dataset()[i] for i in range(16)])
    shards = torch.stack([t.loss(model, batch[k : k + 4]) for k in range(0, 16, 4)])
    assert torch.allclose(t.loss(model, batch), shards.mean(), atol=1e-6)


def test_evaluate_reports_loss_and_bits_per_char():
    t = CharTransformer(**SMALL)
    model = t.build_model()
    metrics = t.evaluate(model)
    assert set(metrics) == {"val_loss", "val_bpc"}
    assert metrics["val_bpc"] == pytest.approx(metrics["val_loss"] / math.log(2))
    # an untrained model is close to uniform over the vocabulary
    assert metrics["val_loss"] == pytest.approx(math.log(corpus.VOCAB_SIZE), rel=0.25)
    assert model.training


def test_warmup_schedule_ramps_the_learning_rate():
    t = CharTransformer(**SMALL, warmup=4)
    opt = t.build_optimizer(t.build_model())
    sched = t.build_scheduler(opt)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.003 * f for f in (0.25, 0.5, 0.75, 1, 1, 1)])
    assert CharTransformer(warmup=0).build_scheduler(opt) is None


def test_short_training_lowers_validation_loss(plain_train):
    t = CharTransformer(**SMALL)
    before = t.evaluate(t.build_model())["val_loss"]
    model, _ = plain_train(t, global_batch=16, iterations=60)
    assert t.evaluate(model)["val_loss"] < before - 0.5


def test_training_with_dropout_depends_only_on_the_seeded_torch_rng(plain_train):
    runs = []
    for _ in range(2):
        torch.manual_seed(123)  # what the runtime does before training
        model, _ = plain_train(CharTransformer(**SMALL, dropout=0.1), global_batch=8, iterations=5)
        runs.append(list(model.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(*runs, strict=True))


def test_pinned_corpus_hash_must_match():
    assert CharTransformer(corpus_sha256=corpus.corpus_sha256()).train_dataset()
    with pytest.raises(SpecError) as info:
        CharTransformer(corpus_sha256="0" * 64).train_dataset()
    assert info.value.field == "params.corpus_sha256"


@pytest.mark.parametrize(
    ("params", "field"),
    [({"heads": 3}, "params.heads"), ({"dropout": 1.0}, "params.dropout"),
     ({"corpus_sha256": "abc"}, "params.corpus_sha256"), ({"vocab": 50}, "params.vocab")],
)
def test_bad_params_name_the_parameter(params, field):
    with pytest.raises(SpecError) as info:
        CharTransformer(**params)
    assert info.value.field == field
