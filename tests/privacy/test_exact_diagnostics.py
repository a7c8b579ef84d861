"""Training loss, clip fraction, norm median, realised batch size and held-out metrics are
exact functions of private data. They are labelled "not covered by ε" wherever they
appear, and ``privacy.exact_diagnostics: false`` keeps them out of everything a run
shows or writes, for runs whose logs will be shared."""

from __future__ import annotations

import json
from pathlib import Path

from dpclip.accounting.statement import dataset_size_line
from dpclip.cli.render import N_LABEL
from dpclip.planning.plan import HELD_OUT_CUT
from dpclip.rundir.run import spent
from dpclip.train.workflow import train

EXACT_KEYS = ("diagnostics", "eval", "train_loss", "clip_fraction", "norm_median", "batch_size", "accuracy")


def _all_text(run_dir: Path) -> str:
    """Every released text file of the run (not the checkpoints, which are the operator's)."""
    return "\n".join(p.read_text() for p in run_dir.iterdir() if p.suffix in (".json", ".jsonl", ".yaml"))


def test_every_exact_quantity_is_marked_where_it_is_written(tiny_recipe):
    result = train(tiny_recipe("eval.every_steps=2"))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        exact = [k for k in ("diagnostics", "eval", "seconds") if k in record]
        assert exact and sorted(record["not_covered_by_epsilon"]) == sorted(exact)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["final_eval"] and summary["not_covered_by_epsilon"] == ["final_eval"]
    _, statement = spent(result.run_dir)
    uncovered = [line for line in statement.lines() if line.startswith("not covered by ε")]
    assert any("training loss" in line for line in uncovered) and any("held-out" in line for line in uncovered)


def test_switch_keeps_exact_quantities_out_of_every_file_and_the_console(tiny_recipe, cli, tmp_path):
    from dpclip.recipe import recipe_to_yaml

    recipe_file = tmp_path / "shared.yaml"
    # the checkpoint clock off too: the steps it saves at are timings (tests/privacy/test_clock_checkpoints.py)
    recipe_file.write_text(recipe_to_yaml(tiny_recipe("eval.every_steps=2", "privacy.exact_diagnostics=false",
                                                      "checkpoint.every_minutes=null")))
    result = cli("train", recipe_file)
    assert result.code == 0, result.err
    console = (result.out + result.err).replace("privacy loss distribution", "")  # the accountant's name
    assert "loss " not in console and "test loss" not in console and "accuracy" not in console
    assert "clip " not in console
    # the lines left are the dataset size's (the header's N and the statement's line, which every statement
    # with a q carries) and the held-out cut's (tests/privacy/test_held_out_cut.py)
    lines = [line.strip() for line in console.splitlines() if "not covered by ε" in line]
    assert len(lines) == 3 and lines[0].startswith("training examples N") and lines[0].endswith(f"({N_LABEL})")
    assert lines[1:] == [f"not covered by ε: {dataset_size_line('example')}", f"not covered by ε: {HELD_OUT_CUT}"]
    run_dir = next((tmp_path / "runs").iterdir())
    text = _all_text(run_dir)
    for key in EXACT_KEYS:
        assert f'"{key}"' not in text, key
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all("thresholds" in r for r in records)
