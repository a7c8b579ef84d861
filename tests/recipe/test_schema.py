from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from dpclip.errors import RecipeError
from dpclip.recipe import load_recipe, recipe_to_yaml, validate_recipe
from dpclip.recipe import schema
from dpclip.recipe.docs import render_markdown, sections

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def error_of(overrides, path=QUICKSTART) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    assert info.value.hint, "every recipe error carries a hint"
    return info.value.message


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_validates_and_opens_with_a_comment(path):
    recipe = load_recipe(path)
    assert recipe.name
    assert path.read_text().startswith("#"), "each recipe opens with a comment on what it shows"


def test_shipped_recipes_exist():
    assert QUICKSTART in RECIPES


def test_unknown_threshold_kind_lists_the_allowed_kinds():
    message = error_of(["clipping.threshold.kind=dcsgd_x"])
    assert ("clipping.threshold.kind: 'dcsgd_x' is not one of fixed, quantile, dcsgd-p, dcsgd-e, discriminative"
            in message)


def test_unknown_key_names_its_path_and_suggests_the_close_one():
    message = error_of(["clipping.threshhold=1"])
    assert "clipping.threshhold: unknown key" in message
    assert "did you mean 'threshold'" in message


def test_unknown_key_inside_a_variant_lists_that_variants_keys():
    message = error_of(["clipping.threshold.kind=quantile", "clipping.threshold.value=3"])
    assert "clipping.threshold.value: unknown key" in message
    assert "target" in message and "budget_fraction" in message


def test_wrong_type_names_the_path_and_the_input():
    message = error_of(["training.batch_size=abc"])
    assert message.count("training.batch_size") == 1 and "'abc'" in message


def test_literal_field_lists_allowed_values():
    assert "clipping.fn: 'foo' is not one of abadi, auto" in error_of(["clipping.fn=foo"])


@pytest.mark.parametrize("grouping", ["all-layer", "layer", "param", "block", {"uniform": 3},
                                      {"groups": [["^fc1"], ["^fc2", "bias$"]]}, {"stages": ["^layer1", "^layer3"]}])
def test_every_grouping_form_is_accepted_and_dumps_unchanged(grouping):
    data = yaml.safe_load(QUICKSTART.read_text())
    data["clipping"]["grouping"] = grouping
    recipe = validate_recipe(data)
    assert recipe.clipping.model_dump()["grouping"] == grouping


@pytest.mark.parametrize("grouping, fragment", [
    ("blocks", "'blocks' is not one of all-layer"),
    ({"uniform": 0}, "M >= 1"),
    ({"uniform": 2.5}, "M >= 1"),
    ({"groups": []}, "non-empty list"),
    ({"groups": [["(unclosed"]]}, "not a valid regex"),
    ({"layers": 2}, "is not one of"),
    ({"uniform": 2, "stages": ["a"]}, "must be one of"),
])
def test_malformed_grouping_is_refused_with_the_forms_it_accepts(grouping, fragment):
    data = yaml.safe_load(QUICKSTART.read_text())
    data["clipping"]["grouping"] = grouping
    with pytest.raises(RecipeError) as info:
        validate_recipe(data)
    assert "clipping.grouping" in info.value.message and fragment in info.value.message


def test_clipping_block_dumps_to_the_engine_contract():
    dumped = load_recipe(QUICKSTART).clipping.model_dump()
    assert set(dumped) == {"grouping", "fn", "gamma", "noise_allocation", "threshold", "strict", "norm_method"}
    assert dumped["threshold"] == {"kind": "fixed", "value": 1.0}


@pytest.mark.parametrize(("grouping", "groups"), [("{uniform: 4}", 4), ("{groups: [[a], [b], [c]]}", 3)])
def test_histogram_noise_must_exceed_sqrt_k_times_the_total_noise_multiplier(grouping, groups):
    """K histograms of sensitivity √K: σ_T = (σ⁻² − K·σ_H⁻²)^(−1/2) needs σ_H > √K·σ. Above σ but not √K·σ
    passed the schema and was refused by the planner, naming an `aux_sigma` the recipe does not have."""
    sigma_hist = 0.99 * groups ** 0.5
    message = error_of([f"clipping.grouping={grouping}", "privacy.noise_multiplier=1.0",
                        f"clipping.threshold={{kind: dcsgd-p, sigma_hist: {sigma_hist}}}"])
    assert f"sigma_hist ({sigma_hist:g}) must exceed √K" in message and f"K = {groups}" in message
    assert load_recipe(QUICKSTART, [f"clipping.grouping={grouping}", "privacy.noise_multiplier=1.0",
                                     f"clipping.threshold={{kind: dcsgd-p, sigma_hist: {1.01 * groups ** 0.5}}}"])


def test_histogram_noise_must_exceed_the_total_noise_multiplier():
    message = error_of(["clipping.threshold={kind: dcsgd-p, sigma_hist: 0.8}", "privacy.noise_multiplier=1.0"])
    assert "sigma_hist (0.8) must exceed" in message


