"""RunDir: the one home of run and search directory names, files and loaders."""

from __future__ import annotations

import re

import pytest

from dpclip.errors import DpclipError
from dpclip.rundir.run import RunDir
from dpclip.train.workflow import train


def test_new_runs_of_one_recipe_get_distinct_timestamped_names(quickstart):
    recipe = quickstart()
    first = RunDir.new_run(recipe)
    assert str(first.path.parent) == str(recipe.output_dir)
    assert re.fullmatch(r"quickstart-\d{8}-\d{6}", first.path.name)
    first.path.mkdir(parents=True)
    second = RunDir.new_run(recipe)
    assert second.path != first.path
    second.path.mkdir()
    third = RunDir.new_run(recipe)
    assert len({first.path, second.path, third.path}) == 3
    assert not third.path.exists()  # a name only: nothing is created


def test_a_search_directory_is_named_after_the_recipe_and_marked_search(tmp_path):
    search = RunDir.new_search(tmp_path, "quickstart")
    assert re.fullmatch(r"quickstart-search-\d{8}-\d{6}", search.path.name)
    assert search.search_runs == search.path / "runs"


def test_a_finished_run_has_every_well_known_file_and_they_load(small_recipe):
    recipe = small_recipe("training.steps=2", "eval.every_steps=null")
    run = RunDir(train(recipe).run_dir)
    for path in (run.recipe_file, run.meta_file, run.ledger_file, run.metrics_file, run.summary_file):
        assert path.is_file(), path
    assert run.checkpoints.is_dir()
    assert run.recipe().model_dump() == recipe.model_dump()
    assert run.ledger().steps == 2
    assert run.meta()["plan"]["steps"] == 2
    assert run.summary()["steps_done"] == 2
    assert not run.search_marker.exists()  # not selected by a search


def test_a_folder_that_is_not_a_run_is_refused_by_name(tmp_path):
    with pytest.raises(DpclipError, match="not a dpclip run directory"):
        RunDir(tmp_path).recipe()
    with pytest.raises(DpclipError, match="no meta.json"):
        RunDir(tmp_path).meta()


def test_a_run_folder_left_empty_by_a_kill_in_its_first_second_says_it_spent_nothing(tmp_path):
    with pytest.raises(DpclipError) as info:
        RunDir(tmp_path).recipe()
    assert "took no step and spent nothing" in info.value.hint
    (tmp_path / "ledger.json").write_text("{}")      # a run that did take steps: no such advice
    with pytest.raises(DpclipError) as info:
        RunDir(tmp_path).recipe()
    assert "spent nothing" not in info.value.hint


def test_a_removed_ledger_of_a_run_with_checkpoints_is_told_to_be_restored(small_recipe):
    from dpclip.rundir.run import spent

    run = train(small_recipe()).run_dir
    (run / "ledger.json").unlink()
    with pytest.raises(DpclipError) as info:
        spent(run)
    assert "restore ledger.json" in info.value.hint


@pytest.mark.parametrize("name", ["meta.json", "summary.json"])
def test_a_damaged_meta_or_summary_is_named_with_a_hint(tmp_path, name):
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    (tmp_path / name).write_text('{"plan": {"steps": 3')       # cut short
    run = RunDir(tmp_path)
    with pytest.raises(DpclipError) as info:
        run.meta() if name == "meta.json" else run.summary()
    assert name in info.value.message and "damaged" in info.value.message and "backup" in info.value.hint


@pytest.mark.parametrize("text", ["[1]", '{"privacy_fingerprint": "ab'])
def test_a_damaged_plan_json_is_named_with_a_hint_not_a_crash(tmp_path, text):
    # plan.json holding a list once crashed every reader (AttributeError: 'list' object has no attribute 'get')
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(DpclipError) as info:
        RunDir(tmp_path).public_plan()
    assert "plan.json" in info.value.message and "damaged" in info.value.message and "backup" in info.value.hint


def test_a_ledger_whose_step_count_was_edited_is_refused_before_its_steps_are_walked(tmp_path):
    # an edited count of 10^30 was walked step by step: `dpclip account RUN` never returned
    import dp_accounting

    from dpclip.accounting import Ledger
    from dpclip.rundir.run import check_ledger

    class Unwalked:
        def event_at(self, step):
            raise AssertionError("the steps of a ledger with the wrong count were walked")

    ledger = Ledger(1e-5)
    ledger.record(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), count=10**30)
    with pytest.raises(DpclipError) as info:
        check_ledger(ledger, Unwalked(), range(0, 4), where=tmp_path / "ledger.json")
    assert f"records {10**30} steps where the run allows 0 to 3" in info.value.message


@pytest.mark.parametrize("value", ["0", "-2", "1000000000", "true", "2.0", '"4"', "null"])
def test_a_hand_edited_world_size_in_plan_json_is_refused_with_a_hint(tmp_path, value):
    # 10**9 processes once went into the statement ("data parallel over 1000000000 processes") unchecked
    from dpclip.rundir.run import recorded_world_size

    (tmp_path / "recipe.yaml").write_text("name: x\n")
    (tmp_path / "plan.json").write_text('{"world_size": %s}' % value)
    with pytest.raises(DpclipError) as info:
        recorded_world_size(tmp_path)
    assert "world_size" in info.value.message and "plan.json" in info.value.hint


def test_a_recorded_world_size_within_bounds_is_read_back(tmp_path):
    from dpclip.rundir.run import recorded_world_size

    (tmp_path / "recipe.yaml").write_text("name: x\n")
    (tmp_path / "plan.json").write_text('{"world_size": 8}')
    assert recorded_world_size(tmp_path) == 8


@pytest.mark.parametrize("value", ["90.5", '"90"', "true", "0", "-3"])
def test_a_hand_edited_count_of_people_in_plan_json_is_refused_with_a_hint(tmp_path, value):
    # 90.5 once re-solved the plan at int(90.5) = 90 people, passed the ledger check, and the statement
    # said "user-level (90.5 people, ...)"
    from dpclip.rundir.run import recorded_count

    (tmp_path / "recipe.yaml").write_text("name: x\n")
    (tmp_path / "plan.json").write_text('{"num_train": 355, "num_users": %s}' % value)
    with pytest.raises(DpclipError) as info:
        recorded_count(tmp_path, "num_users")
    assert "num_users" in info.value.message and "plan.json" in info.value.hint
    (tmp_path / "plan.json").write_text('{"num_train": 355, "num_users": 90}')
    assert recorded_count(tmp_path, "num_users") == 90 and recorded_count(tmp_path, "num_train") == 355
