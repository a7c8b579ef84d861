"""`dpclip train` with privacy.unit: user (docs/users.md): people are sampled, the ledger
charges the user-level event exactly as dp_accounting does, every statement says "per
person", and what cannot run yet is refused with a hint before any private step."""

from __future__ import annotations

import json

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from dpclip.accounting import Ledger
from dpclip.accounting.accountants import account
from dpclip.data import load_data
from dpclip.errors import DpclipError, RecipeError
from dpclip.planning.plan import USER_RECORD_COUNT, not_covered
from dpclip.recipe import load_recipe
from dpclip.rundir.run import spent
from dpclip.train.workflow import train
from tests.conftest import REPO

SMALL = ["data.num_examples=300", "data.num_users=60", "data.max_length=24", "training.epochs=null",
         "training.steps=6", "training.batch_size=8", "training.micro_batch_size=32", "eval.every_steps=null",
         "model.config={model_type: gpt2, n_layer: 2, n_embd: 16, n_head: 2, n_positions: 24}"]


@pytest.fixture
def user_recipe(tmp_path):
    def make(*overrides):
        return load_recipe(REPO / "recipes" / "user-text.yaml", [f"output_dir={tmp_path / 'runs'}", *SMALL, *overrides])
    return make


def test_a_user_level_run_charges_the_user_level_event_and_says_per_person(user_recipe):
    recipe = user_recipe("privacy.epsilon=null", "privacy.noise_multiplier=1.5")
    people = load_data(recipe.data, recipe.seed).num_users
    result = train(recipe)
    ledger = Ledger.from_dict(json.loads((result.run_dir / "ledger.json").read_text()))
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(8 / people, dp_accounting.GaussianDpEvent(1.5)), 6)
    assert ledger.composed_event() == event
    interval = account(event, 1e-5, "pld").pld_interval
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval).compose(event)
    assert ledger.epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    _, statement = spent(result.run_dir)
    assert statement.unit == f"user-level ({people} people, at most 8 records of a person in a step)"
    assert statement.neighbouring == "add/remove all records of one person"
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert any("user-level" in line for line in summary["statement"])
    # the record count moves with a person's records: named outside ε
    assert any(USER_RECORD_COUNT in line for line in summary["statement"])
    assert json.loads((result.run_dir / "plan.json").read_text())["num_users"] == people


def test_only_a_user_level_recipe_names_its_record_count_not_covered(user_recipe):
    assert USER_RECORD_COUNT in not_covered(user_recipe())
    assert USER_RECORD_COUNT not in not_covered(load_recipe(REPO / "recipes" / "quickstart.yaml"))


def test_train_and_test_hold_different_people(user_recipe):
    recipe = user_recipe()
    data = load_data(recipe.data, recipe.seed)
    from dpclip.data.builtin import synthetic_user_sentences
    _, authors = synthetic_user_sentences(300, 60, recipe.seed)
    train_people, test_people = set(authors[data.train_indices]), set(authors[data.test_indices])
    assert train_people and test_people and not train_people & test_people
    assert data.num_users == len(train_people) and len(data.train_users) == data.num_train


def test_the_top_fraction_rule_at_the_user_level_noises_for_k_rows_pushed_out(user_recipe):
    """A person brings up to k = 8 rows: the engine noises for large + 8·(large − small)
    (dpclip/engine/policies/discriminative.py), not the 2·large − small of one record."""
    from dpclip.train.parts import assemble

    parts = assemble(user_recipe("clipping.threshold={kind: discriminative, small: 0.5, large: 2.0, "
                                 "tail_rule: top_fraction, top_fraction: 0.25}", "training.micro_batch_size=null"))
    bound = float(parts.learner.engine.policy.sensitivity_thresholds().double().norm())
    assert bound == pytest.approx(2.0 + 8 * (2.0 - 0.5))
    parts.learner.engine.detach()


@pytest.mark.parametrize("overrides, message", [
    (["privacy.unit=user"], "needs to know who wrote each record"),
    (["privacy.unit=user", "data={source: builtin, name: synthetic-users}"], "max_examples_per_user"),
    (["data.max_examples_per_user=4"], "belong to user-level privacy"),
    (["privacy.unit=user", "data={source: builtin, name: synthetic-users, max_examples_per_user: 0}"], "greater than"),
])
def test_user_level_recipes_without_users_or_k_are_refused(quickstart, overrides, message):
    with pytest.raises(RecipeError, match=message):
        quickstart(*overrides)


