"""make_private's loop as the attacker: rows built from several examples, a caught refusal, a
parameter added after the engine was built. The noise is calibrated to one example moving one
clipped row of one noisy step; each loop here would break that without the ledger knowing, and
is refused before anything is released or charged (docs/python-api.md, "What the loop must do")."""

from __future__ import annotations

from collections import UserDict, namedtuple

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError, EngineError
from dpclip.integrations.collate import EmptyDrawCollate
from tests.privacy.conftest import counted_releases

N = 200


def _data(weights: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)
    return TensorDataset(x, y, torch.rand(N, generator=g)) if weights else TensorDataset(x, y)


def _private(model=None, optimizer=None, criterion=None, weights=False):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, optimizer, DataLoader(_data(weights), batch_size=40),
                                      criterion=criterion or nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0,
                                      steps=20, max_grad_norm=1.0, unsafe_seed=3)
    return private, counted_releases(private)


def _nothing_released(private, released) -> None:
    assert released == [] and private.ledger.steps == 0


ROWS = {
    "mixup": lambda x: 0.5 * x + 0.5 * x.flip(0),
    "normalised over the batch": lambda x: (x - x.mean(0)) / x.std(0),
    "one example repeated": lambda x: x[:1].repeat(x.shape[0], 1),
    "one example broadcast": lambda x: x[:1].expand(x.shape[0], -1),
    "reordered": lambda x: x.flip(0),
    "other rows of the same count": lambda x: _data().tensors[0][:x.shape[0]],
}


@pytest.mark.parametrize("build", ROWS.values(), ids=list(ROWS))
def test_model_inputs_built_from_other_examples_are_refused_before_the_model_runs(build):
    private, released = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(DpclipError, match="not the rows the data loader drew") as caught:
        criterion(model(build(x)), y).backward()
    assert "one sample at a time" in caught.value.hint
    _nothing_released(private, released)


def test_an_evaluation_with_gradients_on_while_a_batch_is_drawn_is_refused_with_a_no_grad_hint():
    """A validation forward between draw and step, in eval mode but with gradients on, feeds the
    model other rows: refused as training would be, the message saying why and the hint how."""
    private, released = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    held_out = torch.randn(8, 5, generator=torch.Generator().manual_seed(9))
    model.eval()
    with pytest.raises(DpclipError, match="in eval mode, but with gradients on") as caught:
        model(held_out)
    assert caught.value.hint.startswith("to evaluate other data between steps, run the model under "
                                        "`with torch.no_grad():`")
    with torch.no_grad():
        model(held_out)
    model.train()
    criterion(model(x), y).backward()
    optimizer.step()
    assert len(released) == private.ledger.steps == 1


@pytest.mark.parametrize("build", [lambda y: y.flip(0), lambda y: y.roll(1), lambda y: y[:1].repeat(y.shape[0])],
                         ids=["reordered", "shifted", "repeated"])
def test_targets_from_other_examples_are_refused(build):
    private, released = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(DpclipError, match="criterion's target is not the rows"):
        criterion(model(x), build(y))
    _nothing_released(private, released)


def test_a_second_pass_of_the_same_rows_after_their_backward_is_refused():
    private, released = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    with pytest.raises(DpclipError, match="not the rows the data loader drew"):
        model(x)
    _nothing_released(private, released)


@pytest.mark.parametrize("weight", [
    lambda loss, y: (loss.per_sample / loss.per_sample.mean()).detach(),        # normalised over the batch
    lambda loss, y: (1.0 / torch.bincount(y, minlength=3).float())[y],         # class counts of the draw
    lambda loss, y: torch.tensor(1.0 / y.shape[0]),                             # 1 / the realised batch size
], ids=["normalised", "class-counts", "realised-size"])
def test_loss_weights_computed_from_the_batch_are_refused(weight):
    private, released = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    with pytest.raises(DpclipError, match="private loss") as caught:
        loss * weight(loss, y)
    assert "column of the dataset" in caught.value.hint
    _nothing_released(private, released)


