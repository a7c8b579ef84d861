"""scripts/continual_evidence.py: the overrides of each configuration, the table it writes (on
fake runs), where the block goes in docs/continual.md, and one tiny run of each kind."""

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script(load_script):
    yield load_script("continual_evidence")
    sys.modules.pop("continual_evidence", None)


def _runs(script, config, eps, values, *, public=400, switch="cap of 400 public steps reached: x", spent=7.95):
    return [script.Run(config, eps, seed, "accuracy", value, spent, 405, public, switch, 30.0 + seed)
            for seed, value in enumerate(values)]


# ------------------------------------------------------------------ configurations


def test_every_private_configuration_runs_at_each_epsilon_and_the_others_once(script):
    runs = script.plan(3)
    assert len(runs) == 3 * (5 * 2 + 2)
    assert {(c.key, eps) for c, eps, _ in runs if c.key == "dp-scratch"} == {("dp-scratch", 8.0), ("dp-scratch", 2.0)}
    assert {eps for c, eps, _ in runs if not c.private} == {None}
    assert script.plan(1, only=["dpmd"]) == [(script.BY_KEY["dpmd"], 8.0, 0), (script.BY_KEY["dpmd"], 2.0, 0)]


def test_overrides_turn_periodic_work_off_and_set_seed_epsilon_and_schedule(script, tmp_path):
    overrides = script.recipe_overrides(script.BY_KEY["dpmd"], 2, 2.0, tmp_path, ["training.epochs=5"])
    assert overrides[:4] == ["seed=2", f"output_dir={tmp_path}", "eval.every_steps=null",
                             "checkpoint.every_steps=null"]
    assert "privacy.epsilon=2" in overrides and "continual.schedule=dpmd" in overrides
    assert overrides[-1] == "training.epochs=5"  # the extra overrides come last: they apply to all alike


def test_public_only_has_no_target_epsilon_and_a_private_configuration_needs_one(script, tmp_path):
    overrides = script.recipe_overrides(script.BY_KEY["public-only"], 0, None, tmp_path)
    assert "continual.schedule=only-public" in overrides
    assert not any(o.startswith("privacy.epsilon") for o in overrides)
    with pytest.raises(ValueError, match="target ε"):
        script.recipe_overrides(script.BY_KEY["dp-scratch"], 0, None, tmp_path)


def test_the_shipped_recipe_is_the_early_stopping_configuration_and_b_star_sets_its_rule(script):
    assert script.BY_KEY["continual-early-stopping"].overrides == ()
    b_star = script.BY_KEY["continual-b-star"].overrides
    assert "continual.switch.rule=b-star" in b_star
    assert f"continual.switch.b_star_multiple={script.B_STAR_MULTIPLE:g}" in b_star


def test_every_configuration_loads_as_a_valid_recipe_with_its_schedule(script, tmp_path):
    from dpclip.recipe import load_recipe

    schedules = {"public-only": "only-public", "dp-scratch": "only-private", "continual-early-stopping": "switch",
                 "continual-b-star": "switch", "dpmd": "dpmd", "sample": "sample"}
    for config, eps, seed in script.plan(1):
        recipe = load_recipe(script.TASKS["cnn"], script.recipe_overrides(config, seed, eps, tmp_path))
        if not config.reference:
            assert recipe.continual.schedule == schedules[config.key]
        assert recipe.eval.every_steps is None and recipe.checkpoint.every_steps is None


# ------------------------------------------------------------------ the table


def test_summary_gives_median_and_range_over_seeds(script):
    row = script.summarize(_runs(script, "continual-early-stopping", 8.0, [0.91, 0.95, 0.93]))
    assert (row.epsilon, row.median, row.spread, row.spent) == ("8", "93.0%", "91.0–95.0%", "7.95")
    assert row.private_steps == "405" and row.public_steps == "400" and row.seconds == "31 s"
    assert row.switch == "cap 3/3"


def test_switch_summary_counts_seeds_where_the_rule_fired(script):
    runs = _runs(script, "continual-b-star", 2.0, [0.9, 0.9], switch="B*_DP estimate 40 fell below 2 x batch size 64")
    runs += _runs(script, "continual-b-star", 2.0, [0.9])
    assert script.switch_summary(runs) == "rule fired 2/3, cap 1/3"
    assert script.switch_summary(_runs(script, "dp-scratch", 2.0, [0.5], switch=None)) == ""


