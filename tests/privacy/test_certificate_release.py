"""The certificate releases nothing (docs/accounting.md, "The certificate releases nothing").

An attacker holds the recipe (its seed), the released weights and buffers, and the run's
released files. The check replays the model on private samples; it must leave no trace they
can read: the weights and every buffer after training are bit for bit those of the same run
without the check (same seeded noise, same batches), the caller's RNG stream goes on as if no
check had run, and which rows are checked does not follow from any seed they hold.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.certificate import Certificate
from dpclip.errors import EngineError


class Counted(nn.Module):
    """Dropout (the check cuts its recorded masks per sample), a LayerNorm, and a buffer counting forwards."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.forwards += 1
        return self.net(x)


def _train(check: bool, steps: int = 4) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(0)
    model = Counted()
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2))
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.5}},
                      gradient_noise_multiplier=1.0, expected_batch_size=16, seed=11, verify_every=2)
    if not check:
        engine.certificate._due = lambda *key: None   # the check switched off
        engine.certificate.checked_writes.add("forwards")   # (an unchecked forward may write what a check saw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    for step in range(steps):
        rows = torch.arange(16 * step, 16 * step + 16 - step)   # a new batch size each step
        engine.backward(F.cross_entropy(model(data[rows]), labels[rows], reduction="none"))
        engine.privatize()
        opt.step()
        opt.zero_grad(set_to_none=True)
    checks = engine.certificate.checks
    engine.detach()
    # all rows at the first step and step 2 (verify_every 2), one row at the new batch sizes of steps 1 and 3
    assert checks == (4 if check else 0)
    return {k: v.clone() for k, v in model.state_dict().items()}, torch.rand(4)


def test_a_checked_run_releases_the_same_weights_buffers_and_rng_stream_as_an_unchecked_one():
    checked, rng_checked = _train(True)
    plain, rng_plain = _train(False)
    assert checked.keys() == plain.keys()
    for name in plain:
        assert torch.equal(checked[name], plain[name]), name
    assert torch.equal(rng_checked, rng_plain)


def test_the_checked_rows_do_not_follow_from_any_seed():
    """Under the same torch seed, the random rows differ between draws: they come from OS entropy
    (a new batch size's one row too)."""
    for light, size in ((False, 4), (True, 1)):
        picks = set()
        for _ in range(8):
            torch.manual_seed(0)
            picks.add(tuple(Certificate.rows(SimpleNamespace(light=light), 40)))
        assert len(picks) > 1
        assert all(len(p) == size and (light or (p[0] == 0 and p[-1] == 39)) for p in picks)


def test_the_recorded_dropout_masks_are_dropped_when_the_check_ends(monkeypatch):
    """The masks a checked forward drew (kept to replay each sample alone) are held by nothing
    once the step is done: not by the certificate, the engine's state or the model."""
    import dpclip.engine.certificate as certificate

    recorded = []

    class Watched(certificate.Recorder):
        def __exit__(self, *exc):
            recorded.extend(weakref.ref(t) for t in self.draws or [])
            return super().__exit__(*exc)
    monkeypatch.setattr(certificate, "Recorder", Watched)
    torch.manual_seed(0)
    model = Counted()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 0.5}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=8, seed=3)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    engine.privatize()
    assert engine.certificate.last is not None and engine.certificate.last.mode == "alone"
    gc.collect()
    assert recorded and all(ref() is None for ref in recorded)


class _Recomputed(torch.autograd.Function):
    """A block run without gradients, recomputed in the backward, which runs a backward of its own
    into the block's parameters (a reversible layer's or a home-made checkpoint's pattern)."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.save_for_backward(x)
        ctx.block = block
        return block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return x.grad, None


class HomeMadeCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(_Recomputed.apply(self.inp(x), self.block))


def test_a_backward_run_inside_a_replay_writes_no_gradient_into_the_model():
    """The check's replays differentiate copies of the parameters; a Function that runs a backward of
    its own reaches the module's parameters by name, so the replay swaps the copies in for it too:
    the model's ``.grad`` stays empty until the noisy step writes it, and the check passes."""
    torch.manual_seed(0)
    model = HomeMadeCheckpoint().double()
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    engine = DPEngine(model, {"grouping": "layer"}, gradient_noise_multiplier=0.0, expected_batch_size=6)
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert engine.certificate.checks == 1
    assert all(p.grad is None for p in model.parameters())
    engine.privatize()
    assert all(p.grad is not None for p in model.parameters())


def test_a_refusal_raised_on_a_private_batch_says_its_shapes_are_not_covered():
    """A refusal in the forward or the backward prints tensor shapes, whose batch axis is the realised
    batch size (a Poisson draw): the message says that what it shows is not covered by ε."""
    from tests.engine.test_batch_axis import TiledTable
    torch.manual_seed(0)
    model = TiledTable(factor=2)
    DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=2)
    with pytest.raises(EngineError, match="shape.*not covered by ε"):
        model(torch.randn(2, 3, 4))
    model = HomeMadeCheckpoint()
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=3)
    out = model(torch.randn(3, 8))
    engine._keeper.forward_counts = [0] * len(engine._keeper.forward_counts)   # as if the forward counted nothing
    with pytest.raises(EngineError, match="more often in the backward.*not covered by ε"):
        engine.backward(F.cross_entropy(out, torch.tensor([0, 1, 2]), reduction="none"))
