"""A private loss's value read by the loop (``loss.item()``, ``float(loss)``, an f-string, a
comparison, ``torch.isnan(loss)``, ``train_step``'s return; ``loss.per_sample``, each sample's) is
computed without noise: it leaves the engine uncharged, so the statement and privacy.json name it
"not covered by ε" once the loop has read one (docs/python-api.md), also after a checkpoint's
reload; a loop that reads none is not told so. Pickling a loss (torch.save) is refused.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.accounting import Ledger
from dpclip.errors import DpclipError
from dpclip.integrations.setup import READ_LOSS


def _private(**kwargs):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model = nn.Linear(5, 3)
    return dpclip.make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=16),
                               steps=3, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, **kwargs)


def _first_loss(private):
    """The private loss of the loader's first draw."""
    model, _, criterion, loader = private
    x, y = next(iter(loader))
    return criterion(model(x), y)


def _run(private, read) -> None:
    model, optimizer, criterion, loader = private
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        read(loss)


def _stated(private) -> bool:
    return any(READ_LOSS in line for line in private.statement())


def _named(private, tmp_path) -> tuple[bool, bool]:
    privacy = json.loads((private.save(tmp_path) / "privacy.json").read_text())
    return _stated(private), READ_LOSS in privacy["not_covered_by_epsilon"]


@pytest.mark.parametrize("read", [lambda loss: loss.item(), lambda loss: float(loss), lambda loss: f"{loss:.3f}",
                                  lambda loss: loss < 1.0, lambda loss: torch.isnan(loss), lambda loss: loss.detach(),
                                  lambda loss: loss.per_sample.tolist(), lambda loss: (loss / 2).per_sample,
                                  lambda loss: torch.stack([loss])],
                         ids=["item", "float", "format", "compare", "isnan", "detach", "per_sample",
                              "scaled-per_sample", "stack"])
def test_a_loss_the_loop_reads_is_named_not_covered_in_the_statement_and_privacy_json(read, tmp_path):
    private = _private()
    _run(private, read)
    assert _named(private, tmp_path) == (True, True)


def test_a_loop_that_reads_no_loss_is_not_told_it_did(tmp_path):
    private = _private()
    _run(private, lambda loss: None)
    assert _named(private, tmp_path) == (False, False)


def test_train_steps_returned_loss_is_named(tmp_path):
    private = _private()
    for x, y in private.data_loader:
        private.train_step(x, y)
    assert _named(private, tmp_path) == (True, True)


def test_a_reloaded_checkpoint_keeps_the_earlier_steps_read_losses_in_its_statement(tmp_path):
    first = _private()
    model, optimizer, criterion, loader = first
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    loss.item()
    checkpoint = first.save_checkpoint(tmp_path / "ckpt" / "state.pt")
    second = _private()
    second.load_checkpoint(checkpoint)
    assert _stated(second)


@pytest.mark.parametrize("carry", [lambda loss: torch.save(loss, io.BytesIO()), copy.deepcopy],
                         ids=["torch.save", "deepcopy"])
def test_a_private_loss_saved_or_deep_copied_is_refused_with_what_to_save(carry, tmp_path):
    # a pickle carries the per-sample losses out of the loop without reading them through the loss
    private = _private()
    loss = _first_loss(private)
    with pytest.raises(DpclipError, match="private loss pickled") as refused:
        carry(loss)
    assert "loss.item()" in refused.value.hint
    assert _named(private, tmp_path) == (False, False)


@pytest.mark.parametrize("clear", [lambda private, loss: setattr(private.optimizer.tracker, "losses_read", False),
                                   lambda private, loss: setattr(private.criterion.tracker, "losses_read", False)],
                         ids=["optimizer.tracker", "criterion.tracker"])
def test_the_mark_of_a_read_loss_cannot_be_cleared_by_the_loop(clear, tmp_path):
    private = _private()
    _run(private, lambda loss: loss.item())
    model, optimizer, criterion, loader = private
    with pytest.raises(DpclipError, match="mark that the loop read") as refused:
        clear(private, None)
    assert refused.value.hint
    assert _named(private, tmp_path) == (True, True)


@pytest.mark.parametrize("name", ["tracker", "engine", "_tracker", "_losses"])
def test_a_private_loss_is_read_only_so_its_checks_cannot_be_swapped(name, tmp_path):
    # a loss whose tracker is None would backward its batch a second time, unchecked
    private = _private()
    _, optimizer, criterion, _ = private
    loss = _first_loss(private)
    with pytest.raises(DpclipError, match="read-only") as refused:
        setattr(loss, name, None)
    assert refused.value.hint
    with pytest.raises(AttributeError):
        optimizer.tracker = None
    with pytest.raises(AttributeError):
        criterion.tracker = None
    assert _named(private, tmp_path) == (False, False)


@pytest.mark.parametrize("compare, expected", [(lambda loss, v: loss == v, True), (lambda loss, v: v == loss, True),
                                               (lambda loss, v: loss != v, False),
                                               (lambda loss, v: loss == torch.tensor(v), True),
                                               (lambda loss, v: loss == v + 1, False)],
                         ids=["==", "reflected ==", "!=", "== tensor", "== another"])
def test_a_loss_compared_for_equality_compares_its_value_and_is_named(compare, expected, tmp_path):
    # by identity, loss == its own value was False: a wrong answer, and a read left unnamed
    private = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    outputs = model(x)
    value = float(nn.CrossEntropyLoss(reduction="none")(outputs, y).detach().mean())
    loss = criterion(outputs, y)
    assert compare(loss, value) is expected
    assert _named(private, tmp_path) == (True, True)


def test_a_privacy_json_saved_before_the_first_read_gains_its_line_and_keeps_its_epsilon(tmp_path):
    private = _private()
    saved, losses = {}, []

    def after_step(loss):   # the loop saves after its first step and reads no loss
        losses.append(loss)
        if private.ledger.steps == 1:
            saved.update(json.loads((private.save(tmp_path / "early") / "privacy.json").read_text()))
    _run(private, after_step)
    assert READ_LOSS not in saved["not_covered_by_epsilon"]
    losses[-1].item()
    restated = json.loads((tmp_path / "early" / "privacy.json").read_text())
    assert READ_LOSS in restated["not_covered_by_epsilon"]
    assert f"not covered by ε: {READ_LOSS}" in restated["statement"]
    assert (restated["epsilon"], restated["steps"]) == (saved["epsilon"], 1)
    assert Ledger.from_dict(json.loads((tmp_path / "early" / "ledger.json").read_text())).steps == 1


def test_what_the_loop_computes_from_the_models_outputs_is_named_not_covered(tmp_path):
    """A loop that logs its training accuracy (Opacus's examples do) reads the model's outputs on a
    private batch without noise, which dpclip cannot see: the statement says so from the start."""
    from dpclip.integrations.setup import LOOP_OUTPUTS

    private = _private()
    model, optimizer, criterion, loader = private
    for x, y in loader:
        optimizer.zero_grad()
        out = model(x)
        criterion(out, y).backward()
        optimizer.step()
        print(f"training accuracy {(out.argmax(1) == y).float().mean().item():.2f}")
    privacy = json.loads((private.save(tmp_path) / "privacy.json").read_text())
    assert LOOP_OUTPUTS in privacy["not_covered_by_epsilon"]
    assert any(LOOP_OUTPUTS in line for line in private.statement())
