"""scripts/recipe_results.py: the results table it writes (on fake runs), and that every shipped
recipe states a measured result (its '# reaches' line and its row in docs/results.md)."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script(load_script):
    yield load_script("recipe_results")
    sys.modules.pop("recipe_results", None)


def _runs(script, metric, values):
    return [script.Run(metric, value, 7.95, 1e-5, 450, 40.0 + i) for i, value in enumerate(values)]


def test_summary_gives_median_and_range_of_accuracy_over_seeds(script):
    row = script.summarize("cnn-layer", _runs(script, "accuracy", [0.91, 0.95, 0.93]), "2 CPUs, 1 torch thread")
    assert row.median == "93.0% test accuracy"
    assert row.spread == "91.0–95.0%"
    assert row.seeds == "3" and row.steps == "450" and row.seconds == "41 s"
    assert row.epsilon == "7.95 (1e-05)"


def test_summary_of_a_language_model_reports_perplexity(script):
    row = script.summarize("gpt2-tiny-text", _runs(script, "perplexity", [5.5, 5.25, 6.0]), "m")
    assert row.median == "5.50 test perplexity"
    assert row.spread == "5.25–6.00"


def test_one_seed_gives_one_value_not_a_range(script):
    row = script.summarize("quickstart", _runs(script, "accuracy", [0.9415]), "m")
    assert row.spread == "94.2%" and row.seeds == "1"
    assert script.reaches_line(row, 8.0) == (
        "# reaches 94.2% test accuracy at ε = 8 (1 seed; held-out, not covered by ε: docs/results.md)")


def test_reaches_line_is_built_from_the_row(script):
    row = script.summarize("cnn-layer", _runs(script, "accuracy", [0.91, 0.95, 0.93]), "m")
    line = script.reaches_line(row, 8.0)
    assert line == (
        "# reaches 91.0–95.0% test accuracy at ε = 8 (3 seeds; held-out, not covered by ε: docs/results.md)")


def test_reaches_line_replaces_the_old_one_or_follows_the_header_comment(script):
    recipe = "# what it shows\n# more\nname: x\n"
    added = script.set_reaches_line(recipe, "# reaches 1–2% test accuracy at ε = 8")
    assert added == "# what it shows\n# more\n# reaches 1–2% test accuracy at ε = 8\nname: x\n"
    replaced = script.set_reaches_line(added, "# reaches 3–4% test accuracy at ε = 8")
    assert replaced.count("# reaches ") == 1 and "3–4%" in replaced


def test_page_gets_a_generated_table_between_markers(script):
    rows = {"b": script.summarize("b", _runs(script, "accuracy", [0.5]), "m"),
            "a": script.summarize("a", _runs(script, "accuracy", [0.6]), "m")}
    page = script.update_page("# Results\n\nIntro.\n", rows, "python scripts/recipe_results.py", keep_others=False)
    assert page.startswith("# Results\n\nIntro.\n")
    block = page.split(script.BEGIN, 1)[1].split(script.END, 1)[0]
    assert block.index("| `a` |") < block.index("| `b` |")
    assert "`python scripts/recipe_results.py`" in block
    parsed, commands = script.parse_block(page)
    assert parsed == rows and commands == ["`python scripts/recipe_results.py`"]


def test_updating_some_recipes_keeps_the_other_rows_and_the_text_around(script):
    first = {name: script.summarize(name, _runs(script, "accuracy", [0.5]), "m") for name in ("a", "b")}
    page = script.update_page("# Results\n", first, "python scripts/recipe_results.py", keep_others=False)
    page += "\nText after the table.\n"
    new_b = script.summarize("b", _runs(script, "accuracy", [0.9, 0.8]), "m")
    page = script.update_page(page, {"b": new_b}, "python scripts/recipe_results.py --recipes b", keep_others=True)
    rows, commands = script.parse_block(page)
    assert rows["a"] == first["a"] and rows["b"] == new_b
    assert len(commands) == 2 and page.endswith("\nText after the table.\n")
    full = script.update_page(page, {"b": new_b}, "python scripts/recipe_results.py", keep_others=False)
    assert set(script.parse_block(full)[0]) == {"b"}


def test_rows_written_one_recipe_at_a_time_merge_and_a_full_run_drops_unshipped_ones(script, tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n", encoding="utf-8")
    row = {name: script.summarize(name, _runs(script, "accuracy", [0.5]), "m") for name in ("a", "b", "gone")}
    script._write_rows(page, {"a": row["a"]}, "python scripts/recipe_results.py --recipes a")
    script._write_rows(page, {"gone": row["gone"]}, "python scripts/recipe_results.py --recipes gone")
    script._write_rows(page, {"b": row["b"]}, "python scripts/recipe_results.py")
    assert set(script.parse_block(page.read_text(encoding="utf-8"))[0]) == {"a", "b", "gone"}
    script._write_rows(page, {}, "python scripts/recipe_results.py", only=["a", "b"])
    rows, commands = script.parse_block(page.read_text(encoding="utf-8"))
    assert set(rows) == {"a", "b"} and commands == ["`python scripts/recipe_results.py`"]
    assert page.read_text(encoding="utf-8").startswith("# Results\n")


def test_unknown_recipe_is_refused_with_a_hint(script, capsys):
    assert script.main(["--recipes", "no-such-recipe"]) == 2
    err = capsys.readouterr().err
    assert "error: no shipped recipe named no-such-recipe" in err and "hint:" in err


def test_every_shipped_recipe_states_what_it_reaches(script):
    names = script.shipped_recipes()
    assert names, "no shipped recipes found"
    missing = [name for name in names
               if not any(line.startswith(script.REACHES)
                          for line in (script.RECIPE_DIR / f"{name}.yaml").read_text(encoding="utf-8").splitlines())]
    assert not missing, (f"recipes without a '# reaches ...' header line: {missing}; "
                         f"run python scripts/recipe_results.py --recipes {' '.join(missing)}")


def test_results_page_lists_every_shipped_recipe(script):
    rows, _ = script.parse_block(script.PAGE.read_text(encoding="utf-8"))
    missing = sorted(set(script.shipped_recipes()) - set(rows))
    assert not missing, (f"docs/results.md has no measured row for {missing}; "
                         f"run python scripts/recipe_results.py --recipes {' '.join(missing)}")
