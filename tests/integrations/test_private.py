"""dpclip.make_private: the Opacus-style API in a plain PyTorch loop (docs/python-api.md)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import dpclip
from dpclip.accounting.statement import OWN_BATCHES_CAVEAT
from dpclip.errors import DpclipError
from tests.integrations.reference import (FEATURES, N, clipped_per_example_sum, noiseless_step_gradient, run_example,
                                          small_data, small_model)

REPO = Path(__file__).resolve().parents[2]
_data, _model = small_data, small_model


def _private(batch_size: int = 12, **kwargs):
    model = _model()
    options = {"criterion": nn.CrossEntropyLoss(), "delta": 1e-5, "noise_multiplier": 1.0, "steps": 4,
               "max_grad_norm": 1.0, **kwargs}
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(_data(), batch_size=batch_size), **options)


def _train(private) -> None:
    model, optimizer, criterion, loader = private
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()


def test_the_ledger_epsilon_equals_dpclip_account_and_dp_accounting_on_the_same_sigma_q_steps(cli, tmp_path):
    private = _private(target_epsilon=3.0, noise_multiplier=None, steps=5)
    _train(private)
    written = private.save(tmp_path / "out")
    ledger = json.loads((written / "ledger.json").read_text())
    privacy = json.loads((written / "privacy.json").read_text())
    sigma, q = private.noise_multiplier, 12 / N
    assert ledger["steps"] == privacy["steps"] == 5
    result = cli("account", "--sigma", repr(sigma), "-q", repr(q), "--steps", 5, "--delta", 1e-5, "--json")
    assert result.code == 0, result.err
    assert ledger["epsilon"] == privacy["epsilon"] == json.loads(result.out)["epsilon"]
    assert privacy["epsilon"] <= 3.0 * 1.01   # calibrated to the target (within calibration's 1%)
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 5)
    assert privacy["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-2)
    assert privacy["statement"][0].startswith("ε = ")


def test_a_step_writes_the_clipped_per_example_sum_over_the_expected_batch_size(monkeypatch):
    """Noise removed, p.grad must be Σ_i min(1, C/‖g_i‖)·g_i / B with B the EXPECTED batch size
    (never the realised one), g_i from autograd on each example alone."""
    private = _private(batch_size=12, max_grad_norm=0.05, unsafe_seed=3)
    x, y = next(iter(private.data_loader))
    assert 0 < len(x) != 12   # a realised size other than B (this seed's first draw)
    expected = clipped_per_example_sum(_model(), x, y, 0.05)
    for got, want in zip(noiseless_step_gradient(private, x, y, monkeypatch), expected):
        torch.testing.assert_close(got, want / 12, rtol=1e-5, atol=1e-7)


def test_a_logical_batch_in_several_backwards_is_the_same_step(monkeypatch):
    """Opacus' BatchMemoryManager, without one: backward on parts of the drawn batch, then one
    step; the clipped sums accumulate (noise removed for the comparison)."""
    grads = []
    for parts in (1, 3):
        private = _private(max_grad_norm=0.05, unsafe_seed=5)
        monkeypatch.setattr(private.engine.noise, "add_gaussians", lambda grads, stds: None)
        model, optimizer, criterion, loader = private
        x, y = next(iter(loader))
        monkeypatch.setattr(private.optimizer.original, "step",
                            lambda: grads.append([p.grad.clone() for p in model.parameters()]))
        optimizer.zero_grad()
        for x_part, y_part in zip(x.tensor_split(parts), y.tensor_split(parts)):
            criterion(model(x_part), y_part).backward()
        optimizer.step()
    for whole, split in zip(*grads):
        torch.testing.assert_close(whole, split, rtol=1e-5, atol=1e-8)


def test_the_loader_draws_poisson_batches_with_empty_draws_as_zero_rows_and_charges_them():
    """q = 1/N: the realised sizes are Binomial(N, 1/N); over 800 steps their mean lies within
    5.5 standard errors of 1, and about (1 − 1/N)^N ≈ 37% of the draws are empty; each is a step.
    The draws come from OS entropy: both bounds fail together with probability 9e-8 (binomial
    tails; at 400 steps and 4 standard errors it was 1.3e-4, and these bands are the narrower)."""
    steps = 800
    private = _private(batch_size=1, steps=steps)
    model, optimizer, criterion, loader = private
    assert len(loader) == N   # a pass is ⌈N/B⌉ steps
    sizes = []
    while private.ledger.steps < steps:
        for x, y in loader:
            sizes.append(len(x))
            assert x.shape[1:] == (FEATURES,) and y.dtype == torch.int64
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    assert len(sizes) == private.ledger.steps == steps
    q = 1 / N
    mean, stderr = N * q, math.sqrt(N * q * (1 - q) / steps)
    assert abs(sum(sizes) / steps - mean) < 5.5 * stderr
    empty, p_empty = sizes.count(0), (1 - q) ** N
    assert abs(empty / steps - p_empty) < 5.5 * math.sqrt(p_empty * (1 - p_empty) / steps)


def test_a_pass_after_the_planned_steps_is_refused():
    private = _private(steps=3)
    _train(private)   # 3 steps in the first pass (a pass is 5)
    assert private.ledger.steps == 3
    with pytest.raises(DpclipError, match="3 planned steps are done") as info:
        _train(private)
    assert "epochs" in info.value.hint and private.ledger.steps == 3


def test_adaptive_thresholds_share_the_budget_and_the_ledger_charges_the_joint_event(cli, tmp_path):
    private = _private(max_grad_norm=None, noise_multiplier=1.2,
                       clipping={"grouping": "layer", "threshold": {"kind": "quantile", "initial": 1.0}})
    _train(private)
    split = private.plan.split
    assert split.sigma_aux is not None and split.gradient_noise_multiplier > split.noise_multiplier == 1.2
    assert private.engine.gradient_noise_multiplier == pytest.approx(split.gradient_noise_multiplier)
    epsilon = json.loads(cli("account", "--sigma", 1.2, "-q", repr(12 / N), "--steps", 4, "--delta", 1e-5,
                             "--json").out)["epsilon"]
    assert private.epsilon() == epsilon
    assert any("quantile" in line for line in private.statement())


def test_a_learning_rate_scheduler_drives_the_wrapped_optimizer():
    private = _private()
    scheduler = torch.optim.lr_scheduler.StepLR(private.optimizer, step_size=1, gamma=0.5)
    model, optimizer, criterion, loader = private
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    assert private.optimizer.original.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)


class _Stream(IterableDataset):
    def __iter__(self):
        yield from ()


def test_step_hooks_registered_on_the_returned_optimizer_run_around_each_noisy_step():
    """torch's register_step_pre_hook / register_step_post_hook (an EMA update, a log of the lr):
    they run around the wrapped optimizer's step, once per noisy step, the step charged and p.grad
    noisy by then; a handle removes them."""
    private = _private(steps=3)
    model, optimizer, criterion, loader = private
    seen = []
    pre = optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(("pre", private.ledger.steps, model[0].weight.grad is not None)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(("post", private.ledger.steps)))
    for k, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        if k == 1:
            pre.remove()
    assert seen == [("pre", 1, True), ("post", 1), ("pre", 2, True), ("post", 2), ("post", 3)]


def test_draws_the_loaders_workers_fetched_ahead_of_a_break_leave_the_planned_steps_to_the_loop():
    """A loop that breaks out of each pass (a time limit, a step count) with a worker: the
    draws its workers fetched ahead were never taken, so never released nor charged; the plan's
    steps are the loop's to take all the same, and len() counts the steps left."""
    model = _model()
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  DataLoader(_data(), batch_size=12, num_workers=1, persistent_workers=True),
                                  criterion=nn.CrossEntropyLoss(),
                                  delta=1e-5, noise_multiplier=1.0, steps=6, max_grad_norm=1.0)
    model, optimizer, criterion, loader = private
    lengths = []
    for _ in range(3):
        lengths.append(len(loader))
        for k, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            if k == 1:
                break
    assert private.ledger.steps == 6 and lengths == [5, 4, 2]
    with pytest.raises(DpclipError, match="6 planned steps are done"):
        next(iter(loader))


