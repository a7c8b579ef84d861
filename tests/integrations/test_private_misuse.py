"""make_private under loops that misuse it: refused with a hint before anything is released,
where torch's own error (or a misleading one) came before (docs/python-api.md, "What the loop
must do")."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError


def _private():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    return dpclip.make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=16),
                               steps=3, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


def test_a_backward_of_a_loss_from_a_forward_without_gradients_is_refused_with_a_hint():
    private = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with torch.no_grad():
        outputs = model(x)
    loss = criterion(outputs, y)
    with pytest.raises(DpclipError, match="without gradients") as refused:
        loss.backward()
    assert "gradients on" in refused.value.hint
    assert private.ledger.steps == 0


def test_batches_of_a_loader_rebuilt_from_make_private_s_as_accelerate_s_prepare_does_are_refused_naming_it():
    """accelerate's Accelerator.prepare(loader) builds another DataLoader on the returned loader's
    batch sampler: its batches never pass the loop's checks, so a loss over one is refused, the
    message naming that loader (it said "a batch of your own loader"); the returned loader still trains."""
    private = _private()
    model, optimizer, criterion, loader = private
    rebuilt = DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn)
    x, y = next(iter(rebuilt))
    with pytest.raises(DpclipError, match="drawn by another DataLoader built from it") as refused:
        criterion(model(x), y)
    assert "accelerate's prepare()" in refused.value.hint
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    optimizer.step()
    assert private.ledger.steps == 1


def test_a_loop_going_on_after_the_engine_was_detached_is_refused_and_leaves_no_raw_gradient():
    private = _private()
    model, optimizer, criterion, loader = private
    batches = iter(loader)
    x, y = next(batches)
    criterion(model(x), y).backward()
    optimizer.step()
    private.engine.detach()
    optimizer.zero_grad()
    x, y = next(batches)
    loss = criterion(model(x), y)
    with pytest.raises(DpclipError, match="detached") as refused:
        loss.backward()
    assert "make_private" in refused.value.hint
    assert all(p.grad is None for p in model.parameters())
    assert private.ledger.steps == 1


@pytest.mark.parametrize("where", ["first layer", "last layer", "after the last layer"])
def test_a_forward_interrupted_by_a_caught_keyboard_interrupt_stops_the_run_before_unchecked_rows_train(where):
    """torch runs no forward hook after a KeyboardInterrupt (only after an Exception): the loop's
    row check and the engine's record of the forward were left half done, and a mixup forward after
    a caught interrupt (a notebook's) trained unchecked."""
    private = _private()
    model, optimizer, criterion, loader = private
    interrupt = [True]

    def hook(*_):
        if interrupt.pop() if interrupt else False:
            raise KeyboardInterrupt
    if where == "after the last layer":
        model[2].register_forward_hook(hook)
    else:
        model[0 if where == "first layer" else 2].register_forward_pre_hook(hook)
    x, y = next(iter(loader))
    with pytest.raises(KeyboardInterrupt):
        model(x)
    with pytest.raises(DpclipError, match="interrupted") as refused:
        criterion(model(0.5 * x + 0.5 * x.flip(0)), y).backward()
    assert "checkpoint" in refused.value.hint
    for retry in (lambda: criterion(model(x), y).backward(), optimizer.step):   # nothing more is released
        with pytest.raises(DpclipError, match="interrupted"):
            retry()
    assert private.ledger.steps == 0 and all(p.grad is None for p in model.parameters())
    with torch.no_grad():   # evaluating the weights released so far still works
        assert model(x).shape == (len(x), 3)


def test_a_forward_that_raises_an_exception_leaves_the_run_going():
    private = _private()
    model, optimizer, criterion, loader = private
    failing = [True]

    def hook(*_):
        if failing.pop() if failing else False:
            raise ValueError("a transient failure")
    model[2].register_forward_pre_hook(hook)
    x, y = next(iter(loader))
    with pytest.raises(ValueError):
        model(x)
    criterion(model(x), y).backward()
    optimizer.step()
    assert private.ledger.steps == 1


def test_a_step_interrupted_before_its_charge_releases_nothing(monkeypatch):
    """A KeyboardInterrupt between the noise and the ledger's record (here: in the record) left the
    noisy gradient in p.grad, uncharged, for the loop's own optimizer; now the step is dropped."""
    private = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    criterion(model(x), y).backward()

    def interrupted(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(private.ledger, "record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    monkeypatch.undo()
    assert private.ledger.steps == 0 and all(p.grad is None for p in model.parameters())
    with pytest.raises(DpclipError, match="optimizer.step"):   # nothing more of the run is released
        next(iter(loader))


@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev"])
def test_a_torch_func_transform_around_the_private_model_is_refused_with_a_hint_to_detach_first(transform):
    private = _private()
    model = private.model
    x = torch.randn(4, 5)
    run = {"grad": lambda: torch.func.grad(lambda t: model(t).sum())(x),
           "vmap": lambda: torch.func.vmap(lambda row: model(row[None]))(x),
           "jacrev": lambda: torch.func.jacrev(lambda t: model(t))(x)}[transform]
    with pytest.raises(DpclipError, match="the model is called inside torch") as refused:
        run()
    assert "engine.detach()" in refused.value.hint
    private.engine.detach()
    assert run().shape[0] == 4   # detached, the model transforms as any other
    assert private.ledger.steps == 0


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_torch_func_transform_around_the_private_model_on_a_drawn_batch_is_refused_by_name(transform):
    """Within a draw the loop's rows check reads the model's input first: inside a transform that
    input is a functorch wrapper without storage (was torch's RuntimeError, a traceback)."""
    private = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    run = {"grad": lambda: torch.func.grad(lambda t: model(t).sum())(x),
           "vmap": lambda: torch.func.vmap(lambda row: model(row[None]))(x)}[transform]
    with pytest.raises(DpclipError, match="the model is called inside torch") as refused:
        run()
    assert "engine.detach()" in refused.value.hint
    assert private.ledger.steps == 0


TOP_FRACTION = {"threshold": {"kind": "discriminative", "small": 0.5, "large": 2.0, "tail_rule": "top_fraction",
                              "top_fraction": 0.25}}


def test_top_fraction_with_physical_parts_is_refused_before_any_step():
    """The top-fraction rule ranks a whole draw in one backward: with max_physical_batch_size it
    failed at the first draw larger than a part, after the steps before it were charged."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model = nn.Linear(5, 3)
    with pytest.raises(DpclipError, match="max_physical_batch_size") as refused:
        dpclip.make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=16), steps=3,
                            noise_multiplier=1.0, clipping=TOP_FRACTION, delta=1e-5, max_physical_batch_size=8)
    assert "max_physical_batch_size=None" in refused.value.hint


@pytest.mark.parametrize("arguments", [{"noise_multiplier": True}, {"target_epsilon": True},
                                       {"noise_multiplier": 1.0, "delta": True},
                                       {"noise_multiplier": 1.0, "max_grad_norm": True}])
def test_a_bool_for_sigma_epsilon_delta_or_the_threshold_is_refused_with_a_hint_not_read_as_one(arguments):
    model = torch.nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,))), batch_size=8)
    with pytest.raises(DpclipError) as info:
        dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                            criterion=torch.nn.CrossEntropyLoss(), epochs=1,
                            **{"delta": 1e-5, "max_grad_norm": 1.0, **arguments})
    assert "got True" in str(info.value) and info.value.hint