def test_steps_that_differ_between_seeds_show_median_and_range(script):
    runs = _runs(script, "continual-b-star", 8.0, [0.9, 0.9, 0.9])
    for run, public in zip(runs, (25, 50, 400)):
        run.public_steps = public
    assert script.summarize(runs).public_steps == "50 (25–400)"


def test_non_private_and_public_only_rows_say_what_they_spend(script):
    reference = script.summarize([script.Run("non-private", None, 0, "accuracy", 0.98, math.inf, 420, 0, None, 5.0)])
    assert reference.epsilon == "∞ (not private)" and reference.spent == "—"
    public = script.summarize(_runs(script, "public-only", None, [0.8], spent=0.0))
    assert public.epsilon == "0" and public.spent == "0.00"


def test_perplexity_is_written_as_a_number(script):
    runs = [script.Run("dp-scratch", 8.0, s, "perplexity", v, 7.9, 90, 0, None, 60.0) for s, v in enumerate([5.5, 6.0])]
    row = script.summarize(runs)
    assert row.median == "5.75" and row.spread == "5.50–6.00"


def test_rows_are_ordered_non_private_first_then_each_epsilon_from_large_to_small(script):
    runs = (_runs(script, "sample", 2.0, [0.7]) + _runs(script, "dp-scratch", 8.0, [0.6])
            + _runs(script, "public-only", None, [0.8], spent=0.0) + _runs(script, "dp-scratch", 2.0, [0.5])
            + [script.Run("non-private", None, 0, "accuracy", 0.98, math.inf, 420, 0, None, 5.0)])
    rows = script.table_rows(runs)
    assert [(r.label.split(" (")[0], r.epsilon) for r in rows] == [
        ("non-private", "∞ (not private)"), ("public only", "0"), ("DP from scratch", "8"),
        ("DP from scratch", "2"), ("Sample mixing", "2")]


def _block(script, task="cnn", audit=None):
    runs = _runs(script, "dp-scratch", 8.0, [0.6, 0.62, 0.61], switch=None)
    return script.render_block(task, runs, "python scripts/continual_evidence.py --audit", "2 CPUs", audit)


def test_block_holds_the_table_the_command_and_its_markers(script):
    block = _block(script)
    assert block.startswith(script.begin_marker("cnn")) and block.endswith(script.end_marker("cnn"))
    assert "| DP from scratch (`only-private`) | 8 | 61.0% | 60.0–62.0% | 7.95 |" in block
    assert "Produced by `python scripts/continual_evidence.py --audit`." in block
    assert "not covered by ε" in block


def test_block_is_added_before_the_hessian_section_then_replaced_in_place(script):
    page = "# Continual\n\n## Schedules\n\ntext\n\n## Hessian diagnostics\n\nmore\n"
    first = script.replace_block(page, "cnn", _block(script))
    assert first.index("## Evidence") < first.index(script.begin_marker("cnn")) < first.index("## Hessian")
    edited = first.replace("## Hessian diagnostics", "Prose written by hand.\n\n## Hessian diagnostics")
    second = script.replace_block(edited, "cnn", _block(script).replace("61.0%", "99.9%"))
    assert second.count("## Evidence") == 1 and second.count(script.begin_marker("cnn")) == 1
    assert "99.9%" in second and "| 61.0% |" not in second
    assert "Prose written by hand." in second and second.endswith("## Hessian diagnostics\n\nmore\n")


def test_blocks_of_the_two_tasks_live_side_by_side(script):
    page = script.replace_block("# C\n\n## Hessian diagnostics\n", "cnn", _block(script))
    page = script.replace_block(page, "gpt2", _block(script, "gpt2"))
    page = script.replace_block(page, "cnn", _block(script).replace("61.0%", "70.0%"))
    assert page.count("## Evidence") == 1
    assert page.count(script.end_marker("cnn")) == 1 and page.count(script.end_marker("gpt2")) == 1
    assert "70.0%" in page and "| 61.0% |" in page  # the gpt2 block kept its own numbers
    assert page.index(script.end_marker("cnn")) < page.index(script.end_marker("gpt2")) < page.index("## Hessian")


