"""The attacker reading a search's released score: with ``tuning.score: public`` the search selects
on the exact held-out accuracy, charges nothing for it and writes it into released files (the
selected run's search.json ``score``, the search's summary.json ``selected_score``), on the
recipe's claim that the held-out split is public data. Where the held-out rows are cut from the
private data (``data.test_fraction``: no data.test file, no data.test_split) the claim cannot be
true: the released score was an exact, uncharged count of correct predictions on private rows.
Such a recipe is refused where it is read (validate, account, tune-cost with or without --run),
before anything trains or is charged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
TINY = ["training.epochs=null", "training.steps=2", "model.hidden=[8]", "privacy.accountant=rdp"]
SEARCH = ["--grid", "training.optimizer.lr=0.13,0.57", "--no-measure", "--step-seconds", "0.05"]


def _refused(result):
    assert result.code == 2, result.out
    assert "error:" in result.err and "hint:" in result.err and "Traceback" not in result.err
    assert "tuning.score 'public'" in result.err and "data.test_fraction" in result.err
    assert "data.test" in result.err and "tuning.score: private" in result.err


def test_no_exact_score_of_private_held_out_rows_is_released_by_a_public_score_search(cli, tmp_path):
    result = cli("tune-cost", QUICKSTART, *TINY, f"output_dir={tmp_path}", "tuning.score=public", *SEARCH, "--run")
    released = [json.loads(marker.read_text()).get("score") for marker in tmp_path.rglob("search.json")]
    assert released == []   # was the selected run's exact accuracy on the private held-out rows
    _refused(result)
    assert list(tmp_path.iterdir()) == []   # refused before any search directory: nothing trained, nothing charged


@pytest.mark.parametrize("command", [("validate",), ("account",), ("tune-cost", *SEARCH)])
def test_validate_account_and_pricing_refuse_the_claim_alike(cli, tmp_path, command):
    _refused(cli(command[0], QUICKSTART, *TINY, f"output_dir={tmp_path}", "tuning.score=public", *command[1:]))


def test_a_separate_held_out_file_may_be_declared_public(cli, tmp_path, public_held_out):
    result = cli("validate", QUICKSTART, *TINY, *public_held_out, "tuning.score=public")
    assert result.code == 0, result.err


def test_a_held_out_file_that_is_the_training_file_may_not_be_declared_public(cli, public_held_out):
    train = public_held_out[0].split("train: '")[1].split("'")[0]
    result = cli("validate", QUICKSTART, *TINY, *public_held_out, f"data.test={train}", "tuning.score=public")
    assert result.code == 2 and "error:" in result.err and "hint:" in result.err
    assert "held-out set is its training data" in result.err
