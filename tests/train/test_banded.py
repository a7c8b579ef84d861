"""`dpclip train` with privacy.mechanism banded-mf (docs/methods.md, "Correlated noise"): the
engine's noise is the dense C⁻¹Z of its own draws, the ledger charges ⌈T/b⌉ participations
exactly as dp_accounting does, a resumed run ends with the weights of the run that never
stopped, and what cannot run is refused before anything is written."""

from __future__ import annotations

import json
import math
import shutil

import dp_accounting
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from safetensors.torch import load_file
from torch import nn

from dpclip.accounting import Ledger
from dpclip.accounting.accountants import account
from dpclip.engine import DPEngine
from dpclip.engine.correlated import banded_strategy, toeplitz_strategy
from dpclip.errors import DpclipError
from dpclip.layout import MODEL_WEIGHTS
from dpclip.rundir.checkpoint import latest_checkpoint
from dpclip.rundir.run import spent
from dpclip.train.workflow import train

BANDED = ["privacy.mechanism={kind: banded-mf, bands: 4}"]
SEEDED = ["privacy.unsafe_seeded_randomness=true"]


def _noise_of_empty_steps(correlation, steps: int) -> torch.Tensor:
    """p.grad of ``steps`` steps without examples (pure noise), seeded, one row per step."""
    model = nn.Linear(50, 40, bias=False).double()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=1, seed=11, noise_correlation=correlation)
    rows = []
    for _ in range(steps):
        engine.privatize()
        rows.append(model.weight.grad.reshape(-1).clone())
    engine.detach()
    return torch.stack(rows)


def test_the_engines_noise_is_the_dense_inverse_strategy_times_its_own_draws():
    steps, coefficients = 9, banded_strategy(3, 9)
    fresh = _noise_of_empty_steps(None, steps)              # the same stream, uncorrelated: Z
    correlated = _noise_of_empty_steps(coefficients, steps)
    dense = toeplitz_strategy(coefficients, steps)
    expected = torch.linalg.solve_triangular(dense, fresh, upper=False)   # C⁻¹Z
    assert torch.allclose(correlated, expected, atol=1e-12, rtol=0)
    assert not torch.allclose(correlated[1:], fresh[1:])   # the later steps are correlated, not the draws


def test_a_banded_run_charges_its_participations_as_dp_accounting_does(small_recipe):
    result = train(small_recipe(*BANDED, "training.steps=10", "privacy.noise_multiplier=1.0", "privacy.epsilon=null"))
    ledger = Ledger.from_dict(json.loads((result.run_dir / "ledger.json").read_text()))
    assert ledger.steps == 10
    q = 64 / 1438
    event = dp_accounting.PoissonSampledDpEvent(4 * q, dp_accounting.GaussianDpEvent(1.0))
    composed = dp_accounting.SelfComposedDpEvent(event, math.ceil(10 / 4))
    interval = account(composed, 1e-5, "pld").pld_interval
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval).compose(composed)
    assert ledger.epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    charged = [entry for entry in ledger.entries if not isinstance(entry.event, dp_accounting.NoOpDpEvent)]
    assert sum(entry.count for entry in charged) == 3
    _, statement = spent(result.run_dir)
    assert statement.steps == 10 and statement.sample_rate == pytest.approx(q)
    assert any(line.startswith("mechanism: banded matrix factorization, 4 bands") for line in statement.lines())


def test_a_ledger_with_a_charge_removed_is_refused(small_recipe):
    result = train(small_recipe(*BANDED, "training.steps=8"))
    path = result.run_dir / "ledger.json"
    data = json.loads(path.read_text())
    first = next(e for e in data["entries"] if e["event"] != {"type": "NoOp"})
    first["event"] = {"type": "NoOp"}   # one charged step turned into a free one: ε would drop
    path.write_text(json.dumps(data))
    with pytest.raises(DpclipError, match="not this run's step event there"):
        spent(result.run_dir)


def resume_from(full, cut, step: int, later: list[int]) -> None:
    """``cut``: a copy of run ``full`` as it was when it stopped after ``step`` (the checkpoints
    ``later`` gone, the ledger and metrics cut back), resumed to the end; then the weights and
    the ledger must be the straight run's, bit for bit."""
    shutil.copytree(full, cut)
    for done in later:
        shutil.rmtree(cut / "checkpoints" / f"step_{done:06d}")
    (cut / "checkpoints" / "LATEST").write_text(f"step_{step:06d}\n")
    state = json.loads((cut / "checkpoints" / f"step_{step:06d}" / "state.json").read_text())
    (cut / "ledger.json").write_text(json.dumps(Ledger.from_dict(state["ledger"]).to_dict()))
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l).get("step", 0) <= step))
    train(resume=cut)
    a = load_file(str(latest_checkpoint(full) / MODEL_WEIGHTS))
    b = load_file(str(latest_checkpoint(cut) / MODEL_WEIGHTS))
    assert all(torch.equal(a[k], b[k]) for k in a)   # the noise state came back with the generators
    assert Ledger.from_dict(json.loads((cut / "ledger.json").read_text())) == \
        Ledger.from_dict(json.loads((full / "ledger.json").read_text()))


