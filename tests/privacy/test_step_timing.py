"""An attacker reads a run's step times. A step's wall time follows its realised Poisson
batch size (the number of private examples drawn), so a per-step time is an exact function
of private data, like the realised batch size itself. Before the fix, every step's
``seconds`` was written to metrics.jsonl and TensorBoard without a label, even with
``privacy.exact_diagnostics: false``, and the progress bar's time remaining followed it.

Now it is one of the exact diagnostics: labelled "not covered by ε" where it appears, and
with ``privacy.exact_diagnostics: false`` written and shown nowhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpclip.recipe import recipe_to_yaml
from dpclip.train.tensorboard import NOT_COVERED_PREFIX

TIMING_WORDS = ("second", "time", "duration", "elapsed")


def _timing_key(key: str) -> bool:
    return any(word in key.lower() for word in TIMING_WORDS)


def _unlabelled_timings(node, where: str):
    """Timing-like keys of every JSON object under ``node`` that its ``not_covered_by_epsilon`` does not list."""
    if isinstance(node, dict):
        labelled = set(node.get("not_covered_by_epsilon") or ())
        for key, value in node.items():
            if _timing_key(key) and key not in labelled and key != "created":
                yield f"{where}: {key}"
            yield from _unlabelled_timings(value, f"{where}.{key}")
    elif isinstance(node, list):
        for value in node:
            yield from _unlabelled_timings(value, where)


def _json_documents(run_dir: Path):
    for path in sorted(run_dir.rglob("*")):
        if path.suffix == ".json":
            yield path, json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text().splitlines(), 1):
                yield f"{path}:{number}", json.loads(line)


def _tensorboard_tags(run_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return events.Tags()["scalars"]


def _train(cli, tiny_recipe, tmp_path, exact: bool):
    recipe_file = tmp_path / "shared.yaml"
    recipe_file.write_text(recipe_to_yaml(tiny_recipe("logging.tensorboard=true",
                                                      f"privacy.exact_diagnostics={str(exact).lower()}")))
    result = cli("train", recipe_file)
    assert result.code == 0, result.err
    run_dir = next((tmp_path / "runs").iterdir())
    report = cli("report", run_dir)
    assert report.code == 0, report.err
    return run_dir, result.out + result.err + report.out + report.err


def test_without_exact_diagnostics_no_step_time_is_written_or_shown(cli, tiny_recipe, tmp_path):
    run_dir, console = _train(cli, tiny_recipe, tmp_path, exact=False)
    leaks = [leak for where, document in _json_documents(run_dir) for leak in _unlabelled_timings(document, where)]
    assert not leaks, leaks
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and all("seconds" not in record for record in records)
    tags = _tensorboard_tags(run_dir)
    assert "privacy/epsilon" in tags
    assert not [tag for tag in tags if _timing_key(tag)], tags
    # Nor between the events: each carries a wall time, which would time the steps.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    stamps = [(event.step, event.wall_time) for tag in tags for event in events.Scalars(tag)]
    assert stamps and all(wall_time == step for step, wall_time in stamps), stamps[:5]
    # The progress bar's time remaining (rich's h:mm:ss) is an average of the step times.
    assert "-:--:--" not in console and "0:00:0" not in console
    assert "remaining" not in console.lower()


def test_with_exact_diagnostics_each_step_time_is_labelled_not_covered(cli, tiny_recipe, tmp_path):
    run_dir, console = _train(cli, tiny_recipe, tmp_path, exact=True)
    leaks = [leak for where, document in _json_documents(run_dir) for leak in _unlabelled_timings(document, where)]
    assert not leaks, leaks
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "eval" not in record]
    assert steps and all(record["seconds"] >= 0 and "seconds" in record["not_covered_by_epsilon"] for record in steps)
    tags = _tensorboard_tags(run_dir)
    timing_tags = [tag for tag in tags if _timing_key(tag)]
    assert timing_tags and all(tag.startswith(NOT_COVERED_PREFIX) for tag in timing_tags), timing_tags
    assert "time remaining" in console


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
