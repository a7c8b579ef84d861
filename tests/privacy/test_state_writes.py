"""A forward that writes data into the model's state is refused before any noisy step: the state is
released with the model, and a buffer the forward reads carries one sample into other samples'
gradients across micro-batches, which nothing clips (docs/certificate.md, "What is verified").

The state is every buffer and every frozen parameter, looked up by name; a write passes only if
each checked sample's replay alone leaves it exactly as the real forward on the whole batch did,
or, where no sample can be replayed alone (a micro-batch of one row), if the replays with the row
set to zeros, to ones and given twice do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.engine import DPEngine
from dpclip.errors import DpclipError, EngineError

D = 5


def _data(b=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, D, generator=g) * 3 + 1, torch.randint(0, 3, (b,), generator=g)


def _step(model, x, y, micro=None):
    """One step of the engine over ``x`` in micro-batches of ``micro`` rows (None: one)."""
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=len(x), seed=0)
    try:
        for rows in torch.arange(len(x)).split(micro or len(x)):
            engine.backward(F.cross_entropy(model(x[rows]), y[rows], reduction="none"))
        engine.privatize()
        return engine.certificate.last
    finally:
        engine.detach()


class Writes(nn.Module):
    """A Linear whose forward writes ``write(self, x)`` into its state."""

    def __init__(self, write):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.write = nn.Linear(D, 3), write
        self.register_buffer("stat", torch.ones(D))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.frozen = nn.Parameter(torch.zeros(D), requires_grad=False)

    def forward(self, x):
        out = self.lin(x / self.stat.abs().clamp_min(0.1))
        with torch.no_grad():
            self.write(self, x.detach())
        return out


def _running_var(m, x):
    m.stat.mul_(0.5).add_(0.5 * x.var(0, unbiased=False))   # every sample alone writes the same (0)


def _guarded_mean(m, x):
    if x.shape[0] > 1:   # a common guard: alone, nothing is written
        m.stat.mul_(0.9).add_(0.1 * x.mean(0))


def _reassigned_row(m, x):
    m.stat = x[0].clone()   # out of place: a new tensor object under the same name


def _frozen_parameter(m, x):
    m.frozen.data.copy_(x[0])


def _samples_seen(m, x):
    m.seen += x.shape[0]


def _running_mean(m, x):
    m.stat.mul_(0.9).add_(0.1 * x.mean(0))


@pytest.mark.parametrize("write, name", [
    (_running_var, "buffer stat"), (_guarded_mean, "buffer stat"), (_reassigned_row, "buffer stat"),
    (_frozen_parameter, "frozen parameter frozen"), (_samples_seen, "buffer seen")])
def test_a_forward_writing_a_batch_dependent_value_into_its_state_is_refused_naming_it(write, name):
    x, y = _data()
    with pytest.raises(EngineError, match="from the data|checks no write to a parameter") as err:
        _step(Writes(write), x, y)
    assert name in err.value.message and "not covered by ε" in err.value.message
    assert "register such a statistic outside the forward" in err.value.hint


def test_a_count_of_samples_seen_is_refused_as_releasing_the_batch_size():
    x, y = _data()
    with pytest.raises(EngineError, match="a count of the samples seen releases the batch size") as err:
        _step(Writes(_samples_seen), x, y)
    # not a counter in the forward: the number of forwards follows the draws' sizes (test_forward_counters.py)
    assert "count steps in the training loop, outside the forward" in err.value.hint
    assert "persistent=False" in err.value.hint and "+= 1" not in err.value.hint


def test_a_reassigned_buffer_is_left_holding_what_the_real_forward_wrote_not_a_replayed_row():
    x, y = _data()
    model = Writes(_reassigned_row)
    with pytest.raises(EngineError, match="buffer stat"):
        _step(model, x, y)
    assert torch.equal(model.stat, x[0])   # the real forward's row, not the last replayed sample's


def test_a_running_variance_read_by_the_next_micro_batch_is_refused():
    x, y = _data(16)
    with pytest.raises(EngineError, match="buffer stat"):
        _step(Writes(_running_var), x, y, micro=8)


@pytest.mark.parametrize("write", [_running_mean, _reassigned_row])
def test_micro_batches_of_one_row_do_not_hide_a_write_from_the_data(write):
    """(A variance of one row, or a mean guarded by ``x.shape[0] > 1``, writes nothing from one row's data.)"""
    x, y = _data(4)
    with pytest.raises(EngineError, match="buffer stat") as err:
        _step(Writes(write), x, y, micro=1)
    assert "micro-batches of 2 rows or more" in err.value.hint


def test_a_row_count_in_a_one_row_micro_batch_is_refused():
    x, y = _data(4)
    with pytest.raises(EngineError, match="buffer seen .*one row more"):
        _step(Writes(_samples_seen), x, y, micro=1)


def test_a_write_that_cannot_be_replayed_at_one_row_is_refused_as_unchecked():
    def fussy(m, x):
        if not bool(x.abs().sum() > 0):
            raise ValueError("an empty row")
        m.stat.mul_(0.9).add_(0.1 * x.mean(0))
    x, y = _data(4)
    with pytest.raises(EngineError, match="cannot check that what it writes does not depend on the data") as err:
        _step(Writes(fussy), x, y, micro=1)
    assert "buffer stat" in err.value.message and "ValueError: an empty row" in err.value.message


class OnlineNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 3)
        self.register_buffer("mu", torch.zeros(D))

    def forward(self, x):
        out = self.lin(torch.tanh(x - self.mu))
        if self.training:
            with torch.no_grad():
                self.mu.mul_(0.9).add_(0.1 * x.mean(0))
        return out