def test_a_weight_column_of_the_dataset_and_a_number_are_taken():
    private, released = _private(weights=True)
    model, optimizer, criterion, loader = private
    for x, y, w in loader:
        (criterion(model(x), y) * w / 2).backward()
        optimizer.step()
        break
    assert released == [1] and private.ledger.steps == 1


def test_the_drawn_rows_moved_reshaped_or_cast_still_train():
    """What a loop does to rows without mixing them: a dtype, a view per row, a validation forward."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    private, released = _private(model=model)
    model, optimizer, criterion, loader = private
    held_out = torch.randn(7, 5, dtype=torch.float64)
    for k, (x, y) in enumerate(loader):
        with torch.no_grad():
            model(held_out)                                  # evaluation: not a step's rows
        criterion(model(x.double().view(x.shape[0], 5, 1)), y.clone()).backward()
        optimizer.step()
        if k == 2:
            break
    assert released == [1, 1, 1] and private.ledger.steps == 3


class WithPositions(nn.Module):
    """Takes a second input shared by all samples, as transformers take position ids."""

    def __init__(self):
        super().__init__()
        self.position = nn.Embedding(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x, positions):
        return self.head(x + self.position(positions).mean(1))


def test_a_shared_tensor_expanded_over_the_batch_is_not_taken_for_an_example():
    """``positions.expand(B, T)``: one row for every sample, none of them a drawn example's."""
    private, released = _private(model=WithPositions())
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    criterion(model(x, torch.arange(5).expand(x.shape[0], 5)), y).backward()
    optimizer.step()
    assert released == [1] and private.ledger.steps == 1


class Shifted(nn.Module):
    """Takes a second input shared by all samples: a shift subtracted from each."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x, shift):
        return self.net(x - shift)


SHARED_STATISTICS = {
    "mean, keepdim": lambda x: x.mean(0, keepdim=True),
    "mean": lambda x: x.mean(0),
    "std": lambda x: x.std(0),
    "biased var": lambda x: x.var(0, correction=0),
    "max": lambda x: x.amax(0),
    "sum in float64": lambda x: x.double().sum(0),
    "mean, expanded": lambda x: x.mean(0, keepdim=True).expand(x.shape[0], -1),
}


@pytest.mark.parametrize("shift", SHARED_STATISTICS.values(), ids=list(SHARED_STATISTICS))
def test_a_shared_input_computed_from_the_batch_is_refused(shift):
    """The second input has no batch axis, so no row of it is an example's; each sample's gradient
    still moves with every example through it, which the certificate (replaying with the input
    fixed) cannot see."""
    private, released = _private(model=Shifted())
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(DpclipError, match="statistic of the drawn batch") as caught:
        model(x, shift(x))
    assert "public data" in caught.value.hint
    _nothing_released(private, released)


@pytest.mark.parametrize("shift", [torch.zeros(5), torch.ones(1, 5), torch.randn(5), torch.linspace(-1, 1, 5)],
                         ids=["zeros", "ones", "random", "fixed"])
def test_a_shared_input_not_computed_from_the_batch_trains(shift):
    private, released = _private(model=Shifted())
    model, optimizer, criterion, loader = private
    for k, (x, y) in enumerate(loader):
        criterion(model(x, shift), y).backward()
        optimizer.step()
        if k == 1:
            break
    assert released == [1, 1] and private.ledger.steps == 2


def test_rows_with_missing_values_are_the_drawn_rows_still():
    """NaN is not equal to itself; a feature missing in the data (imputed in the model) is still the row's own."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    private, released = _private(model=model)
    model, optimizer, criterion, loader = private
    private.data_loader.dataset.tensors[0][::2, 0] = float("nan")   # missing in every second example
    x, y = next(iter(loader))
    assert x.isnan().any()
    model(x.double())                           # cast: compared as is
    model(x.double().view(x.shape[0], 5, 1))    # reshaped: compared row by row, sorted


