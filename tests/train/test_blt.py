"""`dpclip train` with privacy.mechanism blt (docs/methods.md, "Correlated noise"): the
engine's noise is the dense C⁻¹Z of its own draws, the ledger charges each participation's
Gaussian increment so that the run's ε is dp_accounting's for one Gaussian of multiplier σ/s,
a resumed run ends with the weights of the run that never stopped, and what cannot run is
refused before anything is written."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from safetensors.torch import load_file

from dpclip.accounting import Ledger
from dpclip.accounting.accountants import RDP_ORDERS
from dpclip.engine.blt import blt_strategy, participation_sensitivities
from dpclip.errors import DpclipError
from dpclip.rundir.checkpoint import latest_checkpoint
from dpclip.rundir.run import spent
from dpclip.train.workflow import train
from tests.train.test_banded import _noise_of_empty_steps, resume_from

BLT = ["privacy.mechanism={kind: blt, buffers: 2}"]
SEEDED = ["privacy.unsafe_seeded_randomness=true"]
STEPS = ["training.steps=50", "checkpoint.every_steps=10", "checkpoint.keep=10"]   # q = 64/1438: G = 22 groups, 3 participations


def test_the_engines_noise_is_the_dense_inverse_strategy_times_its_own_draws():
    steps, strategy = 9, blt_strategy(2, 9, 3)
    fresh = _noise_of_empty_steps(None, steps)              # the same stream, uncorrelated: Z
    correlated = _noise_of_empty_steps(strategy, steps)
    c = strategy.coefficients(steps)
    dense = torch.stack([torch.cat([c[:t + 1].flip(0), c.new_zeros(steps - t - 1)]) for t in range(steps)])
    expected = torch.linalg.solve_triangular(dense, fresh, upper=False)   # C⁻¹Z
    assert torch.allclose(correlated, expected, atol=1e-12, rtol=0)
    assert not torch.allclose(correlated[1:], fresh[1:])


def test_a_blt_run_is_one_gaussian_of_multiplier_sigma_over_its_sensitivity(small_recipe):
    result = train(small_recipe(*BLT, *STEPS, "privacy.noise_multiplier=8.0", "privacy.epsilon=null"))
    ledger = Ledger.from_dict(json.loads((result.run_dir / "ledger.json").read_text()))
    assert ledger.steps == 50
    charged = [entry for entry in ledger.entries if not isinstance(entry.event, dp_accounting.NoOpDpEvent)]
    assert sum(entry.count for entry in charged) == 3   # steps 0, 22, 44
    groups = math.floor(1438 / 64)
    squared = participation_sensitivities(blt_strategy(2, 50, groups), 50, groups)[-1]
    whole = dp_accounting.GaussianDpEvent(8.0 / math.sqrt(squared))
    rdp = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(whole).get_epsilon(1e-5)
    assert ledger.result().epsilon_rdp == pytest.approx(rdp, rel=1e-9)
    _, statement = spent(result.run_dir)
    assert statement.epsilon == ledger.epsilon() and statement.noise_multiplier == 8.0
    assert any(line.startswith("mechanism: BLT") and "no amplification" in line for line in statement.lines())


def test_a_ledger_with_a_charge_lowered_is_refused(small_recipe):
    result = train(small_recipe(*BLT, *STEPS))
    path = result.run_dir / "ledger.json"
    data = json.loads(path.read_text())
    charges = [e for e in data["entries"] if e["event"] != {"type": "NoOp"}]
    charges[1]["event"] = charges[0]["event"]   # the second participation charged like the first: cheaper
    path.write_text(json.dumps(data))
    with pytest.raises(DpclipError, match="not this run's step event there"):
        spent(result.run_dir)


def test_a_blt_run_stopped_by_its_cap_reports_the_sensitivity_of_the_participation_it_made(small_recipe):
    # Batch 512 of 1,438: G = 2 groups, so a 4-step plan participates twice (steps 0 and 2). A cap below the
    # plan's ε stops it after one: summary.json's noise named the plan's sensitivity s_2, the statement s_1.
    base = [*BLT, "training.batch_size=512", "training.steps=4", "checkpoint.every_steps=2", "eval.every_steps=null",
            "privacy.noise_multiplier=8.0"]
    whole = train(small_recipe(*base, "privacy.epsilon=null"))
    capped = train(small_recipe(*base, f"privacy.epsilon={whole.epsilon * 0.8}"))
    squared = participation_sensitivities(blt_strategy(2, 4, 2), 4, 2)
    assert whole.noise["sensitivity"] == pytest.approx(math.sqrt(squared[-1]), rel=1e-9)
    assert capped.stopped == "budget" and capped.steps_done == 2
    summary = json.loads((capped.run_dir / "summary.json").read_text())
    _, statement = spent(capped.run_dir)
    assert summary["noise"]["sensitivity"] == statement.sensitivity == pytest.approx(math.sqrt(squared[0]), rel=1e-9)
    assert any("at most 1 participation;" in line for line in statement.lines())


@pytest.mark.slow  # an end-to-end resume: the slow set (README)
def test_a_resumed_blt_run_ends_as_the_run_that_never_stopped(small_recipe, tmp_path):
    full = train(small_recipe(*BLT, *SEEDED, *STEPS)).run_dir
    resume_from(full, tmp_path / "cut", 30, [40, 50])   # mid-cycle: participations at 0, 22, 44


@pytest.mark.parametrize("extra, message", [
    (["training.sampling=shuffle"], "needs cyclic Poisson sampling"),
    (["privacy.mechanism={kind: blt, buffers: 9}"], "buffers must be at most 8"),
    (["privacy.mechanism={kind: blt, buffers: 0}"], "buffers"),
])
def test_what_blt_cannot_run_is_refused_before_a_run_directory_exists(small_recipe, tmp_path, extra, message):
    with pytest.raises(DpclipError, match=message) as caught:
        train(small_recipe(*BLT, *extra), run_dir=tmp_path / "run")
    assert caught.value.hint and not (tmp_path / "run").exists()


def test_the_strategy_follows_the_recipes_momentum_and_other_optimizers_are_warned_about(small_recipe):
    from dpclip.engine.workload import Workload
    from dpclip.train.parts import assemble
    from dpclip.planning.plan import correlated_noise_note, strategy_workload

    banded = ["privacy.mechanism={kind: banded-mf, bands: 4}"]
    momentum = small_recipe(*banded, "training.optimizer={kind: sgd, lr: 0.1, momentum: 0.9, nesterov: true}")
    assert strategy_workload(momentum) == Workload(0.9, True) and correlated_noise_note(momentum) is None
    parts = assemble(momentum)
    from dpclip.engine.correlated import banded_strategy
    assert torch.equal(parts.learner.engine.correlation.coefficients, banded_strategy(4, 12, Workload(0.9, True)))
    parts.learner.engine.detach()
    adam = small_recipe(*BLT, "training.optimizer={kind: adam, lr: 0.01}", "training.schedule={kind: cosine}")
    assert strategy_workload(adam) == Workload()
    note = correlated_noise_note(adam)
    assert "adam" in note and "cosine" in note and "ε is unaffected" in note
    assert correlated_noise_note(small_recipe()) is None


@pytest.mark.slow
@pytest.mark.parametrize("mechanism, groups", [("{kind: banded-mf, bands: 3}", 3), ("{kind: blt, buffers: 2}", None)])
def test_a_continual_run_correlates_only_its_private_steps(small_recipe, mechanism, groups):
    """Public steps draw no private batch and add no noise: the noise stream and the ledger
    advance with the private steps alone, and the run directory checks as its plan."""
    from dpclip.files import read_json
    from dpclip.rundir.checkpoint import unflatten_state

    result = train(small_recipe(f"privacy.mechanism={mechanism}", "data.public_fraction=0.1",
                                "public={source: builtin, name: digits}", "continual={switch: {rule: step, at_step: 5}}",
                                "checkpoint.keep=10"))
    ledger, statement = spent(result.run_dir)
    assert ledger.steps == 12   # the private steps; the 5 public ones are not in the ledger
    groups = groups or math.floor(1 / statement.sample_rate)
    charged = sum(e.count for e in ledger.entries if not isinstance(e.event, dp_accounting.NoOpDpEvent))
    assert charged == math.ceil(12 / groups)
    checkpoint = latest_checkpoint(result.run_dir)
    tree = unflatten_state(read_json(checkpoint / "state.json"), load_file(str(checkpoint / "state.safetensors")))
    assert tree["engine"]["correlation"]["step"] == 12


def test_blt_shares_its_budget_with_a_threshold_statistic_one_participation_at_a_time(small_recipe):
    """Quantile thresholds: each participation's charge is the joint Gaussian of its cycle's
    gradient increment and its step's statistic; in RDP the charges compose to one Gaussian with
    1/μ² = s²/σ_g² + K·(Δ_a/σ_a)²."""
    from dpclip.planning.plan import privacy_plan
    from dpclip.accounting import solve

    recipe = small_recipe(*BLT, *STEPS, "clipping.threshold={kind: quantile, target: 0.5, lr: 0.3, "
                          "budget_fraction: 0.01, initial: 1.0}")
    result = train(recipe)
    ledger, statement = spent(result.run_dir)
    solved = solve(privacy_plan(recipe, 1438, groups=len(json.loads((result.run_dir / "plan.json").read_text())["groups"])))
    split = solved.split
    groups = math.floor(1438 / 64)
    from dpclip.planning.plan import strategy_workload
    squared = participation_sensitivities(blt_strategy(2, 50, groups, strategy_workload(recipe)), 50, groups)[-1]
    inverse = squared / split.gradient_noise_multiplier ** 2 + 3 * (split.aux_sensitivity / split.sigma_aux) ** 2
    whole = dp_accounting.GaussianDpEvent(1 / math.sqrt(inverse))
    rdp = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(whole).get_epsilon(1e-5)
    assert ledger.result().epsilon_rdp == pytest.approx(rdp, rel=1e-9)
    assert statement.epsilon <= 8.0 and statement.sigma_aux == pytest.approx(split.sigma_aux)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len({json.dumps(r["thresholds"]) for r in records if "thresholds" in r}) > 1   # the threshold moved
