"""A release that raised (an out-of-memory in a noise draw, a Ctrl-C, a refusal) releases nothing,
and leaves nothing of its step behind: the engine's next release is the one a fresh engine that saw
only the next batch would make (the threshold policy's observations and state, ``p.grad``).

The engine driven directly (make_private, DPTrainer and the CLI stop the run instead): a step whose
``privatize`` raised is not charged, so a later release that carried its counts would carry two
batches under one noise draw (the sensitivity stated is one batch's), or a threshold moved by counts
never charged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpclip.engine.privatizer as privatizer_module
from dpclip.engine import DPEngine
from dpclip.engine.blt import blt_strategy
from dpclip.engine.correlated import banded_strategy
from dpclip.errors import EngineError

THRESHOLDS = {
    "quantile": {"kind": "quantile", "sigma": 2.0, "target": 0.6, "lr": 0.5, "initial": 0.8},
    "dcsgd-p": {"kind": "dcsgd-p", "sigma_hist": 3.0, "bins": 8, "range": 4.0, "percentile": 0.7},
    "dcsgd-e": {"kind": "dcsgd-e", "sigma_hist": 3.0, "bins": 6, "range": 4.0},
    "discriminative threshold": {"kind": "discriminative", "small": 0.5, "large": 3.0, "tail_rule": "threshold",
                                 "tail_threshold": 1.0},
    "discriminative top_fraction": {"kind": "discriminative", "small": 0.5, "large": 3.0,
                                    "tail_rule": "top_fraction", "top_fraction": 0.25},
    "fixed": {"kind": "fixed", "value": 1.0},
}
RELEASING = ["quantile", "dcsgd-p", "dcsgd-e"]


def _engine(kind: str, noise_correlation=None) -> DPEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return DPEngine(model, {"grouping": "layer", "threshold": dict(THRESHOLDS[kind])},
                    gradient_noise_multiplier=1.0, expected_batch_size=12, seed=7, noise_correlation=noise_correlation)


def _batch(seed: int, rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g) * 3, torch.randint(0, 3, (rows,), generator=g)


def _backward(engine: DPEngine, seed: int) -> None:
    x, y = _batch(seed)
    engine.backward(nn.functional.cross_entropy(engine.model(x), y, reduction="none"))


def _raise_once(monkeypatch, owner, name: str, error: BaseException, after: bool = False) -> None:
    """``owner.name`` raises ``error`` on its first call (``after``: once it has run), then works."""
    real, calls = getattr(owner, name), []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1 and not after:
            raise error
        result = real(*args, **kwargs)
        if len(calls) == 1:
            raise error
        return result
    monkeypatch.setattr(owner, name, once)


FAILURES = {
    # the gradient's noise draw runs out of memory: the policy has observed, not released
    "gradient noise": lambda mp, engine: _raise_once(mp, privatizer_module, "add_step_noise",
                                                     RuntimeError("CUDA out of memory")),
    # a Ctrl-C once the policy has released, before the report: its thresholds have moved
    "after the policy's release": lambda mp, engine: _raise_once(mp, privatizer_module, "effective_noise_multiplier",
                                                                 KeyboardInterrupt(), after=True),
}


def _grads(engine: DPEngine) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in engine.model.parameters()]


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("kind", sorted(THRESHOLDS))
def test_a_release_that_raised_leaves_the_next_release_to_the_next_batch_alone(kind, failure, monkeypatch):
    engine, fresh = _engine(kind), _engine(kind)
    for warm in (1, 2):   # both a few steps in, from the same state
        for e in (engine, fresh):
            _backward(e, warm)
            e.privatize()
            for p in e.model.parameters():
                p.grad = None
    _backward(engine, 3)   # the policy observes a batch whose release then raises
    with monkeypatch.context() as mp:
        FAILURES[failure](mp, engine)
        with pytest.raises((RuntimeError, KeyboardInterrupt)):
            engine.privatize()
    assert all(g is None for g in _grads(engine)), "a refused release left its noisy gradient in p.grad"
    assert engine.steps == fresh.steps == 2
    _backward(engine, 4)
    _backward(fresh, 4)
    pending = engine.policy.pending_statistic()
    if pending is not None:
        torch.testing.assert_close(pending, fresh.policy.pending_statistic(), rtol=0, atol=0)
    fresh.noise.load_state_dict(engine.noise.state_dict())   # the same draws from here on
    reports = [engine.privatize(), fresh.privatize()]
    torch.testing.assert_close(engine.policy.thresholds(), fresh.policy.thresholds(), rtol=0, atol=0)
    torch.testing.assert_close(reports[0].thresholds, reports[1].thresholds, rtol=0, atol=0)
    assert reports[0].aux_releases == reports[1].aux_releases
    assert reports[0].policy_summary == reports[1].policy_summary
    assert reports[0].dp_event == reports[1].dp_event
    for got, want in zip(_grads(engine), _grads(fresh)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert engine.policy.state_dict() == fresh.policy.state_dict()


@pytest.mark.parametrize("kind", RELEASING)
def test_an_out_of_memory_in_the_statistics_noise_draw_releases_neither_batchs_counts_later(kind, monkeypatch):
    """The statistic's own noise draw fails (after the gradient's): the next release counts the next batch."""
    engine, fresh = _engine(kind), _engine(kind)
    _backward(engine, 3)
    with monkeypatch.context() as mp:
        _raise_once(mp, torch, "randn", RuntimeError("CUDA out of memory"))
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.privatize()
    _backward(engine, 4)
    _backward(fresh, 4)
    torch.testing.assert_close(engine.policy.pending_statistic(), fresh.policy.pending_statistic(), rtol=0, atol=0)
    fresh.noise.load_state_dict(engine.noise.state_dict())
    reports = [engine.privatize(), fresh.privatize()]
    assert reports[0].policy_summary == reports[1].policy_summary
    torch.testing.assert_close(engine.policy.thresholds(), fresh.policy.thresholds(), rtol=0, atol=0)


MECHANISMS = {"banded MF": lambda: banded_strategy(3, 20), "BLT": lambda: blt_strategy(2, 20, 1)}


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_a_release_that_raised_after_its_correlated_noise_refuses_the_next_until_a_checkpoint_is_loaded(
        mechanism, monkeypatch):
    """Banded MF's or BLT's history took the lost step's draw in (it cannot be taken back without a copy
    of the model per step): the next release would be correlated with noise no release carried, so it
    is refused, with nothing of its step kept; the checkpoint before the lost step makes it as before."""
    engine, fresh = (_engine("quantile", MECHANISMS[mechanism]()) for _ in range(2))
    for e in (engine, fresh):
        _backward(e, 1)
        e.privatize()
        for p in e.model.parameters():
            p.grad = None
    saved = copy.deepcopy(engine.state_dict())
    _backward(engine, 2)
    with monkeypatch.context() as mp:
        _raise_once(mp, privatizer_module, "effective_noise_multiplier", KeyboardInterrupt(), after=True)
        with pytest.raises(KeyboardInterrupt):
            engine.privatize()
    _backward(engine, 3)
    with pytest.raises(EngineError, match="never released") as refused:
        engine.privatize()
    assert "load_state_dict" in refused.value.hint
    assert all(p.grad is None for p in engine.model.parameters())
    engine.load_state_dict(saved)
    fresh.load_state_dict(copy.deepcopy(saved))
    for e in (engine, fresh):
        _backward(e, 3)
    reports = [engine.privatize(), fresh.privatize()]
    assert reports[0].policy_summary == reports[1].policy_summary
    for got, want in zip(_grads(engine), _grads(fresh)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")


@pytest.mark.parametrize("kind", sorted(THRESHOLDS))
def test_holding_and_rolling_back_the_policy_reads_nothing_back_from_its_device(kind, monkeypatch):
    """Issue 54: no host round trip in the private step. ``held()`` and ``roll_back()`` clone and
    allocate on the device; neither reads a value back (a read on CUDA is a synchronisation)."""
    engine = _engine(kind)
    _backward(engine, 1)
    reads: list[str] = []
    with monkeypatch.context() as mp:
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)
            mp.setattr(torch.Tensor, name, lambda self, *a, _n=name, _real=real, **k: (reads.append(_n),
                                                                                      _real(self, *a, **k))[1])
        held = engine.policy.held()
        engine.policy.roll_back(held)
    assert reads == []
