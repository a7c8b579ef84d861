"""Privacy statements: every ε with its meaning and caveats."""

from __future__ import annotations

import json

import pytest

from dpclip.accounting import (
    SHUFFLE_CAVEAT,
    Ledger,
    PrivacyStatement,
    gradient_step_event,
    statement_from_ledger,
)
from dpclip.accounting.statement import ARITHMETIC_ASSUMPTION
from dpclip.errors import AccountingError


def _statement(**overrides):
    fields = dict(
        epsilon=2.5,
        delta=1e-5,
        accountant="pld",
        conversion="privacy loss distribution",
        sample_rate=0.004,
        steps=2500,
        noise_multiplier=1.1,
        epsilon_rdp=2.9,
    )
    fields.update(overrides)
    return PrivacyStatement(**fields)


def test_shuffled_batches_add_the_loud_poisson_caveat():
    statement = _statement(sampling="shuffle")
    assert SHUFFLE_CAVEAT in statement.caveats
    assert SHUFFLE_CAVEAT == (
        "accounting assumes Poisson sampling; the loader uses fixed-size shuffled batches, "
        "for which this ε is not a proven bound"
    )
    assert any(SHUFFLE_CAVEAT in line for line in statement.lines())


def test_poisson_sampling_has_no_sampling_caveat():
    assert SHUFFLE_CAVEAT not in _statement(sampling="poisson").caveats


def test_unknown_sampling_is_refused():
    with pytest.raises(AccountingError):
        _statement(sampling="sequential")


def test_pld_fallback_reason_becomes_a_caveat():
    statement = _statement(accountant="rdp", epsilon_rdp=None, fallback_reason="PLD returned ε = inf")
    assert any("PLD returned ε = inf" in c for c in statement.caveats)


def test_lines_state_unit_neighbours_sampling_steps_delta_and_accountant():
    text = "\n".join(_statement().lines())
    for fact in ["ε = 2.5", "δ = 1e-05", "example-level", "add/remove one example", "Poisson",
                 "q = 0.004", "steps: 2500", "PLD", "RDP ε alongside: 2.9", "gradient (sensitivity 1 after clipping)"]:
        assert fact in text, fact


@pytest.mark.parametrize("overrides", [{}, {"seeded_randomness": True}, {"own_batches": True}, {"bands": 4}])
def test_every_statement_states_that_epsilon_assumes_real_valued_gaussian_noise(overrides):
    lines = [line for line in _statement(**overrides).lines() if line.startswith("arithmetic:")]
    assert lines == [f"arithmetic: {ARITHMETIC_ASSUMPTION}"]
    assert "real-valued Gaussian noise and clipped sums" in ARITHMETIC_ASSUMPTION and "not hardened against precision-based attacks" in ARITHMETIC_ASSUMPTION


def test_statement_dict_is_json_safe_and_complete():
    d = json.loads(json.dumps(_statement(sampling="shuffle").to_dict(), allow_nan=False))
    assert d["unit"] == "example-level" and d["neighbouring"] == "add/remove one example"
    assert d["sampling"] == "shuffle" and SHUFFLE_CAVEAT in d["caveats"]
    assert d["epsilon_rdp"] == 2.9


def test_statement_of_a_ledger_reports_its_rate_noise_and_epsilon():
    ledger = Ledger(1e-5, "pld")
    ledger.record(gradient_step_event(0.01, 1.2), 300,
                  metadata={"gradient_noise_multiplier": 1.25, "sigma_aux": 9.0,
                            "releases": ["gradient", "quantile counts (K=1, sensitivity 0.5)"]})
    statement = statement_from_ledger(ledger, sampling="shuffle")
    assert statement.epsilon == ledger.epsilon()
    assert (statement.sample_rate, statement.noise_multiplier, statement.steps) == (0.01, 1.2, 300)
    assert (statement.gradient_noise_multiplier, statement.sigma_aux) == (1.25, 9.0)
    assert "quantile counts (K=1, sensitivity 0.5)" in statement.releases
    assert SHUFFLE_CAVEAT in statement.caveats


def test_a_ledger_resumed_across_the_rename_of_its_noise_keys_states_the_gradients_noise():
    """Entries written before issue 27 say sigma_total / sigma_gradient; a run resumed since adds
    entries that say noise_multiplier / gradient_noise_multiplier. Both name the same values."""
    ledger = Ledger(1e-5, "rdp")
    ledger.record(gradient_step_event(0.01, 1.2), 3, metadata={"sigma_total": 1.2, "sigma_gradient": 1.25})
    ledger.record(gradient_step_event(0.01, 1.2), 2,
                  metadata={"noise_multiplier": 1.2, "gradient_noise_multiplier": 1.25})
    statement = statement_from_ledger(ledger)
    assert (statement.noise_multiplier, statement.gradient_noise_multiplier, statement.steps) == (1.2, 1.25, 5)
    assert set(statement.to_dict()) >= {"noise_multiplier", "gradient_noise_multiplier"}
    assert not {"sigma_total", "sigma_gradient"} & set(statement.to_dict())