def test_a_user_field_names_the_person_and_is_never_a_feature(tmp_path):
    table = tmp_path / "visits.csv"
    table.write_text("patient,age,label\n" + "".join(f"p{i % 7},{i},{i % 2}\n" for i in range(40)))
    config = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path}", f"data={{source: files, format: csv, train: {table}, label_field: label, "
        "user_field: patient, max_examples_per_user: 3}", "privacy.unit=user"]).data
    data = load_data(config, 0)
    assert data.input_shape == (1,)   # age only: the patient column is not an input
    assert data.num_users == 6 and len(data.train_users) == data.num_train   # 7 patients, 1 in the test set


@pytest.mark.parametrize("content, message", [
    ("age,label\n1,0\n2,1\n", "user"),
    ("patient,age,label\np1,1,0\n,2,1\np2,3,0\n", "rows have no 'patient'"),
])
def test_a_missing_or_partly_missing_user_field_is_refused(tmp_path, content, message):
    table = tmp_path / "visits.csv"
    table.write_text(content)
    config = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path}", f"data={{source: files, format: csv, train: {table}, label_field: label, "
        "user_field: patient, max_examples_per_user: 3, test_fraction: 0.3}", "privacy.unit=user"]).data
    with pytest.raises(DpclipError, match=message) as caught:
        load_data(config, 0)
    assert caught.value.hint


@pytest.mark.slow
def test_a_user_level_audit_attacks_people_with_loss_and_lira(user_recipe):
    from dpclip.audit.report import audit

    recipe = user_recipe()
    result = train(recipe)
    report = audit(result.run_dir, ["loss"], bootstrap=10, write=False)
    data = load_data(recipe.data, recipe.seed)
    loss = report["attacks"]["loss"]
    assert report["unit"] == "user"
    assert loss["members"] == data.num_users and loss["non_members"] == len(set(data.test_users.tolist()))
    lira = audit(result.run_dir, ["lira"], shadows=2, bootstrap=10, write=False)
    for variant in ("lira-online", "lira-offline"):
        assert lira["attacks"][variant]["members"] == loss["members"]
        assert lira["attacks"][variant]["non_members"] == loss["non_members"]
    keep = json.loads((result.run_dir / "audit" / "shadows" / "keep.json").read_text())
    assert keep["unit"] == "people"
    people = len(set(data.train_users.tolist()) | set(data.test_users.tolist()))
    for row, plan, shadow in zip(keep["keep"], keep["shadows"], lira["lira_shadows"]["shadows"]):
        assert len(row) == people and shadow["num_users"] == plan["num_users"] == sum(row)
        assert shadow["sample_rate"] == pytest.approx(plan["batch_size"] / sum(row))
        assert abs(shadow["sample_rate"] - lira["lira_shadows"]["target"]["sample_rate"]) <= 0.5 / sum(row)