def test_histogram_noise_defaults_to_the_papers_five_and_excludes_budget_fraction():
    recipe = load_recipe(QUICKSTART, ["clipping.threshold={kind: dcsgd-e}"])
    assert recipe.clipping.threshold.sigma_hist == 5.0
    assert "at most one of" in error_of(["clipping.threshold={kind: dcsgd-e, sigma_hist: 5, budget_fraction: 0.1}"])


def test_quantile_defaults_to_one_percent_of_the_budget():
    recipe = load_recipe(QUICKSTART, ["clipping.threshold={kind: quantile}"])
    assert recipe.clipping.threshold.budget_fraction == 0.01 and recipe.clipping.threshold.sigma is None


def test_discriminative_large_defaults_to_ten_times_small():
    recipe = load_recipe(QUICKSTART, ["training.micro_batch_size=null",
                                      "clipping.threshold={kind: discriminative, small: 0.5, tail_rule: top_fraction}"])
    assert recipe.clipping.threshold.large == 5.0


@pytest.mark.parametrize("overrides, fragment", [
    (["training.steps=10"], "exactly one of 'epochs' or 'steps'"),
    (["privacy.epsilon=null"], "give 'epsilon'"),
    (["privacy.delta=1"], "privacy.delta"),
    (["privacy.epsilon=-1"], "privacy.epsilon"),
    (["privacy.epsilon=.inf"], "privacy.epsilon"),
    (["data.test_fraction=1.5"], "data.test_fraction"),
    (["data.source=web"], "data.source: 'web' is not one of builtin, hf, files"),
    (["training.optimizer={kind: sgd}"], "training.optimizer.lr: required field is missing"),
    (["model={kind: hf, task: causal-lm}"], "exactly one of 'config'"),
    (["model={kind: cnn}"], "data.as_images: true"),
    (["clipping.grouping={uniform: 2}", "clipping.threshold.value=[1, 2, 3]"], "3 thresholds for 2 uniform groups"),
    (["name=has space"], "name"),
])
def test_cross_field_and_range_rules(overrides, fragment):
    assert fragment in error_of(overrides)


def test_overrides_are_parsed_as_yaml_and_create_sections():
    recipe = load_recipe(QUICKSTART, ["training.optimizer.lr=0.05", "clipping.grouping={uniform: 2}",
                                      "eval.every_steps=10"])
    assert recipe.training.optimizer.lr == pytest.approx(0.05)
    assert recipe.clipping.grouping == {"uniform": 2}
    assert recipe.eval.every_steps == 10


@pytest.mark.parametrize("override", ["lr", "=3", "a..b=1", "training.optimizer.lr.x=1"])
def test_malformed_override_is_refused(override):
    with pytest.raises(RecipeError):
        load_recipe(QUICKSTART, [override])


@pytest.mark.parametrize("text, problem", [
    ("name: x\ntraining:\n  epochs: [1, 2\n", "line"),
    # YAML keeps the last of two equal keys: a second privacy.epsilon would go unnoticed
    ("name: x\nprivacy:\n  epsilon: 1\n  delta: 1.0e-5\n  epsilon: 8\n", "line 5, column 3: key 'epsilon' is given twice"),
    # a list as a key: the duplicate-key check once crashed on it (TypeError: unhashable type)
    ("name: x\n? [a, b]\n: 1\n", "unhashable key"),
], ids=["unclosed list", "a key given twice", "a list as a key"])
def test_bad_yaml_reports_the_line(tmp_path, text, problem):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(bad)
    assert "not valid YAML" in info.value.message and problem in info.value.message


def test_yaml_merge_keys_are_read_and_may_be_overridden_in_the_mapping_that_merges(tmp_path):
    # `<<: *anchor` is YAML's own way to share settings; the loader that refuses a key given twice
    # once read the merge key as an unknown tag ("could not determine a constructor")
    path = tmp_path / "r.yaml"
    path.write_text(QUICKSTART.read_text().replace("optimizer: {kind: sgd, lr: 0.5, momentum: 0.0}",
                                                   "optimizer: {<<: {kind: sgd, lr: 0.5, momentum: 0.0}, lr: 0.25}"))
    assert load_recipe(path).training.optimizer.lr == 0.25


@pytest.mark.parametrize("override", [None, "name=" + "[" * 5000, "name=" + "[" * 5000 + "]" * 5000,
                                      "a" + ".b" * 3000 + "=1"])
def test_yaml_nested_too_deeply_is_a_recipe_error_not_a_crash(tmp_path, override):
    path = tmp_path / "deep.yaml"
    path.write_text(QUICKSTART.read_text() if override else "name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path, [override] if override else [])
    assert "nested too deeply" in info.value.message and "brackets" in info.value.hint


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "42\n"])
def test_a_recipe_must_be_a_mapping(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError):
        load_recipe(path)


def test_missing_file_points_to_the_shipped_recipe_of_that_name(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "quickstart.yaml")
    assert "not found" in info.value.message and "recipes copy quickstart" in info.value.hint