def test_a_data_parallel_run_says_how_many_processes_trained_it():
    one = _statement()
    assert _statement(world_size=1).lines() == one.lines()
    assert not any(line.startswith("distribution:") for line in one.lines())
    two = _statement(world_size=2).lines()
    line = "distribution: data parallel over 2 processes (sharded Poisson sampling, noise drawn once by rank 0)"
    assert line in two
    assert [line for line in two if not line.startswith("distribution:")] == one.lines()
    shuffled = _statement(world_size=4, sampling="shuffle")
    assert any("over 4 processes (fixed-size shuffled batches from one permutation drawn by rank 0" in line
               for line in shuffled.lines())
    assert f"CAVEAT: {SHUFFLE_CAVEAT}" in shuffled.lines()  # across ranks, shuffled is still not Poisson
    assert json.loads(json.dumps(_statement(world_size=2).to_dict()))["world_size"] == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_world_size_that_is_not_a_process_count_is_refused(bad):
    with pytest.raises(AccountingError, match="world_size"):
        _statement(world_size=bad)


def test_a_pipeline_statement_names_its_stages_and_per_device_clipping():
    from dpclip.accounting.statement import distribution_line
    line = distribution_line(3, "poisson", "pipeline")
    assert line.startswith("pipeline of 3 stages, one per process") and "per-device clipping" in line
    assert distribution_line(1, "poisson", "pipeline") is None
    assert distribution_line(2, "poisson").startswith("data parallel over 2 processes")


@pytest.mark.parametrize("value, up, down", [(7.958298, "7.959", "7.958"), (1.0004017, "1.001", "1"),
                                             (9.99951, "10", "9.999"), (0.1, "0.1", "0.1"), (8.0, "8", "8")])
def test_a_bound_is_printed_outward(value, up, down):
    """An ε spent is never printed below the computed one, an audit's lower bound never above it."""
    from dpclip.accounting import bound_text
    assert bound_text(value) == up and float(up) >= value
    assert bound_text(value, upper=False) == down and float(down) <= value
    assert f"ε = {up} at δ" in _statement(epsilon=value).lines()[0]


def test_seeded_randomness_is_warned_of_in_words_true_for_make_private_too():
    """make_private(unsafe_seed=) has no recipe: the warning names the seed, both ways of giving one."""
    lines = _statement(seeded_randomness=True).lines()
    assert lines[0].startswith("WARNING") and "holds the seed" in lines[0] and "unsafe_seed=" in lines[0]
    assert not any("recipe's seed (reproducible" in line or "holds the recipe" in line for line in lines)
    assert any("derived from the seed given" in line for line in lines)


@pytest.mark.parametrize("mechanism, words", [
    ({"bands": 4}, "sampling: cyclic Poisson over 4 groups, each at q·b"),
    ({"buffers": 2, "groups": 22, "sensitivity": 1.1}, "sampling: cyclic over 22 groups, no amplification"),
])
def test_a_correlated_noise_statement_does_not_say_plain_poisson_sampling_at_q(mechanism, words):
    lines = _statement(**mechanism).lines()
    sampling = [line for line in lines if line.startswith("sampling:")]
    assert len(sampling) == 1 and sampling[0].startswith(words)
    assert not sampling[0].startswith("sampling: Poisson")


def test_a_correlated_noise_statement_dict_names_cyclic_sampling_not_the_loader_setting():
    from dataclasses import replace

    assert _statement().to_dict()["sampling"] == "poisson"
    assert replace(_statement(), bands=4).to_dict()["sampling"] == "cyclic-poisson"
    assert replace(_statement(), buffers=2, groups=20, sensitivity=2.0).to_dict()["sampling"] == "cyclic"


@pytest.mark.slow   # a PLD calibration: ~15 s
def test_the_accounting_api_page_shows_what_its_example_prints(capsys):
    """docs/accounting-api.md's output block is the example's output, to the letter (it read
    "ε = 2.98" after the statement began rounding ε outward: 2.981)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "accounting-api.md").read_text()
    example = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    shown = re.findall(r"```\n(NoiseSplit.*?)```", page, re.S)[0]
    exec(compile(example, "accounting-api.md", "exec"), {})
    assert capsys.readouterr().out == shown