@pytest.mark.slow
@pytest.mark.parametrize("mechanism, groups", [("{kind: banded-mf, bands: 3}", 3), ("{kind: blt, buffers: 2}", None)])
def test_correlated_noise_samples_people_in_turn(user_recipe, mechanism, groups):
    """Banded MF and BLT over people: each person's group is drawn privately, and a person is only
    ever in the steps of their group's turn; the ledger charges ⌈T/G⌉ participations."""
    from dpclip.data.user_sampler import UserPoissonSampler
    from dpclip.train.parts import assemble

    recipe = user_recipe(f"privacy.mechanism={mechanism}", "training.steps=12")
    parts = assemble(recipe)
    parts.learner.engine.detach()
    sampler, users = parts.feed.sampler, parts.feed.data.train_users
    assert isinstance(sampler, UserPoissonSampler)
    groups = groups or parts.setting.plan.groups
    assert sampler.groups == groups > 1
    group_of = sampler.group_of.clone()
    assert len(set(group_of.tolist())) > 1
    for step, batch in enumerate(sampler):
        assert bool((group_of[users[batch]] == step % groups).all())
    result = train(recipe)
    ledger, statement = spent(result.run_dir)
    charged = sum(e.count for e in ledger.entries if not isinstance(e.event, dp_accounting.NoOpDpEvent))
    assert charged == -(-12 // groups)
    assert any("each person's group drawn privately" in line for line in statement.lines())


@pytest.mark.slow
def test_a_continual_run_charges_its_private_steps_per_person(user_recipe):
    recipe = user_recipe("data.max_length=80", "model.config.n_positions=80",
                         "public={source: builtin, name: synthetic-text, num_examples: 200, max_length: 80}",
                         "continual={switch: {rule: step, at_step: 3}}")
    result = train(recipe)
    ledger, statement = spent(result.run_dir)
    assert ledger.steps == 6 and statement.unit.startswith("user-level")


@pytest.mark.slow
@pytest.mark.parametrize("threshold", ["{kind: quantile, target: 0.5, lr: 0.3, budget_fraction: 0.01, initial: 1.0}",
                                       "{kind: dcsgd-p, percentile: 0.5, bins: 20, sigma_hist: 5.0, initial: 1.0, "
                                       "range: 1.0}",
                                       "{kind: discriminative, small: 0.5, large: 2.0, tail_rule: threshold, "
                                       "tail_threshold: 4.0}"])
def test_adaptive_thresholds_count_people_and_charge_the_joint_event(user_recipe, threshold):
    from dpclip.accounting import solve
    from dpclip.planning.plan import privacy_plan

    recipe = user_recipe(f"clipping.threshold={threshold}")
    result = train(recipe)
    ledger, statement = spent(result.run_dir)
    groups = len(json.loads((result.run_dir / "plan.json").read_text())["groups"])
    people = load_data(recipe.data, recipe.seed).num_users
    sigma = solve(privacy_plan(recipe, people, groups=groups)).split.noise_multiplier
    event = dp_accounting.PoissonSampledDpEvent(8 / people, dp_accounting.GaussianDpEvent(sigma))
    assert ledger.composed_event() == dp_accounting.SelfComposedDpEvent(event, 6)
    assert statement.unit.startswith("user-level")
    assert (statement.sigma_aux is not None) == ("discriminative" not in threshold)   # it releases nothing


@pytest.mark.slow
def test_tune_cost_of_a_user_level_recipe_counts_people(tmp_path):
    from dpclip.recipe import apply_overrides, read_yaml, validate_recipe
    from dpclip.tuning.cost import StepTimer, tune_cost

    base = apply_overrides(read_yaml(REPO / "recipes" / "user-text.yaml"), [f"output_dir={tmp_path}", *SMALL])
    recipe = validate_recipe(base)
    report = tune_cost(base, recipe, grid=["training.optimizer.lr=0.01,0.02"], timer=StepTimer(fixed_seconds=0.01))
    people = load_data(recipe.data, recipe.seed).num_users
    assert report.dataset_size == people and report.plan.sample_rate == pytest.approx(8 / people)


def _digit_people(tmp_path, people: int = 300):
    """Digits as a table whose rows belong to ``people`` people (row i to person i mod people)."""
    from dpclip.data.builtin import load_digits_arrays

    features, labels = load_digits_arrays(False)
    table = tmp_path / "digits.csv"
    names = [f"x{j}" for j in range(features.shape[1])]
    rows = [",".join(f"{v:.4f}" for v in row) + f",{y},p{i % people}" for i, (row, y) in enumerate(zip(features, labels))]
    table.write_text(",".join(names) + ",label,person\n" + "\n".join(rows) + "\n")
    return table


@pytest.mark.slow
def test_canary_people_go_in_whole_and_the_one_run_audit_guesses_people(tmp_path):
    """Each canary is a new person of k records that all go in or stay out together; the one-run
    audit scores a canary person by their records' mean and charges nothing to N."""
    from dpclip.audit.report import audit
    from dpclip.data.canaries import make_canaries, with_canaries

    table = _digit_people(tmp_path)
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'runs'}", f"data={{source: files, format: csv, train: {table}, label_field: label, "
        "user_field: person, max_examples_per_user: 3}", "privacy.unit=user", "training.epochs=null",
        "training.steps=10", "training.batch_size=32", "eval.every_steps=null",
        "audit={canaries: {count: 20, kind: ood, domain: [0.0, 1.0]}}"])
    data = load_data(recipe.data, recipe.seed)
    canaries = make_canaries(data, recipe.audit.canaries, recipe.seed, records=3)
    assert canaries.records == 3 and len(canaries.tensors["labels"]) == 60
    assert all(len(set(canaries.tensors["labels"][3 * j:3 * j + 3].tolist())) == 1 for j in range(20))
    joined = with_canaries(data, canaries)
    added = joined.train_users[data.num_train:]
    assert len(added) == 3 * int(canaries.included.sum())
    assert int(added.min()) == data.num_users and len(set(added.tolist())) == int(canaries.included.sum())
    result = train(recipe)
    ledger, statement = spent(result.run_dir)
    q = 32 / data.num_users   # N counts the ordinary people only
    assert ledger.composed_event().event.sampling_probability == pytest.approx(q)
    report = audit(result.run_dir, ["one-run", "logistic"], bootstrap=10, write=False)
    assert report["one_run"]["canaries"] == 20   # people, not their 60 records
    scored = report["attacks"]["logistic"]
    assert scored["features"] == 11   # the 10 mean logits and the mean loss of each person
    assert scored["members"] + scored["non_members"] <= data.num_users + len(set(data.test_users.tolist()))
    # the run drew its own canaries (OS entropy): the audit rebuilt them from its stored seed
    secret = json.loads((result.run_dir / "audit" / "canaries.json").read_text())
    assert report["one_run"]["included"] == sum(secret["included"]) and secret["records"] == 3
    assert 0.0 <= report["one_run"]["epsilon_lower_bound"] <= ledger.epsilon()


