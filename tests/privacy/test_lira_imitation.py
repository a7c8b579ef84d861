"""LiRA's shadow models must be trained like the target: same q, steps and noise multiplier.

A shadow trains on a random half of the pool (members + non-members), so its data size
N' is not the target's N. Re-planning the run's recipe for N' changes q = B/N', the steps
of an epochs-based schedule and, with privacy.epsilon set, the calibrated σ: the shadows
then come from a different mechanism than the target, and LiRA calibrated on them is
weaker than it should be. These tests read what each shadow actually did from its own
ledger, the record the accountant trusts.
"""

import json
import shutil
from pathlib import Path

import dp_accounting
import pytest

from dpclip.accounting import Ledger
from dpclip.audit.lira import train_shadows
from dpclip.audit.report import audit, build_pool
from dpclip.errors import DpclipError
from dpclip.recipe import load_recipe
from dpclip.rundir.run import load_run_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[2]

# test_fraction 0.2 makes the target's N (1437) differ from a shadow's N' (about 898), and
# an epochs-based schedule with privacy.epsilon set makes q, steps and σ all depend on N:
# exactly the situation in which re-planning the recipe for the shadow goes wrong.
TARGET = ["training.epochs=0.5", "training.batch_size=64", "training.micro_batch_size=64",
          "data.test_fraction=0.2", "privacy.epsilon=1", "privacy.accountant=rdp",
          "checkpoint.every_steps=null", "eval.every_steps=null"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_run(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("runs")
    return train(load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={output}", *TARGET])).run_dir


def _step(run_dir: Path) -> tuple[int, float, float]:
    """(steps, q, σ) of a run, from its ledger.json: one entry of identical DP-SGD steps."""
    ledger = Ledger.from_dict(json.loads((run_dir / "ledger.json").read_text()))
    (entry,) = ledger.entries
    event = entry.event
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        return ledger.steps, event.sampling_probability, event.event.noise_multiplier
    return ledger.steps, 1.0, event.noise_multiplier


def _picked(plan: dict) -> dict:
    return {key: plan[key] for key in ("sample_rate", "steps", "noise_multiplier")}


def test_shadows_spend_the_targets_steps_rate_and_noise(target_run):
    steps, rate, sigma = _step(target_run)
    recipe = load_run_recipe(target_run)
    pool = build_pool(target_run, recipe)
    keep, dirs = train_shadows(target_run, recipe, pool, 2, seed=0)
    for row, shadow_dir in zip(keep, dirs):
        shadow_steps, shadow_rate, shadow_sigma = _step(shadow_dir)
        shadow_size = int(row.sum())
        assert shadow_size != pool.data.num_train  # the situation under test
        assert shadow_steps == steps
        assert shadow_sigma == sigma
        # B' = round(q·N') is the closest integer expected batch: |B'/N' − q| ≤ 1/(2N').
        assert abs(shadow_rate - rate) <= 0.5 / shadow_size + 1e-15
    # keep.json holds the same record next to the target's, for whoever reads the audit.
    stored = json.loads((target_run / "audit" / "shadows" / "keep.json").read_text())
    assert _picked(stored["imitates"]) == {"sample_rate": rate, "steps": steps, "noise_multiplier": sigma}
    for record, row in zip(stored["shadows"], keep):
        assert record["num_train"] == int(row.sum())
        assert record["steps"] == steps and record["noise_multiplier"] == sigma


def test_the_report_states_what_the_shadows_imitated(target_run):
    steps, rate, sigma = _step(target_run)
    report = audit(target_run, ["lira"], shadows=2, bootstrap=0, write=False)
    shadows = report["lira_shadows"]
    assert _picked(shadows["target"]) == {"sample_rate": rate, "steps": steps, "noise_multiplier": sigma}
    assert len(shadows["shadows"]) == 2
    for record in shadows["shadows"]:
        assert record["steps"] == steps and record["noise_multiplier"] == sigma
        assert abs(record["sample_rate"] - rate) <= 0.5 / record["num_train"] + 1e-15


def test_shadows_trained_before_the_imitation_are_refused(target_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(target_run, run, ignore=shutil.ignore_patterns("audit"))
    recipe = load_run_recipe(run)
    pool = build_pool(run, recipe)
    folder = run / "audit" / "shadows"
    folder.mkdir(parents=True)
    # keep.json as older versions wrote it: the split only, and shadows planned for their own N'.
    (folder / "keep.json").write_text(json.dumps({"seed": 0, "keep": [[1] * pool.size, [0] * pool.size]}))
    with pytest.raises(DpclipError) as caught:
        train_shadows(run, recipe, pool, 2, seed=0)
    assert "delete" in caught.value.hint and str(folder) in caught.value.hint
