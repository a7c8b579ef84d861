"""An attacker who controls one example makes its gradient non-finite (an inf or NaN in its
input). Before the fix, its clip factor was 0 (or NaN) and 0·inf = NaN entered every clipped
sum: the whole release became NaN, an unbounded change caused by one example.

The contract: a sample whose group norm is non-finite contributes exactly zero to that
group's clipped sum, and threshold statistics see it as +inf (above every threshold), so
their sensitivity is unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpclip.engine.microbatch as microbatch_module
from dpclip.engine import DPEngine, trainable_params
from dpclip.engine.policies.histogram import histogram_counts
from tests.engine.conftest import DTYPE, classify_loss, mlp, mlp_batch

BAD = 2          # index of the attacker's example
EXPECTED = 8     # expected batch size (≠ the realised 5 or 4)


def _poison(batch, value, key="x"):
    batch = {k: v.clone() for k, v in batch.items()}
    batch[key][BAD] = value
    return batch


def _without_bad(batch):
    keep = [i for i in range(next(iter(batch.values())).shape[0]) if i != BAD]
    return {k: v[keep] for k, v in batch.items()}


def _release(model, loss_fn, batch, clipping, micro=None, noise_multiplier=0.0, seed=0):
    engine = DPEngine(model, clipping, expected_batch_size=EXPECTED,
                      gradient_noise_multiplier=noise_multiplier, seed=seed)
    n = next(iter(batch.values())).shape[0]
    start = 0
    for size in micro or [n]:
        engine.backward(loss_fn(model, {k: v[start:start + size] for k, v in batch.items()}))
        start += size
    report = engine.privatize()
    grads = {info.name: info.param.grad.clone() for info in trainable_params(model)}
    engine.detach()
    return grads, report


def _assert_bad_example_contributes_nothing(factory, loss_fn, poisoned, clipping, micro=None):
    model = factory()
    reference_model = copy.deepcopy(model)
    grads, report = _release(model, loss_fn, poisoned, clipping, micro)
    clean, clean_report = _release(reference_model, loss_fn, _without_bad(poisoned), clipping)
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, clean[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
    assert report.nonfinite.tolist() == [1] * len(report.group_names)
    assert clean_report.nonfinite.tolist() == [0] * len(report.group_names)
    assert report.to_dict()["nonfinite"] == [1] * len(report.group_names)
    return report, clean_report


def _clipping(grouping, fn, norm_method="auto", threshold=0.5):
    return {"grouping": grouping, "fn": fn, "norm_method": norm_method,
            "threshold": {"kind": "fixed", "value": threshold}}


@pytest.mark.parametrize("norm_method", ["ghost", "instantiate"])
@pytest.mark.parametrize("fn", ["abadi", "auto"])
@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_example_contributes_zero_to_the_clipped_sum(grouping, fn, norm_method, value):
    # One Linear on the input: an inf or NaN input row makes every parameter's per-sample
    # gradient of that example non-finite.
    def linear():
        torch.manual_seed(0)
        return nn.Linear(6, 3).to(DTYPE)

    poisoned = _poison(mlp_batch(), value)
    _assert_bad_example_contributes_nothing(linear, classify_loss, poisoned,
                                            _clipping(grouping, fn, norm_method))


@pytest.mark.parametrize("micro", [None, [2, 3]], ids=["one-batch", "micro-batched"])
@pytest.mark.parametrize("fn", ["abadi", "auto"])
@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_nan_example_in_an_mlp_contributes_zero_to_every_group(grouping, fn, micro):
    report, _ = _assert_bad_example_contributes_nothing(
        mlp, classify_loss, _poison(mlp_batch(), float("nan")), _clipping(grouping, fn), micro)
    assert report.samples_seen == 5
    for q, values in report.norm_quantiles.items():   # computed over the finite norms only
        assert torch.isfinite(values).all(), q


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["cpu-per-sample", "batched-chunks"])
def test_streamed_groups_drop_the_nonfinite_sample(monkeypatch, one_at_a_time):
    # Layer-wise grouping with instantiated gradients: G_i is formed chunk by chunk
    # (streamed_clip: one sample at a time on the CPU, batched chunks on other devices),
    # so the NaN rows must be dropped inside the chunks too.
    calls = []
    original = microbatch_module.streamed_clip

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs, one_at_a_time=one_at_a_time)

    monkeypatch.setattr(microbatch_module, "streamed_clip", spy)
    g = torch.Generator().manual_seed(7)
    batch = {"x": torch.randn(5, 4, 6, generator=g, dtype=DTYPE),
             "y": torch.randint(0, 3, (5,), generator=g)}
    poisoned = _poison(batch, float("nan"))

    def seq_loss(model, b):
        return F.cross_entropy(model(b["x"]).mean(1), b["y"], reduction="none")

    def seq_mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)

    _assert_bad_example_contributes_nothing(seq_mlp, seq_loss, poisoned,
                                            _clipping("layer", "abadi", "instantiate"))
    assert calls, "the streamed path was not exercised"


class TiedLM(nn.Module):
    """Embedding (with a padding row) tied to the output head; ``gain`` scales the
    embeddings per sample, so one example's gain can be made non-finite."""

    def __init__(self, vocab=11, d=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, gain):
        h = torch.tanh(self.mix(self.emb(ids) * gain[:, None, None]))
        return self.head(h)


