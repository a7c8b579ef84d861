import json
import re
import math
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import pld, rdp

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
DONE_WHEN = ["account", "--eps", "8", "--delta", "1e-5", "--dataset-size", "60000", "--batch-size", "256",
             "--epochs", "10"]


def pld_epsilon(sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    accountant = pld.PLDAccountant(value_discretization_interval=1e-3)
    return accountant.compose(event).get_epsilon(delta)


def rdp_epsilon(sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return rdp.RdpAccountant().compose(event).get_epsilon(delta)


def test_done_when_command_prints_sigma_and_the_statement(cli):
    result = cli(*DONE_WHEN)
    assert result.code == 0, result.err
    assert "σ" in result.out and "noise multiplier" in result.out
    for fact in ("example-level", "add/remove", "Poisson", "δ", "steps"):
        assert fact.lower() in result.out.lower(), fact


def test_done_when_command_json_agrees_with_dp_accounting_called_directly(cli):
    result = cli(*DONE_WHEN, "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    q, steps = 256 / 60000, math.ceil(10 / (256 / 60000))
    assert payload["sample_rate"] == pytest.approx(q) and payload["steps"] == steps
    sigma = payload["noise"]["noise_multiplier"]
    direct = pld_epsilon(sigma, q, steps, 1e-5)
    assert direct <= 8.0 * 1.005 and direct >= 8.0 * 0.98
    assert payload["epsilon"] == pytest.approx(direct, rel=0.01)
    assert payload["epsilon_rdp"] == pytest.approx(rdp_epsilon(sigma, q, steps, 1e-5), rel=1e-3)
    assert payload["statement"]


def test_epsilon_from_sigma_matches_dp_accounting(cli):
    result = cli("account", "--sigma", "1.1", "--delta", "1e-5", "--sample-rate", "0.004", "--steps", "2000",
                 "--accountant", "rdp", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["epsilon"] == pytest.approx(rdp_epsilon(1.1, 0.004, 2000, 1e-5), rel=1e-6)


def test_both_accountants_keep_epsilon_within_the_target(cli):
    payload = json.loads(cli("account", "--eps", "3", "--delta", "1e-5", "-q", "0.01", "--steps", "500",
                             "--accountant", "both", "--json").out)
    sigma = payload["noise"]["noise_multiplier"]
    assert pld_epsilon(sigma, 0.01, 500, 1e-5) <= 3 * 1.005
    assert rdp_epsilon(sigma, 0.01, 500, 1e-5) <= 3 * 1.0001


@pytest.mark.parametrize("aux, groups, fraction, sensitivity", [("quantile", 4, 0.1, 1.0), ("histogram", 4, 0.05, 2.0),
                                                                 ("quantile", 1, 0.01, 0.5)])
def test_budget_split_by_fraction(cli, aux, groups, fraction, sensitivity):
    result = cli("account", "--eps", "8", "--delta", "1e-5", "-q", "0.004", "--steps", "2000", "--aux", aux,
                 "--aux-fraction", fraction, "--groups", groups, "--json")
    assert result.code == 0, result.err
    noise = json.loads(result.out)["noise"]
    assert noise["aux_sensitivity"] == pytest.approx(sensitivity)
    assert noise["gradient_noise_multiplier"] == pytest.approx(noise["noise_multiplier"] / math.sqrt(1 - fraction))
    joint = (noise["gradient_noise_multiplier"] ** -2 + (sensitivity / noise["sigma_aux"]) ** 2) ** -0.5
    assert joint == pytest.approx(noise["noise_multiplier"])
    assert noise["inflation"] == pytest.approx(1 / math.sqrt(1 - fraction))


def test_histogram_split_by_sigma_gives_the_dcsgd_gradient_noise(cli):
    result = cli("account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--aux",
                 "histogram", "--aux-sigma", "10", "--json")
    noise = json.loads(result.out)["noise"]
    assert noise["gradient_noise_multiplier"] == pytest.approx(1.00504, abs=1e-5)


def test_histogram_preset_with_bins_prints_the_papers_gradient_noise(cli):
    # DC-SGD preset: sigma_T = (sigma^-2 - sigma_H^-2)^(-1/2); b = 20 is recorded, not charged
    result = cli("account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--aux",
                 "histogram", "--bins", "20", "--aux-sigma", "5", "--json")
    assert "deprecated" in result.err and "changes nothing" in result.err     # --bins is kept, and says so
    noise = json.loads(result.out)["noise"]
    assert noise["gradient_noise_multiplier"] == pytest.approx((1 - 1 / 25) ** -0.5, rel=1e-6)
    assert noise["bins"] == 20 and noise["aux_sensitivity"] == 1.0
    other = json.loads(cli("account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--aux",
                           "histogram", "--bins", "50", "--aux-sigma", "5", "--json").out)["noise"]
    assert other["gradient_noise_multiplier"] == noise["gradient_noise_multiplier"]
    text = cli("account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--aux",
               "histogram", "--bins", "20", "--aux-sigma", "5").out
    assert "histogram bins" in text and "1.021" in text


def test_recipe_plan_shows_the_recipes_bins(cli):
    result = cli("account", str(QUICKSTART.parent / "dcsgd-e-digits.yaml"), "--json")
    assert json.loads(result.out)["noise"]["bins"] == 20


def test_text_output_shows_the_split(cli):
    result = cli("account", "--eps", "8", "--delta", "1e-5", "-q", "0.004", "--steps", "2000", "--aux",
                 "quantile", "--aux-fraction", "0.1", "-K", "4")
    assert result.code == 0
    for row in ("σ gradient", "σ statistic", "budget share", "noise inflation"):
        assert row in result.out


def test_shuffle_sampling_carries_the_poisson_caveat(cli):
    result = cli(*DONE_WHEN, "--sampling", "shuffle", "--json")
    statement = json.dumps(json.loads(result.out)["statement"]).lower()
    assert "assumes poisson" in statement


def test_recipe_plan_matches_the_same_settings_given_as_flags(cli):
    from dpclip.data.size import training_set_size
    from dpclip.recipe import load_recipe

    recipe = load_recipe(QUICKSTART)
    n = training_set_size(recipe.data)
    from_recipe = json.loads(cli("account", QUICKSTART, "--json").out)
    from_flags = json.loads(cli("account", "--eps", "8", "--delta", "1e-5", "-N", n, "-B", 64, "--epochs", 30,
                                "--json").out)
    assert from_recipe["steps"] == from_flags["steps"]
    assert from_recipe["noise"]["noise_multiplier"] == pytest.approx(from_flags["noise"]["noise_multiplier"])


def test_recipe_overrides_reach_the_plan(cli):
    base = json.loads(cli("account", QUICKSTART, "--json").out)
    tighter = json.loads(cli("account", QUICKSTART, "privacy.epsilon=2", "--json").out)
    assert tighter["noise"]["noise_multiplier"] > base["noise"]["noise_multiplier"]


def test_recipe_with_model_dependent_groups_counts_them_on_its_model(cli):
    # quickstart: an MLP with hidden [128, 64] and layer grouping: three Linear layers, K = 3
    result = cli("account", QUICKSTART, "clipping.threshold={kind: quantile}", "--json")
    assert result.code == 0 and json.loads(result.out)["noise"]["aux_sensitivity"] == pytest.approx(math.sqrt(3) / 2)
    wider = cli("account", QUICKSTART, "clipping.threshold={kind: quantile}", "model.hidden=[32, 16, 8]", "--json")
    assert json.loads(wider.out)["noise"]["aux_sensitivity"] == pytest.approx(math.sqrt(4) / 2)


def test_unknown_aux_statistic_lists_the_registered_ones(cli):
    result = cli("account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "10", "--aux", "trace",
                 "--aux-sigma", "5")
    assert result.code != 0 and "histogram, quantile" in result.err


MALFORMED = [
    (["account", "--eps", "0", "--delta", "1e-5", "-q", "0.01", "--steps", "10"], "epsilon"),
    (["account", "--eps", "-1", "--delta", "1e-5", "-q", "0.01", "--steps", "10"], "epsilon"),
    (["account", "--eps", "8", "--delta", "1e-5", "-q", "0.01", "--steps", "-5"], "steps"),
    (["account", "--eps", "8", "--delta", "1e-3", "-N", "1000", "-B", "10", "--epochs", "1"], "1/N"),
    (["account", "--eps", "8", "--delta", "1.5", "-q", "0.01", "--steps", "10"], "delta"),
    (["account", "--eps", "8", "--delta", "1e-5", "-q", "1.5", "--steps", "10"], "sample rate"),
    (["account", "--eps", "8", "--delta", "1e-5", "-N", "100", "-B", "200", "--epochs", "1"], "exceeds"),
    (["account", "--eps", "8", "--delta", "1e-5"], "sampling"),
    (["account", "--delta", "1e-5", "-q", "0.01", "--steps", "10"], "--eps"),
    (["account", "--eps", "8", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "10"], "exactly one"),
    (["account", "--eps", "8", "-q", "0.01", "--steps", "10"], "--delta"),
    (["account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "10", "--aux", "histogram",
      "--aux-sigma", "0.5"], "aux"),
    (["account", "--eps", "8", "--delta", "1e-5", "-q", "0.01", "--steps", "10", "--aux", "quantile",
      "--aux-fraction", "1.5"], "fraction"),
    (["account", "--eps", "8", "--delta", "1e-5", "-q", "0.01", "--steps", "10", "--aux-fraction", "0.1"], "--aux"),
    (["account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "10", "--bins", "20"], "--aux histogram"),
    (["account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "10", "--aux", "histogram",
      "--aux-sigma", "5", "--bins", "1"], "bins"),
    (["account", "missing.yaml"], "not found"),
    (["account", str(QUICKSTART), "--eps", "3"], "cannot be combined"),
    (["account", str(QUICKSTART), "--groups", "3"], "cannot be combined"),
    (["account", str(QUICKSTART), "privacy.delta=0.01"], "1/N"),
    (["account", str(QUICKSTART), "clipping.bogus=1"], "unknown key"),
    (["account", "--eps", "abc"], "--eps"),
]


@pytest.mark.parametrize("args, fragment", MALFORMED, ids=[" ".join(a[1:4]) + f" [{f}]" for a, f in MALFORMED])
def test_malformed_input_gives_error_and_hint_without_traceback(cli, args, fragment):
    result = cli(*args)
    assert result.code != 0
    assert result.err.startswith("error: "), result.err
    assert "\nhint: " in result.err
    assert fragment.lower() in result.err.lower()
    assert "Traceback" not in result.err and result.out == ""


def test_banded_mf_calibration_agrees_with_dp_accounting_on_its_participations(cli):
    result = cli(*DONE_WHEN, "--mechanism", "banded-mf", "--bands", "16", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    q, steps = 256 / 60000, math.ceil(10 / (256 / 60000))
    assert payload["bands"] == 16 and payload["steps"] == steps
    sigma = payload["noise"]["noise_multiplier"]
    direct = pld_epsilon(sigma, 16 * q, math.ceil(steps / 16), 1e-5)   # ⌈T/b⌉ participations at q·b
    assert 8.0 * 0.98 <= direct <= 8.0 * 1.005
    assert payload["epsilon_rdp"] == pytest.approx(rdp_epsilon(sigma, 16 * q, math.ceil(steps / 16), 1e-5), rel=1e-3)
    assert payload["statement"]["bands"] == 16


def test_one_band_gives_dp_sgds_sigma_to_the_digit(cli):
    plain = json.loads(cli(*DONE_WHEN, "--json").out)
    banded = json.loads(cli(*DONE_WHEN, "--mechanism", "banded-mf", "--bands", "1", "--json").out)
    assert banded["noise"]["noise_multiplier"] == plain["noise"]["noise_multiplier"]
    assert banded["epsilon"] == plain["epsilon"]


@pytest.mark.parametrize("flags, message", [
    (["--bands", "4"], "--bands goes with --mechanism banded-mf"),
    (["--mechanism", "banded-mf"], "banded-mf needs --bands"),
    (["--mechanism", "banded-mf", "--bands", "300"], "fewer than the expected batch"),
])
def test_banded_flags_that_cannot_work_are_refused_with_a_hint(cli, flags, message):
    result = cli(*DONE_WHEN, *flags)
    assert result.code != 0 and message in result.err and "hint:" in result.err and "Traceback" not in result.err


def test_blt_calibration_is_one_gaussian_of_multiplier_sigma_over_its_sensitivity(cli):
    from dp_accounting.rdp import rdp_privacy_accountant

    from dpclip.accounting.accountants import RDP_ORDERS

    result = cli(*DONE_WHEN, "--mechanism", "blt", "--buffers", "2", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["mechanism"] == "blt" and payload["buffers"] == 2 and payload["groups"] == 60000 // 256
    sigma, sensitivity = payload["noise"]["noise_multiplier"], payload["statement"]["sensitivity"]
    gaussian = dp_accounting.GaussianDpEvent(sigma / sensitivity)
    rdp = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(gaussian).get_epsilon(1e-5)
    assert payload["epsilon_rdp"] == pytest.approx(rdp, rel=1e-6)
    assert 8.0 * 0.99 <= payload["epsilon"] <= 8.0


@pytest.mark.parametrize("flags, message", [
    (["--buffers", "2"], "--buffers goes with --mechanism blt"),
    (["--mechanism", "blt"], "blt needs --buffers"),
    (["--mechanism", "blt", "--buffers", "9"], "buffers must be at most 8"),
    (["--mechanism", "blt", "--buffers", "0"], "--buffers must be at least 1"),
    (["--mechanism", "blt", "--buffers", "-2"], "--buffers must be at least 1"),
])
def test_blt_flags_that_cannot_work_are_refused_with_a_hint(cli, flags, message):
    result = cli(*DONE_WHEN, *flags)
    assert result.code != 0 and message in result.err and "hint:" in result.err and "Traceback" not in result.err


def test_user_level_flags_count_people_and_the_statement_says_so(cli):
    result = cli("account", "--eps", "8", "--delta", "1e-5", "--unit", "user", "--users", "10000",
                 "--users-per-batch", "256", "--epochs", "10", "--max-examples-per-user", "8", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["sample_rate"] == pytest.approx(256 / 10000)
    assert payload["statement"]["unit"] == "user-level (10000 people, at most 8 records of a person in a step)"
    assert payload["statement"]["neighbouring"] == "add/remove all records of one person"
    plain = json.loads(cli(*DONE_WHEN[:3], "--delta", "1e-5", "--dataset-size", "10000", "--batch-size", "256",
                           "--epochs", "10", "--json").out)
    assert payload["noise"]["noise_multiplier"] == plain["noise"]["noise_multiplier"]   # the same event, per person


def test_group_size_adds_the_group_privacy_guarantee(cli):
    result = cli(*DONE_WHEN, "--group-size", "8", "--json")
    payload = json.loads(result.out)
    epsilon = payload["epsilon"]
    assert payload["group"] == {"group_size": 8, "of": "records", "epsilon": pytest.approx(8 * epsilon),
                                "delta": pytest.approx(min(1.0, 8 * math.exp(7 * epsilon) * 1e-5))}
    assert "group privacy: a group of 8 records" in cli(*DONE_WHEN, "--group-size", "8").out


@pytest.mark.parametrize("flags, message", [
    (["--unit", "user", "--users", "100", "--users-per-batch", "10", "--epochs", "1"], "--max-examples-per-user"),
    (["--unit", "user", "--dataset-size", "100", "--batch-size", "10", "--epochs", "1",
      "--max-examples-per-user", "2"], "counts people"),
    (["--users", "100", "--users-per-batch", "10", "--epochs", "1"], "go with --unit user"),
])
def test_user_flags_that_cannot_work_are_refused_with_a_hint(cli, flags, message):
    result = cli("account", "--eps", "8", "--delta", "1e-5", *flags)
    assert result.code != 0 and message in result.err and "hint:" in result.err and "Traceback" not in result.err


def test_account_over_very_many_steps_warns_before_the_long_pld_answer(cli, monkeypatch):
    import dpclip.accounting.accountants as accountants

    # 10⁸ steps (an extra zero) once looked like a hang: now a warning line comes first
    monkeypatch.setattr(accountants, "PLD_SLOW_STEPS", 100)
    monkeypatch.setattr(accountants, "_warned_slow", set())
    result = cli("account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "200")
    assert result.code == 0
    assert result.err.startswith("warning: PLD accounting of 200 steps") and "--accountant rdp" in result.err
    quiet = cli("account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "200", "--accountant", "rdp")
    assert quiet.code == 0 and "warning" not in quiet.err


def test_a_printed_epsilon_is_never_below_the_computed_one(cli):
    """Rounded to nearest, ε = 1.0004 printed "ε = 1": every printed ε is rounded up at its last digit."""
    import re
    flags = ("account", "--sigma", "3.7292732648866167", "-q", "1", "--steps", "1", "--delta", "1e-5")
    computed = json.loads(cli(*flags, "--json").out)["epsilon"]
    assert computed == pytest.approx(pld_epsilon(3.7292732648866167, 1, 1, 1e-5), rel=1e-3) and computed > 1.0
    printed = cli(*flags).out
    shown = [float(x) for x in re.findall(r"ε = ([0-9.]+) at δ", printed)]
    table = [float(x) for x in re.findall(r"│ pld +│ ([0-9.]+) │", printed)]
    assert shown and table
    assert all(computed <= x <= computed + 1e-3 for x in shown + table), (computed, shown, table)


def test_a_noise_multiplier_too_small_to_account_is_an_error_with_a_hint(cli):
    result = cli("account", "--sigma", "1e-300", "--delta", "1e-5", "-q", "0.5", "--steps", "100")
    assert result.code == 2 and "this small" in result.err and "hint:" in result.err and "unexpected" not in result.err


def test_a_noise_multiplier_too_large_to_account_is_not_called_too_small(cli):
    result = cli("account", "--sigma", "1e160", "--delta", "1e-5", "-q", "0.01", "--steps", "10")
    assert result.code == 2 and "beyond what the accountants compute" in result.err and "this small" not in result.err


def test_a_seed_beyond_64_bits_is_refused_by_the_schema(cli):
    result = cli("validate", REPO / "recipes" / "quickstart.yaml", "seed=99999999999999999999999999")
    assert result.code == 2 and "seed" in result.err and "less than or equal" in result.err


def test_account_and_train_agree_on_a_threshold_list_of_the_wrong_length(cli):
    recipe = REPO / "recipes" / "quickstart.yaml"   # grouping: layer, three Linear layers
    refused = cli("account", recipe, "clipping.threshold.value=[1,1]")
    assert refused.code == 2 and "lists 2 thresholds but there are 3 groups" in refused.err
    assert cli("account", recipe, "clipping.threshold.value=[1,1,1]").code == 0
    trained = cli("train", recipe, "clipping.threshold.value=[1,1]", "--dry-run")
    assert trained.code == 2 and "lists 2 thresholds but there are 3 groups" in trained.err


@pytest.mark.parametrize("groups", ["0", "-3"])
def test_no_groups_is_refused_like_negative_groups(cli, groups):
    result = cli("account", "--eps", "8", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--aux", "quantile",
                 "--aux-fraction", "0.1", "--groups", groups)
    assert result.code == 2 and f"groups must be an integer >= 1, got {groups}" in result.err


def test_groups_without_a_statistic_says_it_changes_nothing(cli):
    with_groups = cli("account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--groups",
                      "4", "--json")
    without = cli("account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--json")
    assert "--groups changes nothing without --aux" in with_groups.err
    assert json.loads(with_groups.out)["epsilon"] == json.loads(without.out)["epsilon"]


def test_groups_below_one_is_refused_without_a_statistic_too(cli):
    result = cli("account", "--sigma", "1.0", "--delta", "1e-5", "-q", "0.01", "--steps", "100", "--groups", "0")
    assert result.code == 2 and "groups must be an integer >= 1, got 0" in result.err and "hint:" in result.err


def test_account_json_names_the_accountant_whose_epsilon_it_reports_as_the_text_does(cli, monkeypatch):
    """A PLD request that fell back to RDP printed "accountant": "pld" beside RDP's ε, where the text's table says rdp."""
    import dpclip.accounting.accountants as accountants

    monkeypatch.setattr(accountants, "PLD_MAX_COMPOSITIONS", 100, raising=False)
    flags = ("account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "200")
    out = json.loads(cli(*flags, "--json").out)
    assert out["accountant"] == "pld" and out["accountant_used"] == "rdp" == out["statement"]["accountant"]
    assert out["epsilon"] == out["epsilon_rdp"] and "200 composed steps" in out["fallback_reason"]
    assert "│ rdp " in cli(*flags).out


def test_a_group_whose_bound_reaches_delta_one_is_said_to_have_no_guarantee(cli):
    """3·e^(2·7.96)·1e-5 ≈ 240 > 1: the line said the group "is protected at ε = 23.88, δ = 1"."""
    result = cli("account", "--eps", "8", "--delta", "1e-5", "-q", "0.01", "--steps", "1000", "--group-size", "3")
    assert result.code == 0 and "a group of 3 records (e.g. one person's) has no guarantee" in result.out
    assert "is protected" not in result.out
    fine = cli("account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "1000", "--group-size", "2")
    shown = re.search(r"a group of 2 records \(e.g. one person's\) is protected at ε = ([0-9.]+), δ = ([0-9.e-]+) ", fine.out)
    group = json.loads(cli("account", "--sigma", "1", "--delta", "1e-5", "-q", "0.01", "--steps", "1000", "--group-size",
                           "2", "--json").out)["group"]
    # both are upper bounds: printed rounded up (δ = 1.24496e-04 was printed 0.000124)
    assert float(shown[1]) >= group["epsilon"] and float(shown[2]) >= group["delta"], (shown.groups(), group)