def test_a_jsonl_user_column_naming_one_person_as_7_and_7_0_is_refused(tmp_path):
    """Written out as text, 7 and 7.0 were two people ("7", "7.0") and '7' and 7 one: the user
    column now refuses ids whose value and spelling disagree, as make_private does."""
    rows = [{"patient": person, "age": i, "label": i % 2} for i, person in enumerate(["p", 7, "q", 7.0, "p", "q"] * 3)]
    table = tmp_path / "visits.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path}", f"data={{source: files, format: jsonl, train: {table}, label_field: label, "
        "user_field: patient, max_examples_per_user: 3}", "privacy.unit=user"]).data
    with pytest.raises(DpclipError, match="row 4") as caught:
        load_data(config, 0)
    assert caught.value.hint


@pytest.mark.parametrize("lookalike, first", [("Alice", "alice"), (" p1", "p1"), ("p1 ", "p1")])
def test_a_csv_user_column_with_ids_differing_only_in_case_or_spaces_is_refused(tmp_path, lookalike, first):
    table = tmp_path / "visits.csv"
    people = [first, "p2", "p3", lookalike] + ["p2", "p3"] * 4
    table.write_text("patient,age,label\n" + "".join(f"{p},{i},{i % 2}\n" for i, p in enumerate(people)))
    config = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path}", f"data={{source: files, format: csv, train: {table}, label_field: label, "
        "user_field: patient, max_examples_per_user: 3}", "privacy.unit=user"]).data
    with pytest.raises(DpclipError, match="row 4 names its 'patient'") as caught:
        load_data(config, 0)
    assert repr(lookalike) in caught.value.message and "case or surrounding spaces" in caught.value.message
    assert caught.value.hint


def test_csv_user_ids_are_read_as_written_so_007_and_7_are_two_people(tmp_path):
    """pandas read the column as numbers: patients "007" and "7" (and "7.0") were one person, so
    removing one moved the other's unit (replace-one, not the add/remove the statement claims)."""
    table = tmp_path / "visits.csv"
    table.write_text("patient,age,label\n" + "".join(f"{p},{i},{i % 2}\n" for i, p in
                                                      enumerate(["007", "7", "7.0", "8"] * 5)))
    config = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path}", f"data={{source: files, format: csv, train: {table}, label_field: label, "
        "user_field: patient, max_examples_per_user: 3, test_fraction: 0.25}", "privacy.unit=user"]).data
    data = load_data(config, 0)
    assert data.num_users == 3 and len(data.train_users) == 15   # 4 patients, 1 held out with their 5 visits
    assert data.input_shape == (1,)