class BatchCentredLoss(nn.Module):
    """Each sample's loss minus the batch's mean: the losses mix samples (the certificate refuses)."""

    reduction = "none"

    def forward(self, out, y):
        losses = F.cross_entropy(out, y, reduction=self.reduction)
        return losses - losses.mean() + losses.detach().mean()


class BaselineLoss(nn.Module):
    """REINFORCE with a batch-mean baseline, detached: -(r_i - mean_j r_j) · log p_i. The graph sees the
    baseline as a constant; one example still moves every sample's weight."""

    def forward(self, out, y):
        logp = -F.cross_entropy(out, y, reduction="none")
        reward = logp.detach().exp()
        return -(reward - reward.mean()) * logp


@pytest.mark.parametrize("call", ["loop", "train_step"])
def test_a_loss_weighted_by_a_detached_batch_statistic_is_refused_at_the_criterion(call):
    private, released = _private(criterion=BaselineLoss())
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(DpclipError, match="another loss alone than in its batch") as caught:
        criterion(model(x), y).backward() if call == "loop" else private.train_step(x, y)
    assert "not covered by ε" in str(caught.value) and "own outputs and targets" in caught.value.hint
    _nothing_released(private, released)


def test_class_weights_and_label_smoothing_are_each_sample_s_own_loss():
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]), label_smoothing=0.1)
    private, released = _private(criterion=criterion)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    optimizer.step()
    assert released == [1] and private.ledger.steps == 1


def test_a_caught_engine_refusal_releases_nothing_after_it():
    private, released = _private(criterion=BatchCentredLoss())
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(EngineError, match="depends on other samples"):
        criterion(model(x), y).backward()
    for later in (optimizer.step, lambda: next(iter(loader))):
        with pytest.raises(DpclipError, match="failed inside the engine") as caught:
            later()   # a loop that logs the refusal and goes on
        assert "start again" in caught.value.hint
    _nothing_released(private, released)


def test_a_layer_unfrozen_after_make_private_is_refused_before_its_raw_gradient_is_stepped():
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    private, released = _private(model=model)
    model, optimizer, criterion, loader = private
    model[0].requires_grad_(True)                               # gradual unfreezing
    with pytest.raises(DpclipError, match="does not privatise"):
        optimizer.add_param_group({"params": model[0].parameters()})
    optimizer.param_groups.append({**optimizer.param_groups[0], "params": list(model[0].parameters())})
    x, y = next(iter(loader))
    with pytest.raises(EngineError, match="trainable now that were not") as caught:
        criterion(model(x), y).backward()                       # the engine's own check
    assert "before building the engine" in caught.value.hint
    _nothing_released(private, released)
    before = model[0].weight.detach().clone()
    with pytest.raises(DpclipError):
        optimizer.step()
    assert torch.equal(model[0].weight, before)


def test_a_layer_frozen_after_make_private_is_refused_before_noise_alone_moves_it():
    """Frozen after a step, the layer was still privatised: each step added noise alone to it."""
    private, released = _private()
    model, optimizer, criterion, loader = private
    batches = iter(loader)
    x, y = next(batches)
    criterion(model(x), y).backward()
    optimizer.step()
    model[0].requires_grad_(False)                              # "train the head only from now on"
    frozen = model[0].weight.detach().clone()
    optimizer.zero_grad()
    x, y = next(batches)
    with pytest.raises(EngineError, match="frozen .requires_grad=False. since the engine was built") as caught:
        criterion(model(x), y).backward()
    assert "freeze layers before building the engine" in caught.value.hint
    with pytest.raises(DpclipError):
        optimizer.step()
    assert torch.equal(model[0].weight, frozen) and released == [1] and private.ledger.steps == 1


