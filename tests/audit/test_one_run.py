import math

import numpy as np
import pytest

from dpclip.audit.one_run import epsilon_lower_bound, guess_counts, one_run_audit, p_value


def test_all_guesses_right_without_delta_matches_the_closed_form():
    # δ = 0 and v = r: the p-value is p^r with p = e^ε/(1+e^ε), so p* = α^(1/r) and ε* = log(p*/(1−p*)).
    r, alpha = 100, 0.05
    p_star = alpha ** (1 / r)
    assert epsilon_lower_bound(100, r, r, 0.0, alpha) == pytest.approx(math.log(p_star / (1 - p_star)), abs=1e-3)


def test_p_value_grows_with_epsilon_and_with_delta():
    values = [p_value(200, 100, 70, eps, 1e-5) for eps in (0.0, 0.5, 1.0, 2.0)]
    assert values == sorted(values) and values[0] < values[-1]
    assert p_value(200, 100, 70, 0.5, 1e-3) > p_value(200, 100, 70, 0.5, 0.0)


def test_the_delta_correction_lowers_the_bound():
    assert epsilon_lower_bound(1000, 600, 600, 1e-3) < epsilon_lower_bound(1000, 600, 600, 0.0)


def test_half_right_guesses_give_no_evidence():
    assert epsilon_lower_bound(200, 100, 50, 1e-5) == 0.0


def test_random_scores_rarely_beat_zero():
    # Under the null (scores independent of inclusion) the bound is positive with
    # probability at most 5%: over 40 seeded draws expect ~2 or fewer, allow 6.
    positives = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        result = one_run_audit(rng.normal(size=200), rng.random(200) < 0.5, delta=1e-5)
        positives += result["epsilon_lower_bound"] > 0
    assert positives <= 6


def test_perfect_scores_reach_the_bonferroni_ceiling():
    included = np.random.default_rng(0).random(200) < 0.5
    result = one_run_audit(included.astype(float), included, delta=1e-5)
    assert result["correct"] == result["guesses"] and result["epsilon_lower_bound"] > 3.0
    assert guess_counts(200) == [10, 20, 50, 100]


@pytest.mark.parametrize("m, r, v, epsilon, delta", [(200, 100, 60, 0.5, 1e-5), (400, 300, 190, 1.0, 1e-5),
                                                     (50, 20, 20, 2.0, 1e-3), (10, 4, 0, 0.1, 1e-5)])
def test_the_p_value_equals_the_theorems_sum_term_by_term(m, r, v, epsilon, delta):
    """Steinke et al. Thm 3.1 written out with one scalar pmf per term, as in the paper."""
    import math
    from scipy.stats import binom
    from dpclip.audit.one_run import p_value
    q = math.exp(epsilon) / (1 + math.exp(epsilon))
    pmf = [binom.pmf(v - j, r, q) for j in range(1, v + 1)]
    worst = max([sum(pmf[:i]) / i for i in range(1, v + 1)], default=0.0)
    expected = min(1.0, binom.sf(v - 1, r, q) + 2 * m * delta * worst)
    assert p_value(m, r, v, epsilon, delta) == pytest.approx(expected, rel=1e-12, abs=1e-300)


def test_an_answer_key_of_another_length_or_too_few_canaries_are_refused():
    from dpclip.errors import DpclipError
    with pytest.raises(DpclipError, match="50 inclusion bits for 200 canaries"):
        one_run_audit(np.zeros(200), np.ones(50, dtype=bool), 1e-5)
    with pytest.raises(DpclipError, match="too few") as caught:
        one_run_audit(np.zeros(1), np.ones(1, dtype=bool), 1e-5)
    assert "audit.canaries.count" in caught.value.hint


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5, -0.1, float("nan"), "0.95", True])
def test_a_confidence_outside_zero_to_one_is_refused_before_anything_runs(confidence, tmp_path):
    """confidence = 1.5 made α negative (every bound 0, "at 150% confidence"); 0 tested at α = 1."""
    from dpclip.audit import audit
    from dpclip.errors import DpclipError
    for call in (lambda: one_run_audit(np.zeros(20), np.ones(20, dtype=bool), 1e-5, confidence),
                 lambda: audit(tmp_path / "no-run", ["one-run"], confidence=confidence)):
        with pytest.raises(DpclipError) as caught:
            call()
        assert "confidence" in str(caught.value) and caught.value.hint


def test_the_ceiling_is_the_bound_of_every_guess_right_and_says_when_no_flag_was_possible():
    # 20 canaries cannot show more than ε ≥ 1.41 (all 20 right at k = 10, α = 5%/4): an audit of an
    # ε = 8 run read "within the ledger's ε" as if that were evidence, with no word that it could
    # never have read otherwise.
    from dpclip.audit.one_run import one_run_verdict

    included = np.random.default_rng(0).random(20) < 0.5
    result = one_run_audit(included.astype(float), included, delta=1e-5)
    ceiling = result["epsilon_ceiling"]
    assert ceiling == pytest.approx(epsilon_lower_bound(20, 20, 20, 1e-5, 0.05 / 4))
    assert result["epsilon_lower_bound"] <= ceiling
    flagged, note = one_run_verdict(result, 8.0)
    assert not flagged and "could not have flagged" in note and "1.41" in note
    assert one_run_verdict(result, 1.0) == (False, None)            # it could have: no note
    flagged, note = one_run_verdict(result, 0.1)
    assert flagged and "exceeds the ledger's ε at 95% confidence" in note
    # the docs' figure: 200 canaries, every guess right at k = 100, give ε ≥ 3.80
    big = np.random.default_rng(0).random(200) < 0.5
    assert one_run_audit(big.astype(float), big, delta=1e-5)["epsilon_ceiling"] == pytest.approx(3.80, abs=0.005)


@pytest.mark.slow
def test_on_randomized_response_of_known_epsilon_the_bound_exceeds_it_at_most_alpha_of_the_time():
    # Each canary's score is its bit kept with probability e^ε/(1+e^ε), else flipped: exactly ε-DP
    # (δ = 0), where the randomized-response bound is nearly tight (measured: 2% of 400 seeds above ε
    # with the four k's, 4% with one k alone). Seeds fixed; the count allowed is α·n plus three
    # binomial standard deviations of it, sqrt(n·α·(1 − α)).
    epsilon, m, runs, alpha = 1.0, 400, 150, 0.05
    keep = math.exp(epsilon) / (1 + math.exp(epsilon))
    above = 0
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        included = rng.random(m) < 0.5
        released = np.where(rng.random(m) < keep, included, ~included)
        scores = released + 1e-3 * rng.random(m)          # ties broken independently of the bits
        above += one_run_audit(scores, included, delta=0.0)["epsilon_lower_bound"] > epsilon
    assert above <= alpha * runs + 3 * math.sqrt(runs * alpha * (1 - alpha))