@pytest.mark.slow  # an end-to-end resume: the slow set (README)
def test_a_resumed_banded_run_ends_as_the_run_that_never_stopped(small_recipe, tmp_path):
    full = train(small_recipe(*BANDED, *SEEDED)).run_dir   # 12 steps, checkpoints every 4
    resume_from(full, tmp_path / "cut", 8, [12])


@pytest.mark.parametrize("extra, message", [
    (["training.sampling=shuffle"], "needs cyclic Poisson sampling"),
    (["privacy.mechanism={kind: banded-mf, bands: 13}"], "bands must be a whole number from 1 to the 12 steps"),
    (["privacy.mechanism={kind: banded-mf, bands: 12}", "training.batch_size=200"], "fewer than the expected batch"),
])
def test_what_banded_mf_cannot_run_is_refused_before_a_run_directory_exists(small_recipe, tmp_path, extra, message):
    with pytest.raises(DpclipError, match=message) as caught:
        train(small_recipe(*BANDED, *extra), run_dir=tmp_path / "run")
    assert caught.value.hint and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", [BANDED, ["privacy.mechanism={kind: blt, buffers: 2}"]], ids=["banded", "blt"])
def test_kill_9_then_resume_of_a_seeded_correlated_run_ends_with_the_weights_of_one_that_never_stopped(
        small_recipe, tmp_path, mechanism):
    import signal
    import subprocess
    import sys
    import time

    from dpclip.recipe import recipe_to_yaml

    # every checkpoint kept: with the default 2, a fast run pruned step 10 before the poll saw it
    overrides = (*mechanism, *SEEDED, "training.steps=200", "checkpoint.every_steps=5", "checkpoint.keep=100",
                 "eval.every_steps=null", "privacy.epsilon=null", "privacy.noise_multiplier=1.0")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe_to_yaml(small_recipe(*overrides)))
    process = subprocess.Popen([sys.executable, "-m", "dpclip", "train", str(recipe_file), "--json"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, run_dir = time.time() + 300, None
    while time.time() < deadline and run_dir is None:
        found = list((tmp_path / "runs").glob("*/checkpoints/step_000010"))
        run_dir = found[0].parents[1] if found else None
        time.sleep(0.05)
    assert run_dir is not None, "the run never reached step 10"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (run_dir / "summary.json").exists(), "killed too late to test anything"
    done = subprocess.run([sys.executable, "-m", "dpclip", "train", "--resume", str(run_dir), "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    reference = train(small_recipe(*overrides), run_dir=tmp_path / "straight")
    a = load_file(str(latest_checkpoint(run_dir) / MODEL_WEIGHTS))
    b = load_file(str(latest_checkpoint(reference.run_dir) / MODEL_WEIGHTS))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert Ledger.from_dict(json.loads((run_dir / "ledger.json").read_text())) == \
        Ledger.from_dict(json.loads((reference.run_dir / "ledger.json").read_text()))


@pytest.mark.parametrize("threshold", [
    "{kind: quantile, target: 0.5, lr: 0.3, budget_fraction: 0.01, initial: 1.0}",
    pytest.param("{kind: dcsgd-p, percentile: 0.5, bins: 20, sigma_hist: 5.0, initial: 1.0, range: 1.0}",
                 marks=pytest.mark.slow),
    pytest.param("{kind: dcsgd-e, bins: 20, sigma_hist: 5.0, initial: 1.0, range: 20.0}", marks=pytest.mark.slow),
    pytest.param("{kind: discriminative, small: 0.5, large: 2.0, tail_rule: threshold, tail_threshold: 4.0}",
                 marks=pytest.mark.slow),
])
def test_banded_mf_runs_with_every_threshold_policy_and_charges_its_joint_participations(small_recipe, threshold):
    """The noise is correlated at unit scale and scaled by each step's std (dpclip/engine/noise.py),
    so a threshold that moves is post-processing; each participation is charged the joint event
    of the gradient and the step's statistic, PoissonSampled(q·b, Gaussian(σ_eff))."""
    from dpclip.accounting import PrivacyPlan, solve
    from dpclip.planning.plan import privacy_plan

    recipe = small_recipe(*BANDED, "training.steps=10", f"clipping.threshold={threshold}")
    result = train(recipe)
    ledger, statement = spent(result.run_dir)
    plan = privacy_plan(recipe, 1438, groups=len(json.loads((result.run_dir / "plan.json").read_text())["groups"]))
    solved = solve(plan)
    q = 64 / 1438
    event = dp_accounting.PoissonSampledDpEvent(4 * q, dp_accounting.GaussianDpEvent(solved.split.noise_multiplier))
    assert ledger.composed_event() == dp_accounting.SelfComposedDpEvent(event, math.ceil(10 / 4))
    assert statement.epsilon == ledger.epsilon()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    stds = {json.dumps(r["noise_std"]) for r in records if "noise_std" in r}
    if "discriminative" not in threshold:   # its sensitivity is fixed; the others' thresholds move
        assert len(stds) > 1
