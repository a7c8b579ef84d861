"""Canary exposure (dpclip/audit/exposure.py): ranks, the extrapolation, and a control at chance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from dpclip.audit.exposure import CHANCE, exposure_audit, exposure_of, ranks
from dpclip.data import load_data
from dpclip.data.exposure import ExposureSet
from dpclip.models import build_model
from dpclip.recipe import load_recipe
from tests.conftest import REPO


def test_an_exact_rank_counts_the_candidates_the_model_finds_likelier():
    candidates = np.array([3.0, 1.0, 2.0, 5.0, 4.0])        # the secret scores 2.0: one likelier (1.0)
    rank, how = ranks(np.array([2.0, 1.0, 5.0]), candidates, space=5, exact=True)
    assert rank.tolist() == [2.0, 1.0, 5.0] and how == ["exact"] * 3
    assert exposure_of(np.array([1.0, 5.0]), 5).tolist() == pytest.approx([math.log2(5), 0.0])


def test_a_sampled_rank_and_its_extrapolation_follow_the_candidates_distribution():
    """Candidate scores N(0, 1) over a space of 10^8, 20,000 of them drawn. A secret at 0 has
    rank ≈ |R|/2, exposure 1 bit; its sampled fraction has standard error 0.0035, so the
    exposure is within 0.02 bits (1/ln 2 · 0.0035/0.5 ≈ 0.01, twice). A secret at −6 beats every
    draw; the skew-normal fit of the draws extrapolates Φ(−6) ≈ 1e-9, rank ≈ 1.1; the fit's
    tail error is under a factor 2 here (measured 1.2), so exposure within 1 bit of
    log₂ 10^8 − log₂(1 + 10^8·Φ(−6))."""
    rng = np.random.default_rng(0)
    sample = rng.standard_normal(20_000)
    space = 10 ** 8
    rank, how = ranks(np.array([0.0, -6.0]), sample, space, exact=False)
    assert how == ["sampled", "extrapolated"]
    exposure = exposure_of(rank, space)
    assert exposure[0] == pytest.approx(1.0, abs=0.02)
    truth = math.log2(space) - math.log2(1 + (space - 1) * norm.cdf(-6.0))
    assert exposure[1] == pytest.approx(truth, abs=1.0)


def test_secrets_never_planted_sit_at_chance_whatever_the_model():
    """A control is drawn independently of the model, so its rank is uniform on 1..|R| for any
    model: exposure −log₂(rank/|R|) has mean 1/ln 2 and standard deviation 1/ln 2 (an
    exponential in bits). 150 controls of a 1,000-member space: the mean is within 4 standard
    errors, 4·1.44/sqrt(150) = 0.47 bits, of 1.44 (sampling without replacement only narrows it).
    A ranking that ignored the model (every rank 1) would give log₂ 1000 ≈ 10 bits."""
    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", ["data.num_examples=40", "data.max_length=32"])
    data = load_data(recipe.data, recipe.seed)
    model, loss_fn = build_model(recipe.model, data, seed=0)
    rng = np.random.default_rng(1)
    controls = ["".join(map(str, row)) for row in rng.permutation(1000)[:150, None] // [100, 10, 1] % 10]
    exposure = ExposureSet("the code is {secret}", "0123456789", 3, controls, [0] * 150, entropy=0)
    torch.manual_seed(0)
    result = exposure_audit(model, loss_fn, exposure, data.tokenizer, 32, candidates=1000, seed=0)
    assert result["ranked"] == "every candidate" and result["space"] == 1000
    assert result["controls"]["count"] == 150 and result["planted"] == []
    assert abs(result["controls"]["mean_exposure"] - CHANCE) < 4 * CHANCE / math.sqrt(150)


def test_the_report_names_no_secret():
    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", ["data.num_examples=40", "data.max_length=32"])
    data = load_data(recipe.data, recipe.seed)
    model, loss_fn = build_model(recipe.model, data, seed=0)
    # letters no number or key of the report can hold
    exposure = ExposureSet("the code is {secret}", "qrstuvwxyz", 3, ["qzx", "wvu"], [2, 0], entropy=0)
    result = exposure_audit(model, loss_fn, exposure, data.tokenizer, 32, candidates=1000, seed=0)
    assert "qzx" not in repr(result) and "wvu" not in repr(result)
    assert [row["repetitions"] for row in result["planted"]] == [2]


@pytest.mark.slow
def test_a_secret_planted_often_in_a_barely_noised_run_is_exposed_and_audit_all_measures_it(tmp_path, cli):
    """σ = 0.01 (ε in the thousands): 80 steps of a tiny GPT-2 memorise a secret planted 32 times
    (measured 9.97 of 9.97 bits; > 6 asserted). The controls stay near chance: 64 of them, mean
    within 6·1.44/sqrt(64) = 1.1 bits of 1.44. They are drawn from OS entropy (always): that fails
    with probability 3e-7 (Gamma tails; 8 controls within 4 standard errors failed with 8e-4)."""
    from dpclip.train.workflow import train

    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", [
        f"output_dir={tmp_path}", "data.num_examples=300", "training.epochs=null", "training.steps=80",
        "training.batch_size=32", "privacy.epsilon=null", "privacy.noise_multiplier=0.01", "eval.every_steps=null",
        "audit.exposure={length: 3, repetitions: [32], controls: 64}"])
    run_dir = train(recipe).run_dir
    result = cli("audit-mia", run_dir, "--bootstrap", "0", "--shadows", "2", "--json")
    assert result.code == 0, result.err
    report = json_of(result.out)
    exposure = report["exposure"]
    assert exposure["ranked"] == "every candidate" and exposure["max_exposure"] == pytest.approx(math.log2(1000))
    assert exposure["planted"][0]["exposure"] > 6
    assert abs(exposure["controls"]["mean_exposure"] - CHANCE) < 6 * CHANCE / math.sqrt(64)
    assert "loss" in report["attacks"]   # "all" ran the membership attacks too


def json_of(text: str) -> dict:
    import json
    return json.loads(text)