def test_a_parameter_group_added_outside_the_engine_is_refused_at_the_step():
    private, released = _private()
    model, optimizer, criterion, loader = private
    extra = nn.Parameter(torch.zeros(3))
    optimizer.param_groups.append({**optimizer.param_groups[0], "params": [extra]})
    x, y = next(iter(loader))
    (criterion(model(x), y) * 1.0).backward()
    extra.grad = torch.ones(3)                                  # a raw gradient, by any route
    with pytest.raises(DpclipError, match="does not privatise"):
        optimizer.step()
    _nothing_released(private, released)
    assert torch.equal(extra, torch.zeros(3))
    # The refused step left its draw open: a loop that drops the group and draws on is refused (the
    # next step would release both draws' sums for one charge); the retried step releases this draw.
    optimizer.param_groups.pop()
    with pytest.raises(DpclipError, match="before optimizer.step"):
        next(iter(loader))
    optimizer.step()
    assert released == [1] and private.ledger.steps == 1


def test_a_step_the_engine_refuses_releases_nothing_then_or_later(monkeypatch):
    """The engine refuses a release (here: a noise std that is not finite, as a threshold grown
    without bound gives; a too large one is refused when the engine is made) after the draw was
    closed: nothing of it is charged, p.grad is dropped, and no later step goes on from it."""
    from dpclip.engine.privatizer import Privatizer

    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, optimizer, DataLoader(_data(), batch_size=40),
                                      criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=20,
                                      max_grad_norm=[1.0] * 4, clipping="per_layer", unsafe_seed=3)
    monkeypatch.setattr(Privatizer, "noise_stds", lambda self, thresholds: torch.full_like(thresholds, math.inf))
    released = counted_releases(private)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    with pytest.raises(EngineError, match="not finite"):
        optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    for later in (lambda: next(iter(loader)), optimizer.step, lambda: model(x)):
        with pytest.raises(DpclipError, match="optimizer.step.. of this run failed inside the engine"):
            later()
    assert released == [1] and private.ledger.steps == 0   # the one refused call


def _private_collated(collate_fn):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, optimizer, DataLoader(_data(), batch_size=40, collate_fn=collate_fn),
                                      criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=20,
                                      max_grad_norm=1.0, unsafe_seed=3)
    return private, counted_releases(private)


def _stacked(rows):
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


COLLATES = {
    "mixup": lambda rows: (lambda x, y: (0.5 * x + 0.5 * x.flip(0), y))(*_stacked(rows)),
    "normalised over the batch": lambda rows: (lambda x, y: ((x - x.mean(0)) / (x.std(0) + 1e-6), y))(*_stacked(rows)),
    "random mixup": lambda rows: (lambda x, y: (0.5 * x + 0.5 * x[torch.randperm(len(x))], y))(*_stacked(rows)),
    # a repeated example leaves these two unchanged: the next row of the last is the repeat, no minimum moves
    "mixup with the next example": lambda rows: (lambda x, y: (0.5 * x + 0.5 * x.roll(-1, 0), y))(*_stacked(rows)),
    "min-max scaled over the batch": lambda rows: (lambda x, y: ((x - x.min(0).values) /
                                                                 (x.max(0).values - x.min(0).values), y))(
        *_stacked(rows)),
}


@pytest.mark.parametrize("collate", COLLATES.values(), ids=list(COLLATES))
def test_a_collate_fn_that_mixes_the_draw_s_examples_is_refused_before_the_loop_sees_the_batch(collate):
    """A collate_fn sees the whole draw: rows mixed there reached the loop as if drawn (the row
    check compares the loop's rows with the collated batch)."""
    private, released = _private_collated(collate)
    with pytest.raises(DpclipError, match="collate_fn's rows depend on the other examples") as caught:
        next(iter(private.data_loader))
    assert "each example alone" in caught.value.hint
    _nothing_released(private, released)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_collate_fn_that_pads_to_the_longest_passes_with_the_longest_example_first_or_last(side):
    """Replacing an example changes the padded size when it was the longest: only padding may move."""
    def padded(rows):
        longest = max(len(x) for x, _ in rows)
        pad = [(0, longest - len(x)) if side == "right" else (longest - len(x), 0) for x, _ in rows]
        return torch.stack([F.pad(x, p, value=-1.0) for (x, _), p in zip(rows, pad)]), torch.stack([y for _, y in rows])
    data = [(torch.arange(1.0, 1 + n), torch.tensor(n % 3)) for n in (2, 3, 5, 2)]
    collate = EmptyDrawCollate(data, padded)
    for draw in ([0, 1, 2], [2, 1, 0], [2], [1, 3]):
        rows = [data[i] for i in draw]
        assert torch.equal(collate(rows)[0], padded(rows)[0])
    with pytest.raises(DpclipError, match="rows depend on the other examples"):
        EmptyDrawCollate(data, lambda rows: (lambda x, y: (x - x[:1], y))(*padded(rows)))([data[0], data[1]])


