"""RMIA, the robust membership inference attack (Zarifzadeh, Liu, Shokri, "Low-Cost
High-Power Membership Inference Attacks", ICML 2024; the attack of ML Privacy Meter).

The reference models are LiRA's shadow models (dpclip.audit.lira): the same runs on random
halves of the pool, so an audit that ran LiRA needs no further training for RMIA, and one
that did not trains them once for both. For an example x with label y and a model θ,

    Pr(x|θ)   = the model's probability of x's label: softmax(logits)_y for classification
                (= sigmoid(φ) of LiRA's logit-scaled confidence), exp(−loss) otherwise
                (the geometric mean token probability of a causal LM; a Gaussian likelihood
                of a regression target)
    Pr(x)     online:  ½·(mean over IN shadows + mean over OUT shadows) of Pr(x|θ_ref)
                       (the mean over all shadows when they are balanced, as shadow_keep makes them)
              offline: ½·((1 + a)·Pr_OUT(x) + (1 − a)), Pr_OUT the mean over OUT shadows
    LR(x)     = Pr(x|θ) / Pr(x)
    score(x)  = Pr_{z ∈ Z}[ LR(x) / LR(z) ≥ γ ]

The population Z is every scored non-member of the target (its held-out rows, or people),
each with its own Pr(z) from the shadows by the same rule as x. All of Z is used, not a
subset: counting against a sorted Z costs O(n log n), and a subset would only add sampling
noise to each score. A non-member x is itself in Z; its comparison with itself (ratio 1) is
counted ½, as a tie is in a rank statistic, and so is any other exact tie at γ. Leaving x
out instead (fraction over Z \\ {x}) gives the most member-like non-member a score of 1,
tied with every member above it, so no threshold would reach FPR = 0.

With one population for every x, the score is a non-decreasing function of LR(x): at γ = 1
its ROC is exactly that of LR(x), and γ > 1 only merges nearby scores into ties. What makes
RMIA strong is the normalisation by Pr(x), which removes each example's own difficulty
with as few as one or two reference models; the population turns LR into a calibrated
fraction in [0, 1] (a non-member's score is about uniform).

Defaults: γ = 1 (ML Privacy Meter's default) and a = 0.3, the value of the paper's
reproduction configurations in ML Privacy Meter (research/2024_rmia) and the default of its
offline code. The paper tunes a by attacking one reference model with the others; a = 1
makes Pr(x) the OUT mean itself. Pr(x|θ) is the plain softmax (temperature 1), not the
tempered soft-margin variants the paper also tries.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

DEFAULT_OFFLINE_A = 0.3
DEFAULT_GAMMA = 1.0


def label_probability(confidence: np.ndarray, task: str) -> np.ndarray:
    """Pr(x|θ) from LiRA's confidence φ (dpclip.audit.attacks.Outputs.confidence): for
    classification φ = log(p_y / (1 − p_y)), so p_y = sigmoid(φ); otherwise φ = −loss and
    Pr(x|θ) = exp(−loss). In float64, so that small probabilities keep their ratios."""
    confidence = np.asarray(confidence, dtype=np.float64)
    return expit(confidence) if task == "classification" else np.exp(confidence)


def _mean_where(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per-example mean of ``values`` [M, n] over the models where ``mask``; NaN where none."""
    counts = mask.sum(axis=0)
    total = np.where(mask, values, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, total / np.maximum(counts, 1), np.nan)


def offline_probability(out_mean: np.ndarray, offline_a: float) -> np.ndarray:
    """The paper's offline Pr(x) = ½·((1 + a)·Pr_OUT(x) + (1 − a)): Pr_IN(x) approximated by
    the line a·Pr_OUT(x) + (1 − a), which lifts Pr_OUT towards 1 as training would."""
    if not 0.0 <= offline_a <= 1.0:
        raise ValueError(f"offline_a must be in [0, 1], got {offline_a}")
    return 0.5 * ((1.0 + offline_a) * out_mean + (1.0 - offline_a))


def reference_probability(shadows: np.ndarray, keep: np.ndarray,
                          offline_a: float = DEFAULT_OFFLINE_A) -> dict[str, np.ndarray]:
    """Pr(x) from the shadows' Pr(x|θ_ref) ``shadows`` [M, n] and ``keep`` [M, n] (True: the
    shadow trained on x): "online" ½·(Pr_IN + Pr_OUT), "offline" from Pr_OUT alone (module
    doc). An example without IN shadows (a single shadow) takes the offline value online too."""
    keep = np.asarray(keep, dtype=bool)
    out_mean = _mean_where(shadows, ~keep)
    if np.isnan(out_mean).any():
        raise ValueError("every example needs at least one shadow that did not train on it")
    offline = offline_probability(out_mean, offline_a)
    in_mean = _mean_where(shadows, keep)
    online = np.where(np.isnan(in_mean), offline, 0.5 * (np.nan_to_num(in_mean) + out_mean))
    return {"online": online, "offline": offline}


def population_scores(log_ratio: np.ndarray, population: np.ndarray, gamma: float = DEFAULT_GAMMA) -> np.ndarray:
    """score(x) = the fraction of z in the population with LR(x)/LR(z) ≥ γ, exact ties counted
    ½ (module doc), from log LR [n] and ``population`` (bool [n]: the z)."""
    if gamma < 1.0:
        raise ValueError(f"gamma must be at least 1, got {gamma}")
    z = np.sort(log_ratio[population])
    if len(z) == 0:
        raise ValueError("RMIA needs at least one non-member as population")
    threshold = log_ratio - np.log(gamma)   # LR(x)/LR(z) ≥ γ  ⇔  log LR(z) ≤ log LR(x) − log γ
    below = np.searchsorted(z, threshold, side="left")
    below_or_tied = np.searchsorted(z, threshold, side="right")
    return (below + below_or_tied) / (2.0 * len(z))


def rmia_scores(target: np.ndarray, shadows: np.ndarray, keep: np.ndarray, population: np.ndarray, *,
                offline_a: float = DEFAULT_OFFLINE_A, gamma: float = DEFAULT_GAMMA) -> dict[str, np.ndarray]:
    """Online and offline RMIA scores in [0, 1] (module doc) of the target's Pr(x|θ) ``target``
    [n], given the shadows' Pr(x|θ_ref) ``shadows`` [M, n], ``keep`` [M, n] and the
    population mask ``population`` [n] (the target's non-members used as z)."""
    target = np.asarray(target, dtype=np.float64)
    shadows = np.asarray(shadows, dtype=np.float64)
    population = np.asarray(population, dtype=bool)
    tiny = np.finfo(np.float64).tiny   # a probability that underflowed to 0 stays comparable
    log_target = np.log(np.maximum(target, tiny))
    return {variant: population_scores(log_target - np.log(np.maximum(reference, tiny)), population, gamma)
            for variant, reference in reference_probability(shadows, keep, offline_a).items()}