@pytest.mark.parametrize("change, message", [
    ({"criterion": lambda out, y: nn.functional.cross_entropy(out, y)}, "not one loss per sample"),
    ({"target_epsilon": 8.0}, "exactly one of target_epsilon and noise_multiplier"),
    ({"epochs": 1.0}, "exactly one of epochs and steps"),
    ({"clipping": {"threshold": {"kind": "fixed", "value": 1.0}}}, "max_grad_norm or clipping"),
    ({"max_grad_norm": None}, "no clipping threshold"),
    ({"clipping": {"grouping": "layer", "fn": "nope"}}, "clipping.fn"),
    ({"loader": DataLoader(_data(), batch_sampler=[[0, 1]])}, "no batch_size"),
    ({"loader": DataLoader(_Stream(), batch_size=2)}, "a length and indexable rows"),
    ({"loader": DataLoader(_data(), batch_size=N + 1)}, "not between 1"),
    ({"extra_param": True}, "not trainable parameters of the model"),
    ({"steps": float("nan")}, "steps must be a whole number > 0"),   # crashed in the planner
    ({"steps": 2.7}, "steps must be a whole number > 0"),            # planned 2 steps, silently
    ({"steps": "5"}, "steps must be a whole number > 0"),
    ({"steps": True}, "steps must be a whole number > 0"),
    ({"steps": 0}, "steps must be a whole number > 0"),
    ({"max_grad_norm": "x"}, "max_grad_norm must be a finite number > 0, got 'x'"),   # float()'s ValueError
    ({"max_grad_norm": -1.0}, "max_grad_norm must be a finite number > 0, got -1.0"),   # pydantic's location
    ({"max_grad_norm": 1e39}, "max_grad_norm: "),   # beyond float32: named as the argument, not the block
    ({"max_grad_norm": None, "clipping": {"threshold": {"kind": "fixed", "value": "a"}}}, "clipping.threshold.value: "),
])
def test_bad_input_is_refused_with_a_hint_before_any_step(change, message):
    change = dict(change)
    model = _model()
    params = list(model.parameters()) + ([nn.Parameter(torch.zeros(2))] if change.pop("extra_param", False) else [])
    loader = change.pop("loader", DataLoader(_data(), batch_size=12))
    options = {"criterion": nn.CrossEntropyLoss(), "delta": 1e-5, "noise_multiplier": 1.0, "steps": 4,
               "max_grad_norm": 1.0, **change}
    with pytest.raises(DpclipError, match=re.escape(message)) as info:
        private = dpclip.make_private(model, torch.optim.SGD(params, lr=0.1), loader, **options)
        _train(private)   # the reduced loss is refused at the first batch, before backward
    assert info.value.hint
    assert not any(pydantic in str(info.value) for pydantic in ("function-after", "input_value", "pydantic.dev",
                                                                "validation error for"))