def _visits(path, people):
    """A csv of 40 visits, visit i by ``people[i]``, with one feature and a label."""
    path.write_text("patient,age,label\n" + "".join(f"{p},{i},{i % 2}\n" for i, p in enumerate(people)))


def _visits_run(tmp_path):
    """A finished user-level run on 40 visits of 10 patients (visit i by patient i mod 10), and its csv."""
    table, people = tmp_path / "visits.csv", [f"p{i % 10}" for i in range(40)]
    _visits(table, people)
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'runs'}", f"data={{source: files, format: csv, train: {table}, label_field: label, "
        "user_field: patient, max_examples_per_user: 3, test_fraction: 0.3}", "privacy.unit=user",
        "model={kind: mlp, hidden: [4]}", "training.epochs=null", "training.steps=2", "training.batch_size=4",
        "eval.every_steps=null"])
    return train(recipe).run_dir, table, people


def _move_visits_between_two_training_patients(run_dir, table, people):
    """Two training patients swap one later visit each: the same rows, the same people, the same
    split, each patient as many visits; only who wrote two of the rows differs."""
    members = json.loads((run_dir / "meta.json").read_text())["members"]
    first = next(i for i in members if i >= 10)
    second = next(i for i in members if i >= 10 and people[i] != people[first])
    moved = list(people)
    moved[first], moved[second] = people[second], people[first]
    _visits(table, moved)


def test_a_resume_refuses_records_moved_between_people(tmp_path):
    """The content fingerprint hashes the rows, not who wrote them: a user column edited so that
    records change hands was resumed, and the unit of privacy changed mid-run."""
    run_dir, table, people = _visits_run(tmp_path)
    _move_visits_between_two_training_patients(run_dir, table, people)
    with pytest.raises(DpclipError, match="who wrote") as caught:
        train(resume=run_dir)
    assert caught.value.hint and "user_field" in caught.value.hint


def test_a_user_level_run_from_before_the_people_were_fingerprinted_resumes_and_is_checked_from_then_on(tmp_path):
    run_dir, table, people = _visits_run(tmp_path)
    meta_file = run_dir / "meta.json"
    meta = json.loads(meta_file.read_text())
    fingerprint = meta["data"].pop("users_fingerprint")
    meta_file.write_text(json.dumps(meta))
    train(resume=run_dir)
    assert json.loads(meta_file.read_text())["data"]["users_fingerprint"] == fingerprint
    _move_visits_between_two_training_patients(run_dir, table, people)
    with pytest.raises(DpclipError, match="who wrote"):
        train(resume=run_dir)


def test_a_resume_on_data_with_a_person_added_is_refused_as_changed_data_not_as_a_modified_run(tmp_path):
    """One more person moves N, so q and the plan's step event: the data check must come first, or
    the refusal blames the run directory ("restore it") for an edit to the data."""
    run_dir, table, people = _visits_run(tmp_path)
    _visits(table, people + ["p10"] * 4)
    with pytest.raises(DpclipError, match="data of .* changed") as caught:
        train(resume=run_dir)
    assert "data files" in caught.value.hint


@pytest.mark.slow
def test_the_sample_schedules_weight_counts_people_not_records(user_recipe):
    """α = n_pub/(n_pub + n_priv) goes into every mixed step's weights (and metrics.jsonl): n_priv is
    the people, whose count the plan treats as public, never the records, whose count moves with
    one person's records (docs/continual.md)."""
    import torch

    from dpclip.train.parts import assemble
    from dpclip.train.phases import sample_alpha

    recipe = user_recipe("data.max_length=80", "model.config.n_positions=80",
                         "public={source: builtin, name: synthetic-text, num_examples: 200, max_length: 80}",
                         "continual={schedule: sample}")
    parts = assemble(recipe)
    continual, data = parts.feed.continual, parts.feed.ordinary
    assert data.num_users == parts.setting.plan.users < data.num_train
    # the mixing weight alone: a stand-in private step (nothing is drawn, released or charged here)
    continual.private_step = lambda indices, before_update=None: None
    continual.step_fn(0, torch.arange(0))
    assert continual.alpha == sample_alpha(continual.public.num_train, data.num_users)