def test_a_collate_fn_that_treats_each_example_alone_trains_random_draws_included():
    def stack_with_noise(rows):   # a per-example random augmentation, drawn in the rows' order
        x, y = _stacked(rows)
        return x + 0.01 * torch.randn_like(x), y
    private, released = _private_collated(stack_with_noise)
    model, optimizer, criterion, loader = private
    for k, (x, y) in enumerate(loader):
        criterion(model(x), y).backward()
        optimizer.step()
        if k == 1:
            break
    assert released == [1, 1] and private.ledger.steps == 2


class _Encoding(UserDict):
    """A mapping torch's pytree keeps whole, as Hugging Face's BatchEncoding (what its collators return)."""


@pytest.mark.parametrize("name", ["mixup with the next example", "normalised over the batch"])
def test_a_mixing_collate_fn_returning_a_batch_encoding_is_refused_like_a_dict(name):
    """Its tensors went unseen, so every check passed whatever the collator did (DPTrainer with a
    Hugging Face collator trained a neighbour mix at the printed ε)."""
    mixed = COLLATES[name]
    data = [(torch.randn(3), torch.tensor(i % 2)) for i in range(6)]
    collate = EmptyDrawCollate(data, lambda rows: _Encoding(zip(("x", "y"), mixed(rows))))
    with pytest.raises(DpclipError, match="rows depend on the other examples"):
        collate(data)
    honest = EmptyDrawCollate(data, lambda rows: _Encoding(zip(("x", "y"), _stacked(rows))))
    assert torch.equal(honest(data)["x"], _stacked(data)[0])


def test_a_random_draw_over_the_padded_batch_passes_when_the_longest_example_is_replaced():
    """Masked-LM masking draws over the padded (rows, longest) shape: replacing the longest example
    moves the padding and every row's mask. Each row's mask is still its own draw; the check
    repeats with a replacement that keeps the shape."""
    def masked(rows):
        longest = max(len(x) for x, _ in rows)
        x = torch.stack([F.pad(x, (0, longest - len(x)), value=0.0) for x, _ in rows])
        mask = torch.rand(x.shape) < 0.3                     # one draw over the whole padded batch
        return _Encoding(x=torch.where(mask, torch.full_like(x, -9.0), x), y=torch.stack([y for _, y in rows]))
    data = [(torch.arange(1.0, 1 + n), torch.tensor(n % 2)) for n in (3, 4, 2, 5, 9, 7, 6, 8)]
    collate = EmptyDrawCollate(data, masked)
    for _ in range(5):
        collate(list(data))                                 # the longest (9) is in the first half
        collate(list(reversed(data)))                       # ... and in the second
    with pytest.raises(DpclipError, match="rows depend on the other examples"):
        EmptyDrawCollate(data, lambda rows: (lambda b: _Encoding(x=b["x"].roll(-1, 0), y=b["y"]))(masked(rows)))(data)


def _pairs_mixed(x):
    """Row i averaged with row i ^ 1 (0 with 1, 2 with 3, ...): both in one half of an even draw."""
    partner = torch.arange(len(x)) ^ 1
    partner[partner >= len(x)] = len(x) - 1
    return 0.5 * x + 0.5 * x[partner]