def test_make_private_with_micro_batches_of_one_row_refuses_a_running_mean():
    torch.manual_seed(0)
    x, y = torch.randn(64, D) * 3 + 2, torch.randint(0, 3, (64,))
    model = OnlineNorm()
    # 32 of 64 rows expected: an empty first draw (mu.mean of no rows: NaN, which no row moves after) has
    # probability 2**-64 (at 8 of 64 it was 0.875**64 = 1.9e-4)
    model, opt, crit, loader = dpclip.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(TensorDataset(x, y), batch_size=32),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, delta=1e-5, steps=2, max_grad_norm=1.0,
        max_physical_batch_size=1)
    with pytest.raises(DpclipError, match="buffer mu"):
        for xb, yb in loader:
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()


class SpectralWithCounter(nn.Module):
    """Writes that do not depend on the batch: spectral_norm's power iteration in training mode
    (from the weight alone) and a step counter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(D, D))
        self.head = nn.Linear(D, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.head(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("micro, mode", [(None, "alone"), (1, "batch")])
def test_spectral_norm_and_a_step_counter_still_train_and_advance_once_per_forward(micro, mode):
    x, y = _data(4)
    model = SpectralWithCounter()
    plain = SpectralWithCounter()
    record = _step(model, x, y, micro)
    forwards = 1 if micro is None else 4
    for _ in range(forwards):
        plain(x[:1])
    assert record.mode == mode
    assert int(model.steps) == forwards
    u = "lin.parametrizations.weight.0._u"
    assert torch.equal(model.state_dict()[u], plain.state_dict()[u])


class BankFromTheSecondForward(nn.Module):
    """A nearest-neighbour bank of earlier batches' activations, written only once a step counter
    (a write that does not depend on the batch, which the check passes) reaches 2: the checked
    first forward writes no bank, an unchecked later one does, and the next reads it."""

    def __init__(self, persistent: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.head = nn.Linear(D, 4), nn.Linear(4, 3)
        self.register_buffer("bank", torch.zeros(4, 4), persistent=persistent)
        self.register_buffer("t", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        out = self.head(h + self.bank[torch.cdist(h.detach(), self.bank).argmin(1)])
        self.t += 1
        if int(self.t) >= 2:
            self.bank[:] = h.detach()[:4]
        return out


@pytest.mark.parametrize("persistent", [True, False])
def test_a_buffer_first_written_by_a_forward_the_certificate_does_not_check_is_refused(persistent):
    model = BankFromTheSecondForward(persistent)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=8, seed=0)
    x, y = _data()
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))   # checked: writes the counter only
    engine.privatize()
    x2, y2 = _data(seed=2)
    with pytest.raises(EngineError, match="bank, which no forward the certificate checked wrote") as refused:
        engine.backward(F.cross_entropy(model(x2), y2, reduction="none"))   # same family: not checked
    assert refused.value.hint


def test_an_unchecked_forward_may_write_what_the_checked_forward_wrote():
    model = Writes(lambda m, x: m.seen.add_(1))   # a counter: the same in every sample's replay
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=8, seed=0)
    for seed in (1, 2, 3):
        x, y = _data(seed=seed)
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        engine.privatize()
    assert engine.certificate.checks == 1 and int(model.seen) == 3