def test_missing_recipes_path_outside_the_repository_does_not_suggest_the_same_path(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "recipes" / "quickstart.yaml")   # the README's command, run from another folder
    hint = info.value.hint
    assert "use recipes/quickstart.yaml" not in hint
    assert "run from its root" in hint and "dpclip recipes copy quickstart ." in hint and "quickstart.yaml" in hint


def test_resolved_recipe_round_trips_through_yaml():
    recipe = load_recipe(QUICKSTART, ["clipping.threshold={kind: quantile, target: 0.7}"])
    again = validate_recipe(yaml.safe_load(recipe_to_yaml(recipe)))
    assert again == recipe


def test_docs_recipes_md_is_generated_from_the_current_schema():
    assert (REPO / "docs" / "recipes.md").read_text() == render_markdown(), \
        "regenerate: python -m dpclip.recipe.docs > docs/recipes.md"


def _reachable_models(model, seen):
    import typing

    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            annotation = stack.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                _reachable_models(annotation, seen)
            stack.extend(typing.get_args(annotation))


def test_every_schema_section_is_documented():
    seen: set = set()
    _reachable_models(schema.Recipe, seen)
    missing = {m.__name__ for m in seen} - {model.__name__ for _, model, _ in sections()}
    assert not missing, f"add these sections to dpclip/recipe/docs.py SECTIONS: {missing}"


@pytest.mark.parametrize("overrides, says", [
    (["training.parallel=fsdp"], "training.parallel 'fsdp'"),
    (["training.precision=bf16"], "training.precision: fp32"),
    (["training.micro_batch_size=null",
      "clipping.threshold={kind: discriminative, small: 0.5, large: 2.0, tail_rule: top_fraction}"], "compile"),
])
def test_training_compile_refuses_what_one_float32_graph_per_process_cannot_run(overrides, says):
    assert says in error_of(["training.compile=true", *overrides])


def test_training_compile_is_off_unless_asked_and_implies_fixed_shapes():
    from dpclip.train.parts import assemble_for_timing

    assert load_recipe(QUICKSTART).training.compile is False
    parts = assemble_for_timing(load_recipe(QUICKSTART, ["training.compile=true"]), steps=2)
    step = parts.learner.private_step
    assert step.compiled is not None and step.fixed_rows
    parts.learner.engine.detach()


@pytest.mark.parametrize("override", ["training.batch_size=true", "privacy.epsilon=false", "name=true"])
def test_a_boolean_where_a_number_or_name_is_meant_is_refused_not_read_as_one(override):
    field, _, value = override.partition("=")
    assert f"{field}: expected a number or a name, not the boolean {value}" in error_of([override])


@pytest.mark.parametrize("override, field", [
    ("clipping.threshold.value=true", "clipping.threshold.value"),          # C = 1.0, silently
    ("clipping.threshold={kind: quantile, target: true}", "clipping.threshold.target"),
    ("model.hidden=[64, true]", "model.hidden"),                            # a hidden layer of 1 unit
    ("clipping.threshold.value=[1.0, false, 1.0]", "clipping.threshold.value"),
])
def test_a_boolean_in_a_threshold_spec_or_a_list_of_numbers_is_refused_not_read_as_one(override, field):
    assert f"{field}: expected a number or a name, not the boolean" in error_of([override])


def test_boolean_fields_still_take_booleans():
    assert load_recipe(QUICKSTART, ["training.compile=true"]).training.compile is True


@pytest.mark.parametrize("field, extra", [
    ("label_field", {}),
    ("text_field", {"label_field": "label"}),
    ("feature_fields", {"label_field": "label"}),
])
def test_the_user_column_cannot_be_what_the_model_reads_or_predicts(field, extra):
    """A user id as the label trains a model whose label names list every person."""
    data = {"source": "files", "format": "csv", "train": "people.csv", "user_field": "patient",
            "max_examples_per_user": 3, **extra,
            field: ["x", "patient"] if field == "feature_fields" else "patient"}
    recipe = {"name": "u", "data": data, "model": {"kind": "mlp"},
              "training": {"batch_size": 8, "epochs": 1, "optimizer": {"kind": "sgd", "lr": 0.1}},
              "privacy": {"epsilon": 8.0, "delta": 1e-3, "unit": "user"}}
    with pytest.raises(RecipeError, match="user") as info:
        validate_recipe(recipe)
    assert "patient" in info.value.message and info.value.hint


@pytest.mark.parametrize("law", ["poisson", "truncated-negative-binomial"])
def test_a_search_expecting_more_trials_than_it_can_train_is_refused_at_the_recipe(law):
    """E[K] in the millions: the search would train that many runs, and the draw of K stops counting
    at 10⁷ (a law cut there, which the repeat-and-select bound does not describe)."""
    from dpclip.recipe.tuning import Tuning

    assert Tuning(trials=law, trials_mean=10_000).trials_mean == 10_000
    with pytest.raises(ValueError, match="trials_mean.*at most 10,000"):
        Tuning(trials=law, trials_mean=5e6)
