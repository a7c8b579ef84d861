"""Opacus's MNIST and char-LSTM examples, written in Opacus's style, switched to dpclip in at most
12 changed lines, reach Opacus's ε for the same σ, q and steps within 1% (issue 51's "Done when")."""

from __future__ import annotations

import difflib
import importlib
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "opacus_examples"


def _changed_lines(name: str) -> list[str]:
    before = (HERE / f"{name}_opacus.py").read_text().splitlines()
    after = (HERE / f"{name}_dpclip.py").read_text().splitlines()
    return [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
            if line.startswith("+") and not line.startswith("+++")]


@pytest.mark.parametrize("name", ["mnist", "charlstm"])
def test_the_switch_is_at_most_12_changed_lines(name):
    changed = _changed_lines(name)
    assert 0 < len(changed) <= 12, changed
    assert any("dpclip.make_private(" in line for line in changed)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mnist", "charlstm"])
def test_both_train_and_dpclips_epsilon_is_opacus_accountants_for_the_same_sigma_q_steps(name):
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant

    opacus_version = importlib.import_module(f"tests.integrations.opacus_examples.{name}_opacus")
    dpclip_version = importlib.import_module(f"tests.integrations.opacus_examples.{name}_dpclip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Opacus's own warnings (secure_mode off, its RNG)
        assert opacus_version.main() > 0
        epsilon = dpclip_version.main()
    steps, q, sigma = _plan_of(dpclip_version)
    accountant = PRVAccountant()
    accountant.history = [(sigma, q, steps)]
    assert epsilon == pytest.approx(accountant.get_epsilon(dpclip_version.DELTA), rel=0.01)


def _plan_of(module) -> tuple[int, float, float]:
    """(steps, q, σ) of the dpclip example's run, from its own constants as make_private plans them."""
    import math

    size = {"mnist_dpclip": 1400, "charlstm_dpclip": 640}[module.__name__.rsplit(".", 1)[1]]
    steps = module.EPOCHS * math.ceil(size / module.BATCH_SIZE)
    return steps, module.BATCH_SIZE / size, module.SIGMA
