"""make_private's engine is driven by the loss and optimizer it returns alone: the loop calling
``private.engine``'s step methods itself is refused before anything is written, so that nothing
is released uncharged and no example enters a step twice (dpclip/integrations/seal.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import dpclip
from dpclip.errors import DpclipError
from tests.integrations.reference import clipped_per_example_sum, small_data, small_model

B, C = 20, 0.05


def _private():
    model = small_model()
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(small_data(), batch_size=B), criterion=nn.CrossEntropyLoss(), delta=1e-5,
                               noise_multiplier=1.0, steps=3, max_grad_norm=C)


def _drawn(private):
    """A non-empty draw of the returned loader, its (loss-free) step taken for each empty one."""
    model, optimizer, criterion, loader = private
    for x, y in loader:
        if len(x):
            return x, y
        optimizer.step()
    raise AssertionError("every draw was empty")


def test_the_loops_own_engine_privatize_is_refused_and_releases_nothing_uncharged():
    private = _private()
    model, optimizer, criterion, _ = private
    x, y = _drawn(private)
    criterion(model(x), y).backward()
    steps = private.ledger.steps
    with pytest.raises(DpclipError, match="privatize.*not be charged") as refused:
        private.engine.privatize()
    assert "optimizer.step()" in refused.value.hint
    assert all(p.grad is None for p in model.parameters())   # no noisy gradient written, uncharged
    optimizer.step()   # the loop's own step still releases the draw, charged
    assert private.ledger.steps == steps + 1 and all(p.grad is not None for p in model.parameters())


def test_the_loops_own_engine_backward_is_refused_so_no_example_enters_its_step_twice(monkeypatch):
    private = _private()
    model, optimizer, criterion, _ = private
    monkeypatch.setattr(private.engine.noise, "add_gaussians", lambda grads, stds: None)
    x, y = _drawn(private)
    expected = clipped_per_example_sum(small_model(), x, y, C)
    with pytest.raises(DpclipError, match="backward.*twice, charged once") as refused:
        private.engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert "loss.backward()" in refused.value.hint
    criterion(model(x), y).backward()
    optimizer.step()
    for p, want in zip(model.parameters(), expected):   # each drawn example once: Σ clipped / B
        torch.testing.assert_close(p.grad, want / B, rtol=1e-4, atol=1e-7)


def test_the_loops_own_engine_pause_is_refused_before_a_raw_gradient_reaches_p_grad():
    private = _private()
    model, _, _, _ = private
    x, y = _drawn(private)
    with pytest.raises(DpclipError, match="paused.*raw gradients") as refused:
        with private.engine.paused():
            F.cross_entropy(model(x), y).backward()
    assert "torch.no_grad()" in refused.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_the_engines_settings_stay_readable():
    private = _private()
    assert private.engine.group_names and float(private.engine.thresholds.reshape(-1)[0]) == pytest.approx(C)


@pytest.mark.parametrize("read,named", [(lambda engine: engine.debug_clipped(), "debug_clipped"),
                                        (lambda engine: engine.step_accumulator.whole_sums(), "step_accumulator")],
                         ids=["debug_clipped", "step_accumulator"])
def test_the_open_draws_noiseless_sums_are_refused_to_the_loop_and_the_step_still_runs(read, named):
    private = _private()
    model, optimizer, criterion, _ = private
    x, y = _drawn(private)
    criterion(model(x), y).backward()
    with pytest.raises(DpclipError, match=f"{named}.*without noise") as refused:
        read(private.engine)
    assert "p.grad after optimizer.step()" in refused.value.hint
    optimizer.step()   # the sums were not taken: the step releases the draw
    assert private.ledger.steps >= 1 and isinstance(private.engine, dpclip.engine.DPEngine)