def tied_lm():
    torch.manual_seed(0)
    return TiedLM().to(DTYPE)


def lm_loss(model, batch):
    logits = model(batch["ids"], batch["gain"])
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["ids"][:, 1:],
                           reduction="none").mean(1)


@pytest.mark.parametrize("norm_method", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_nonfinite_example_contributes_zero_through_a_tied_embedding(grouping, norm_method):
    g = torch.Generator().manual_seed(3)
    batch = {"ids": torch.randint(0, 11, (5, 6), generator=g),
             "gain": torch.linspace(0.5, 1.5, 5, dtype=DTYPE)}
    _assert_bad_example_contributes_nothing(tied_lm, lm_loss, _poison(batch, float("nan"), "gain"),
                                            _clipping(grouping, "abadi", norm_method))


def test_noisy_release_stays_finite_with_a_nonfinite_example():
    model = mlp()
    grads, _ = _release(model, classify_loss, _poison(mlp_batch(), float("inf")),
                        _clipping("all-layer", "abadi"), noise_multiplier=1.0)
    assert all(torch.isfinite(g).all() for g in grads.values())


POLICIES = {
    "quantile": {"kind": "quantile", "sigma": 0.01, "initial": 0.5},
    "dcsgd-p": {"kind": "dcsgd-p", "sigma_hist": 0.01, "bins": 5, "range": 4.0},
    "discriminative": {"kind": "discriminative", "small": 0.3, "tail_rule": "threshold",
                       "tail_threshold": 0.5},
}


@pytest.mark.parametrize("kind", list(POLICIES))
@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_threshold_statistics_see_a_nonfinite_example_as_one_sample_above_the_threshold(kind, grouping):
    clipping = {"grouping": grouping, "threshold": POLICIES[kind]}
    poisoned = _poison(mlp_batch(), float("nan"))
    # Same seed: the statistics' noise is the same draw, so the releases differ only by
    # the attacker's example.
    report, clean = _assert_bad_example_contributes_nothing(mlp, classify_loss, poisoned, clipping)
    k = len(report.group_names)
    assert all(torch.isfinite(report.thresholds)) and all(torch.isfinite(clean.thresholds))
    if kind == "quantile":
        # Counted as clipped: shifted count −½ per group, i.e. −½/B in the noisy fraction.
        with_bad = torch.tensor(report.policy_summary["noisy_unclipped_fraction"])
        without = torch.tensor(clean.policy_summary["noisy_unclipped_fraction"])
        torch.testing.assert_close(with_bad - without, torch.full((k,), -0.5 / EXPECTED),
                                   rtol=0, atol=1e-6)
    elif kind == "dcsgd-p":
        # One count in the overflow (last) bin of each group's histogram: L2 change √K.
        diff = (torch.tensor(report.policy_summary["noisy_histogram"])
                - torch.tensor(clean.policy_summary["noisy_histogram"]))
        expected = torch.zeros(k, 5, dtype=diff.dtype)
        expected[:, -1] = 1
        torch.testing.assert_close(diff, expected, rtol=0, atol=2e-3)


def test_histogram_puts_a_nonfinite_norm_in_the_overflow_bin():
    norms = torch.tensor([0.1, float("inf"), float("nan")], dtype=DTYPE)
    assert histogram_counts(norms, 1.0, 4).tolist() == [1.0, 0.0, 0.0, 2.0]


def test_a_sample_is_dropped_only_from_the_groups_where_its_norm_is_nonfinite():
    # inf in the input saturates the first tanh: only the first layer's weight gradient
    # (0·inf) is non-finite; the later layers see a finite gradient and keep it.
    model = mlp()
    reference_model = copy.deepcopy(model)
    poisoned = mlp_batch()
    poisoned["x"][BAD, 0] = float("inf")     # one coordinate: no inf − inf in the first layer
    clipping = _clipping("layer", "abadi")
    grads, report = _release(model, classify_loss, poisoned, clipping)
    clean, _ = _release(reference_model, classify_loss, _without_bad(poisoned), clipping)
    assert report.nonfinite.tolist() == [1, 0, 0]
    assert all(torch.isfinite(g).all() for g in grads.values())
    for name in ("0.weight", "0.bias"):
        torch.testing.assert_close(grads[name], clean[name], rtol=1e-9, atol=1e-12)
    assert not torch.allclose(grads["4.weight"], clean["4.weight"])


class _Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.norm, self.head = nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.inner(x))))


@pytest.mark.parametrize("path", ["per-sample", "batched"])
@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_example_contributes_zero_through_a_fused_layernorm(monkeypatch, grouping, path, value):
    # The fused LayerNorm's backward runs once per sample on the CPU (one call per row) or
    # for the whole batch: either way the poisoned row's gradients stay in its own row, and
    # the example adds nothing to any group.
    from dpclip.engine.layers import norm as norm_rules

    if path == "batched":
        monkeypatch.setattr(norm_rules, "PER_SAMPLE_BACKWARD_DEVICES", ())

    def normed():
        torch.manual_seed(0)
        return _Normed().to(DTYPE)

    _assert_bad_example_contributes_nothing(normed, classify_loss, _poison(mlp_batch(), value),
                                            _clipping(grouping, "abadi"))