def test_the_python_api_docs_show_the_example_that_runs_as_a_test():
    doc = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    example = (REPO / "examples" / "make_private.py").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    assert example in blocks, "docs/python-api.md must show examples/make_private.py verbatim"


@pytest.mark.slow
def test_the_make_private_example_trains_digits_and_writes_its_ledger(tmp_path, monkeypatch, capsys):
    accuracy, privacy = run_example("make_private.py", tmp_path / "out", monkeypatch, capsys)
    assert accuracy > 0.5   # ten classes: chance is 0.1
    assert privacy["steps"] == privacy["steps_planned"] and 7.5 < privacy["epsilon"] <= 8.0 * 1.01


def test_dpclip_make_private_is_the_function_itself_yet_import_dpclip_imports_no_torch():
    import inspect
    import subprocess
    import sys

    from dpclip.integrations.private import make_private

    assert dpclip.make_private is make_private   # help() and IDEs show its arguments
    assert {"criterion", "delta", "max_grad_norm"} <= set(inspect.signature(dpclip.make_private).parameters)
    probe = "import sys, dpclip; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_a_kept_loaders_batches_are_stated_as_the_loaders_own_not_as_shuffled_ones_from_os_entropy(tmp_path):
    """poisson_sampling=False keeps the caller's loader, here sequential with a short last batch:
    privacy.json said "fixed-size shuffled batches" and that the batches came from OS entropy."""
    private = _private(batch_size=16, poisson_sampling=False)
    _train(private)
    privacy = json.loads((private.save(tmp_path) / "privacy.json").read_text())
    text = "\n".join(privacy["statement"])
    assert privacy["sampling"] == "loader"
    assert "shuffled" not in text and "batch sampling: generators" not in text
    assert "your loader's own batches" in text and "CAVEAT: accounting assumes Poisson sampling" in text
    entries = private.account.ledger.entries   # each charged step names its caveat (not "shuffled batches")
    assert entries and all(entry.metadata["caveats"] == [OWN_BATCHES_CAVEAT] for entry in entries)


def test_before_the_first_step_the_statement_says_nothing_is_spent_and_that_the_rest_is_the_plan(tmp_path):
    # statement() and privacy.json before any step stated "ε = <planned ε>", "steps: 4" as if spent, beside
    # privacy.json's own "epsilon": 0, "steps": 0 and epsilon() = 0.
    private = _private()
    written = json.loads((private.save(tmp_path / "out") / "privacy.json").read_text())
    assert (written["epsilon"], written["steps"]) == (0.0, 0)
    for lines in (private.statement(), written["statement"]):
        assert lines[0] == "no step taken yet: ε spent so far is 0; the lines below are the plan's, its guarantee " \
                           "after all 4 planned steps"
        assert "steps: 4" in lines
    _train(private)
    assert not any(line.startswith("no step taken yet") for line in private.statement())
    assert private.statement()[0].startswith("ε = ")