def test_audit_section_states_the_pool_and_the_bound(script):
    audit = {"label": "DP continual", "seed": 0, "epsilon": 7.95, "delta": 1e-5, "bound_1": 0.5,
             "pool": {"rows": 1797, "members": 1294, "non_members": 323, "public": 180, "public_in_pool": 0},
             "attacks": {"loss": {"auc": 0.51, "auc_ci95": [0.48, 0.54], "tpr_1": 0.012, "tpr_0.1": 0.0,
                                  "advantage": 0.04}}}
    text = _block(script, audit=audit)
    assert "the 180 carved public rows are in neither: 0 of them in the pool" in text
    assert "(1797 of 1797 rows accounted for)" in text
    assert "| loss | 0.510 [0.480, 0.540] | 1.2% | 0.0% | 0.040 | 50.0% |" in text


# ------------------------------------------------------------------ tiny real runs

TINY = ["training.epochs=null", "training.steps=3", "continual.switch.max_public_steps=3",
        "continual.switch.every_steps=1", "continual.switch.probes=2"]


@pytest.fixture(scope="module")
def tiny(script, tmp_path_factory):
    """One tiny run each of the non-private loop, public only and the early-stopping continual
    at ε = 2, through the script's main with --audit, on a copy of the page."""
    import torch

    threads = torch.get_num_threads()
    folder = tmp_path_factory.mktemp("evidence")
    page = folder / "continual.md"
    page.write_text((REPO / "docs" / "continual.md").read_text(encoding="utf-8"), encoding="utf-8")
    argv = ["--seeds", "1", "--epsilons", "2", "--configs", "non-private", "public-only", "continual-early-stopping",
            "--audit", "--keep", str(folder / "kept"), "--out", str(page), "--json", str(folder / "runs.json")]
    for override in TINY:
        argv += ["--set", override]
    try:
        assert script.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return folder, json.loads((folder / "runs.json").read_text(encoding="utf-8")), page.read_text(encoding="utf-8")


@pytest.mark.slow  # tiny training runs of the script: the slow set (README)
def test_tiny_runs_record_steps_epsilon_and_the_switch(tiny):
    _, result, _ = tiny
    runs = {run["config"]: run for run in result["runs"]}
    assert runs["non-private"]["private_steps"] == 3 and runs["non-private"]["epsilon"] is None
    assert runs["public-only"]["private_steps"] == 0 and runs["public-only"]["epsilon"] == 0.0
    assert runs["public-only"]["public_steps"] == 3
    continual = runs["continual-early-stopping"]
    assert continual["private_steps"] == 3 and 0 < continual["epsilon"] <= 2.0 + 1e-6
    assert 1 <= continual["public_steps"] <= 3 and continual["switch"]
    assert all(0.0 <= run["value"] <= 1.0 for run in result["runs"])


def test_tiny_audit_keeps_the_run_and_finds_no_public_row_in_the_pool(tiny):
    folder, result, page = tiny
    audit = result["audit"]
    assert Path(audit["run_dir"]).parent == folder / "kept" and (Path(audit["run_dir"]) / "audit").is_dir()
    pool = audit["pool"]
    assert pool["public_in_pool"] == 0 and pool["public"] == 180
    assert pool["members"] + pool["non_members"] + pool["public"] == pool["rows"] == 1797
    assert set(audit["attacks"]) == {"loss", "logistic"}
    assert "carved public rows are in neither" in page


def test_tiny_page_gets_the_block_in_its_evidence_section(tiny, script):
    _, _, page = tiny
    assert page.count(script.begin_marker("cnn")) == 1
    assert page.index(script.begin_marker("cnn")) < page.index("## Hessian diagnostics")
    assert "--configs non-private public-only continual-early-stopping" in page


def test_audit_pool_sees_a_public_row_among_the_members(script, tiny, tmp_path):
    import shutil

    from dpclip.data.split import carve_indices

    _, result, _ = tiny
    run_dir = tmp_path / "run"
    shutil.copytree(result["audit"]["run_dir"], run_dir)

    meta = json.loads((run_dir / "meta.json").read_text(encoding="utf-8"))
    public, _ = carve_indices(1797, 0.1, 0)
    meta["members"] = meta["members"] + [int(public[0])]
    (run_dir / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    assert script.audit_pool(run_dir)["public_in_pool"] == 1
