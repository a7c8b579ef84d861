"""Input a hostile review fed the command line ends in an `error:` and a `hint:`, never in
"unexpected" (the catch-all that asks for a bug report) or a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def _refused(result) -> bool:
    return result.code == 2 and "error: " in result.err and "hint: " in result.err and \
        "unexpected" not in result.err and "Traceback" not in result.err


def test_epochs_too_many_to_count_as_steps_are_refused_by_validate_and_account(cli):
    for command in ("validate", "account"):
        result = cli(command, QUICKSTART, "training.epochs=1e308")
        assert _refused(result), result.err
        assert "too many steps to count" in result.err.replace("\n", "")
    flags = cli("account", "--eps", "8", "--delta", "1e-5", "-q", "1e-300", "--epochs", "1e300")
    assert _refused(flags), flags.err


@pytest.mark.parametrize("recipe, field", [("blt-digits", "model.hidden=[10000000000000000000000000000000000000000]"),
                                           ("cnn-layer", "model.channels=[8, 3000000000]"),
                                           ("cnn-layer", "model.kernel_size=100000000000000000000"),
                                           ("bert-tiny-classify", "data.max_length=10000000000000000000000"),
                                           ("gpt2-tiny-lora", "model.lora.r=2147483648")])
def test_a_model_size_no_model_has_is_refused_at_the_recipe_naming_the_field(cli, recipe, field):
    # validate accepted them; train then crashed inside torch with its C++ backtrace on the error line
    result = cli("validate", REPO / "recipes" / f"{recipe}.yaml", field)
    assert _refused(result), result.err
    assert field.split("=")[0] in result.err and "at most 2147483647" in result.err.replace("\n", "")


def test_a_model_too_large_for_memory_is_an_error_with_a_hint_not_a_crash(cli):
    # the largest size the recipe takes, 2**31 - 1, asks the allocator for 512 GiB
    result = cli("train", QUICKSTART, "model.hidden=[2147483647]", "--dry-run")
    assert _refused(result), result.err
    assert "does not fit in memory" in result.err and "model.hidden" in result.err


@pytest.mark.parametrize("field", ["clipping.threshold.value=1e39", "clipping.threshold.value=1e-46",
                                   "clipping.threshold={kind: quantile, initial: 1.0e+300}",
                                   "training.optimizer.lr=1e300"])
def test_a_threshold_or_learning_rate_float32_cannot_hold_is_refused_at_the_recipe(cli, field):
    # C = 1e39 passed validate and account, made a run directory, then every step was refused (inf noise);
    # lr = 1e300 crashed in torch's SGD.step: "unexpected RuntimeError ... overflow"
    result = cli("validate", QUICKSTART, field)
    assert _refused(result), result.err
    assert "float32" in result.err and field.split("=")[0] in result.err


def test_a_recipe_noise_multiplier_beyond_the_accountants_is_refused_like_account_sigma(cli):
    # privacy.noise_multiplier=1e300 was refused as "a noise multiplier this small"
    result = cli("account", QUICKSTART, "privacy.epsilon=null", "privacy.noise_multiplier=1e300")
    assert _refused(result), result.err
    assert "beyond what the accountants compute" in result.err and "this small" not in result.err