WITHIN_A_HALF = {
    "pairs mixed": _pairs_mixed,
    "first two rows swapped": lambda x: x[[1, 0, *range(2, len(x))]],
    "mixup with the next row of the same half": lambda x: torch.cat(
        [0.5 * h + 0.5 * h.roll(-1, 0) for h in x.split((len(x) + 1) // 2)]),
    "second row centred on the first": lambda x: torch.cat([x[:1], x[1:2] - x[:1], x[2:]]),
}


@pytest.mark.parametrize("mix", WITHIN_A_HALF.values(), ids=list(WITHIN_A_HALF))
def test_a_collate_fn_that_mixes_examples_within_one_half_of_the_draw_is_refused(mix):
    """Replacing the other half leaves such a mix unchanged; every pair of rows is split by a check."""
    data = [(torch.randn(3, generator=torch.Generator().manual_seed(i)), torch.tensor(i % 2)) for i in range(11)]
    collate = EmptyDrawCollate(data, lambda rows: (lambda x, y: (mix(x), y))(*_stacked(rows)))
    for n in (2, 4, 8, 11):   # at 2, a mix within halves of one row is a mix at 3 rows: refused by the count
        with pytest.raises(DpclipError, match="rows depend on the") as caught:
            collate(data[:n])
        assert "each example alone" in caught.value.hint


COUNTED = {
    "divided by the count": lambda x: x / len(x),
    "divided by the count, noise added": lambda x: x / len(x) + 0.01 * torch.randn_like(x),
    "the count as a column": lambda x: torch.cat([x, torch.full((len(x), 1), float(len(x)))], 1),
}


@pytest.mark.parametrize("use", COUNTED.values(), ids=list(COUNTED))
def test_a_collate_fn_that_uses_the_drawn_count_is_refused_before_anything_is_released(use):
    """The count of a Poisson draw is private: ``x / len(rows)`` passed with both halves replaced
    (the same count), and one example would move every row of the step."""
    private, released = _private_collated(lambda rows: (lambda x, y: (use(x), y))(*_stacked(rows)))
    with pytest.raises(DpclipError, match="collate_fn's rows depend on the") as caught:
        next(iter(private.data_loader))
    assert "each example alone" in caught.value.hint
    _nothing_released(private, released)
    with pytest.raises(DpclipError, match="rows depend on the number of examples drawn"):   # one row
        EmptyDrawCollate(_data(), lambda rows: (lambda x, y: (use(x), y))(*_stacked(rows)))([_data()[0]])


def _drawn_over_the_batch(rows):
    """Per-row augmentation drawn over the whole batch, three draws: a count moves what each draws."""
    x, y = _stacked(rows)
    keep = torch.bernoulli(torch.full(x.shape, 0.9))
    return keep * x + 0.01 * torch.randn_like(x) + torch.rand(len(x), 1), y


def test_a_collate_fn_drawing_over_the_whole_batch_passes_at_every_count():
    data = [(torch.randn(7, generator=torch.Generator().manual_seed(i)), torch.tensor(i % 2)) for i in range(70)]
    collate = EmptyDrawCollate(data, _drawn_over_the_batch)
    for n in (1, 2, 3, 5, 16, 37, 70):
        torch.manual_seed(n)
        x = collate(data[:n])[0]
        torch.manual_seed(n)
        assert torch.equal(x, _drawn_over_the_batch(data[:n])[0])   # the draw's own, random state included


Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize("form", ["dict", "tuple", "namedtuple"])
def test_a_collate_fn_that_treats_each_example_alone_passes_in_any_container_and_one_row(form):
    def collate_fn(rows):
        x, y = _stacked(rows)
        return {"x": x, "y": y} if form == "dict" else (x, y) if form == "tuple" else Pair(x, y)
    data = [(torch.randn(4), torch.tensor(i % 3)) for i in range(9)]
    collate = EmptyDrawCollate(data, collate_fn)
    for n in (1, 2, 9):
        batch = collate(data[:n])
        x = batch["x"] if form == "dict" else batch[0]
        assert torch.equal(x, _stacked(data[:n])[0]) and type(batch) is type(collate_fn(data[:1]))
    empty = collate([])
    assert (empty["x"] if form == "dict" else empty[0]).shape == (0, 4)


def _word_tokenizer():
    """A Hugging Face fast tokenizer built here, nothing downloaded."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, **{w: i + 3 for i, w in enumerate("abcdefgh")}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers, transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]",
                                                              unk_token="[UNK]", mask_token="[MASK]")


@pytest.mark.parametrize("collator", ["DataCollatorWithPadding", "DataCollatorForLanguageModeling"])
def test_hugging_face_padding_and_masking_collators_pass_with_the_longest_anywhere(collator):
    transformers, tokenizer = _word_tokenizer()
    make = getattr(transformers, collator)
    hf = make(tokenizer) if collator == "DataCollatorWithPadding" else make(tokenizer, mlm_probability=0.3)
    data = [dict(tokenizer(" ".join("abcdefgh"[:k]))) for k in (3, 5, 2, 8, 1, 4, 6, 2, 7, 3)]
    collate = EmptyDrawCollate(data, hf)
    for draw in (data, data[::-1], data[:1], data[2:5], data[4:]):
        torch.manual_seed(len(draw))
        batch = collate(draw)
        torch.manual_seed(len(draw))
        assert torch.equal(batch["input_ids"], hf(draw)["input_ids"])
    with pytest.raises(DpclipError, match="rows depend on the"):
        EmptyDrawCollate(data, lambda rows: (lambda b: {**b, "attention_mask": b["attention_mask"] * len(rows)})(
            hf(rows)))(data[:4])


def test_a_collate_fn_drawing_poisson_noise_over_the_batch_is_refused_not_left_hanging():
    """Its count check moves (two draws over the batch), and where every draw is zero the Poisson
    sampler (rate 10 or more) never returns: refused, as its draws cannot be compared."""
    def shot_noise(rows):
        x, y = _stacked(rows)
        return x + torch.poisson(torch.full_like(x, 20.0)) + torch.randn_like(x), y
    data = [(torch.randn(7), torch.tensor(0)) for _ in range(40)]
    with pytest.raises(DpclipError, match="rows depend on the number of examples drawn"):
        EmptyDrawCollate(data, shot_noise)(data)


class NextToken(nn.Module):
    """A causal LM in two layers: logits [b, T, V] for token ids [b, T]."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, ids):
        return self.head(self.embed(ids))


def _next_token_private():
    torch.manual_seed(0)
    model = NextToken()
    ids = torch.randint(0, 11, (N, 7), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(TensorDataset(ids), batch_size=40), criterion=nn.CrossEntropyLoss(),
                                      delta=1e-5, noise_multiplier=1.0, steps=20, max_grad_norm=1.0, unsafe_seed=3)
    return private, counted_releases(private)


def test_a_next_token_shift_of_each_drawn_row_trains():
    """The causal LM loop, inputs ``x[:, :-1]`` and targets ``x[:, 1:]``: each row a window of its own
    drawn row, cut at one place in every row, as a crop ``x[..., 2:30, 2:30]`` is."""
    private, released = _next_token_private()
    model, optimizer, criterion, loader = private
    for k, (x,) in enumerate(loader):
        criterion(model(x[:, :-1]).transpose(1, 2), x[:, 1:]).backward()
        optimizer.step()
        if k == 1:
            break
    assert released == [1, 1] and private.ledger.steps == 2


@pytest.mark.parametrize("where", ["input", "target"])
def test_a_window_of_another_example_s_row_is_refused(where):
    private, released = _next_token_private()
    model, optimizer, criterion, loader = private
    x, = next(iter(loader))
    other = x.roll(1, 0)
    with pytest.raises(DpclipError, match="not the rows the data loader drew"):
        inputs, targets = (other[:, :-1], x[:, 1:]) if where == "input" else (x[:, :-1], other[:, 1:])
        criterion(model(inputs).transpose(1, 2), targets)
    _nothing_released(private, released)
