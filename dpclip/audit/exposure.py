"""Canary exposure (Carlini, Liu, Erlingsson, Kos, Song 2019, "The Secret Sharer", §3-4;
docs/auditing.md): how far up the model ranks a secret planted in its training text.

Every candidate c of the space R (all |alphabet|^length strings) is put into the template
and scored by its log-perplexity under the model, the summed negative log-likelihood of
the whole text, ℓ(c) = −Σ_t log Pr(x_t | x_<t). The rank of a secret s is its place among
all candidates ordered by ℓ (rank 1: the model finds it the likeliest), and

    exposure(s) = log₂|R| − log₂ rank(s),

between 0 and log₂|R|. A secret the model has not memorised has a uniformly random rank,
whose exposure −log₂ U (U uniform on (0, 1]) has mean 1/ln 2 ≈ 1.44 bits: the controls,
drawn the same way and never planted, sit there whatever the model is, because they are
independent of it.

Ranking: a space of at most ``candidates`` members is scored in full (the exact rank). A
larger space is estimated from ``candidates`` uniform draws c_1..c_n:
rank ≈ 1 + (|R| − 1)·#{i : ℓ(c_i) < ℓ(s)}/n; when the secret beats every draw, the draws'
ℓ are fitted with a skew-normal distribution and rank ≈ 1 + (|R| − 1)·F(ℓ(s)) (the paper's
extrapolation, §4.2): an estimate, marked as such in the report.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import skewnorm

from dpclip.data.columns import IGNORE_INDEX, text_tensors

CHANCE = 1 / math.log(2)   # mean exposure of a secret the model is independent of


@torch.no_grad()
def log_perplexities(model, loss_fn, texts: list[str], tokenizer, max_length: int,
                     batch_size: int = 512) -> np.ndarray:
    """ℓ of each text: the summed next-token negative log-likelihood of its real tokens."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(texts), batch_size):
        batch = text_tensors(texts[start:start + batch_size], tokenizer, max_length)
        logits = loss_fn.forward(model, batch).float()
        targets = batch["labels"][:, 1:]
        token = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                reduction="none")
        out.append(token.sum(dim=1).double())
    model.train(was_training)
    return torch.cat(out).numpy()


def candidate_space(alphabet: str, length: int) -> list[str]:
    return ["".join(chars) for chars in itertools.product(alphabet, repeat=length)]


def random_candidates(alphabet: str, length: int, count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(alphabet), size=(count, length))
    return ["".join(alphabet[i] for i in row) for row in draws]


def ranks(secret_scores: np.ndarray, candidate_scores: np.ndarray, space: int,
          exact: bool) -> tuple[np.ndarray, list[str]]:
    """(rank of each secret, how each was found: "exact", "sampled" or "extrapolated").

    ``exact``: ``candidate_scores`` are those of the whole space (the secret among them);
    else a uniform sample of it (module doc)."""
    ordered = np.sort(candidate_scores)
    below = np.searchsorted(ordered, secret_scores, side="left")   # candidates strictly likelier
    if exact:
        return 1.0 + below, ["exact"] * len(secret_scores)
    n = len(ordered)
    fitted = None
    out, how = [], []
    for score, count in zip(secret_scores, below):
        if count > 0:
            out.append(1.0 + (space - 1) * count / n)
            how.append("sampled")
            continue
        if fitted is None:
            fitted = skewnorm.fit(ordered)
        out.append(1.0 + (space - 1) * float(skewnorm.cdf(score, *fitted)))
        how.append("extrapolated")
    return np.asarray(out), how


def exposure_of(rank: np.ndarray, space: int) -> np.ndarray:
    """log₂|R| − log₂ rank."""
    return math.log2(space) - np.log2(rank)


def exposure_audit(model, loss_fn, exposure, tokenizer, max_length: int, candidates: int, seed: int) -> dict:
    """The exposure of each planted secret and of the controls (``exposure``: an ExposureSet).

    The report names no secret: it says how often each was planted and what it measured."""
    space = exposure.space
    exact = space <= candidates
    pool = (candidate_space(exposure.alphabet, exposure.length) if exact
            else random_candidates(exposure.alphabet, exposure.length, candidates, seed))
    candidate_scores = log_perplexities(model, loss_fn, [exposure.text(c) for c in pool], tokenizer, max_length)
    secret_scores = log_perplexities(model, loss_fn, [exposure.text(s) for s in exposure.secrets], tokenizer,
                                     max_length)
    rank, how = ranks(secret_scores, candidate_scores, space, exact)
    values = exposure_of(rank, space)
    rows = [{"repetitions": int(r), "rank": float(k), "exposure": float(e), "how": h}
            for r, k, e, h in zip(exposure.repetitions, rank, values, how)]
    planted = [row for row in rows if row["repetitions"] > 0]
    controls = [row for row in rows if row["repetitions"] == 0]
    return {
        "space": space, "max_exposure": math.log2(space), "ranked": "every candidate" if exact else
        f"{candidates} random candidates", "chance": CHANCE,
        "planted": planted,
        "controls": {"count": len(controls), "mean_exposure": float(np.mean([c["exposure"] for c in controls]))
                     if controls else None, "exposures": [c["exposure"] for c in controls]},
    }
