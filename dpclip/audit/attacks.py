"""What the attacks look at (a model's outputs on examples) and the two simplest attacks.

- loss threshold (Yeom et al. 2018): members tend to have lower loss; score = −loss.
- logistic regression on (logits, loss), the pre-training paper's attack (§5.4, B.4):
  fit on one half of the members and non-members, score the other half.

LiRA lives in :mod:`dpclip.audit.lira`, RMIA in :mod:`dpclip.audit.rmia`, the one-run audit in
:mod:`dpclip.audit.one_run`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dpclip.audit.metrics import attack_metrics
from dpclip.errors import DpclipError


@dataclass
class Outputs:
    """A model's view of n examples: per-example loss, logits (classification only) and
    the LiRA confidence φ (logit-scaled probability of the label, or −loss)."""

    losses: np.ndarray                 # [n]
    logits: np.ndarray | None          # [n, C] for classification, else None
    confidence: np.ndarray             # [n]


def logit_scaled_confidence(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """φ = log(p_y / (1 − p_y)) with p = softmax(logits) (Carlini et al. 2022, §IV-B: the
    logit scaling makes the confidences approximately Gaussian).

    Computed stably as z_y − logsumexp_{j≠y} z_j, which equals log p_y − log(1 − p_y).
    """
    true = logits.gather(1, labels[:, None]).squeeze(1)
    others = logits.scatter(1, labels[:, None], float("-inf"))
    return true - torch.logsumexp(others, dim=1)


@torch.no_grad()
def model_outputs(model, loss_fn, tensors: dict[str, torch.Tensor], task: str, batch_size: int = 512) -> Outputs:
    """Losses, logits and confidences of ``model`` on every row of ``tensors``."""
    was_training = model.training
    model.eval()
    losses, logits, confidences = [], [], []
    n = len(tensors["labels"])
    for start in range(0, n, batch_size):
        batch = {name: t[start:start + batch_size] for name, t in tensors.items()}
        outputs = loss_fn.forward(model, batch)
        loss = loss_fn.criterion(outputs, batch)
        losses.append(loss.float())
        if task == "classification":
            logits.append(outputs.float())
            confidences.append(logit_scaled_confidence(outputs.float(), batch["labels"]))
        else:
            confidences.append(-loss.float())
    model.train(was_training)
    result = Outputs(torch.cat(losses).numpy(), torch.cat(logits).numpy() if logits else None,
                     torch.cat(confidences).numpy())
    if not (np.isfinite(result.losses).all() and np.isfinite(result.confidence).all()):
        # the attacks rank scores, and NaN or inf ranks nowhere (scikit-learn's metrics refuse them)
        raise DpclipError("the model's losses or confidences are not finite on rows the audit scores: its weights "
                          "diverged (or were damaged), so no attack can rank them",
                          "audit a checkpoint whose outputs are finite (a checkpoints/step_NNNNNN folder before the "
                          "divergence), or train again with a smaller learning rate or clipping threshold")
    return result


#: The attacks that compare the run's members with its non-members (the one-run audit and exposure do not).
POOL_ATTACKS = ("loss", "logistic", "lira", "rmia")


def check_pool(is_member: np.ndarray, attacks: list[str], unit: str = "rows") -> None:
    """Refuse, before any attack runs, a pool the member/non-member attacks cannot score: they need
    two members and two non-members at least (the logistic attack fits on one half of each and
    scores the other)."""
    members, non_members = int(is_member.sum()), int((is_member == 0).sum())
    chosen = [name for name in attacks if name in POOL_ATTACKS]
    if chosen and min(members, non_members) < 2:
        raise DpclipError(f"the {chosen[0]} attack compares members with non-members, but this run has {members} "
                          f"member and {non_members} non-member {unit} to score (at least 2 of each are needed)",
                          "train with a larger data.test_fraction (mislabel canaries take held-out rows too, and "
                          "are not scored as non-members), or audit with --attack one-run or --attack exposure only")


def loss_attack(outputs: Outputs, is_member: np.ndarray, *, bootstrap: int, seed: int) -> dict:
    """Yeom et al.'s loss threshold: the ROC over all thresholds of score = −loss, plus
    the operating point of their threshold τ = the members' mean loss ("member if
    loss ≤ τ"; the attacker is assumed to know the average training loss)."""
    scores = -outputs.losses
    result = attack_metrics(is_member, scores, bootstrap=bootstrap, seed=seed)
    tau = float(outputs.losses[is_member == 1].mean())
    guess = outputs.losses <= tau
    result["yeom_threshold"] = {"tau": tau, "tpr": float(guess[is_member == 1].mean()),
                                "fpr": float(guess[is_member == 0].mean())}
    return result


def halves(is_member: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random split of the examples into two halves with members and non-members
    split evenly (fit on one, score the other)."""
    rng = np.random.default_rng(seed)
    first = np.zeros(len(is_member), dtype=bool)
    for label in (0, 1):
        idx = rng.permutation(np.flatnonzero(is_member == label))
        first[idx[: len(idx) // 2]] = True
    return first, ~first


def logistic_attack(outputs: Outputs, is_member: np.ndarray, *, bootstrap: int, seed: int) -> dict:
    """Logistic regression on (logits, loss) features (the pre-training paper, B.4:
    L-BFGS, class re-weighting), fit on one half and scored on the other half.

    Features are standardised on the fitting half. Only the scoring half enters the
    metrics, so members/non-members there are about half of those of the loss attack.
    """
    # Lazy: sklearn's estimators are slow to import and only the logistic attack needs them.
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    columns = [outputs.losses[:, None]]
    if outputs.logits is not None:
        columns.insert(0, outputs.logits)
    features = np.concatenate(columns, axis=1)
    fit, score = halves(is_member, seed)
    classifier = make_pipeline(StandardScaler(),
                               LogisticRegression(solver="lbfgs", class_weight="balanced", max_iter=1000))
    classifier.fit(features[fit], is_member[fit])
    scores = classifier.decision_function(features[score])
    result = attack_metrics(is_member[score], scores, bootstrap=bootstrap, seed=seed)
    result["features"] = int(features.shape[1])
    return result
