"""LiRA, the likelihood-ratio attack (Carlini, Chien, Nasr, Song, Terzis, Tramèr 2022).

Shadow models are trained from the run's own recipe, each on a random half of the
pool (the run's members + non-members), so that every example is "in" for half of the
shadows and "out" for the other half. A shadow imitates the target's training as
released, not as planned for its own data size: the target's sample rate q (up to the
integer rounding of its expected batch), number of steps and noise multiplier σ, read
from the run's meta.json (``shadow_plan``). For each example, the logit-scaled confidences
φ of the shadows that trained on it and of those that did not are fitted with two
Gaussians N(μ_in, σ_in²) and N(μ_out, σ_out²). The target model's φ is then scored by

    online:   log N(φ; μ_in, σ_in²) − log N(φ; μ_out, σ_out²)       (likelihood ratio)
    offline:  log Φ((φ − μ_out) / σ_out)                              (one-sided, "out" only)

Means are always per example. Variances are per example only with at least
``PER_EXAMPLE_VARIANCE_MIN`` observations on each side; with fewer shadows a variance
pooled over all examples is used, as the paper recommends for small shadow counts.

At the user level (``privacy.unit: user``) the unit is a person: each shadow trains on a
random half of the people with all their records, at the target's per-person sample rate,
and the attack scores each person by the mean φ over their records (dpclip.audit.report).

Shadow runs live in ``RUN/audit/shadows/shadow_NNN/`` (ordinary run directories; the
split of each, the target's plan and each shadow's plan are in
``RUN/audit/shadows/keep.json``); a finished shadow is reused and a partly trained one
resumed, so an interrupted audit picks up where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from scipy.stats import norm

from dpclip import layout
from dpclip.accounting.split import with_current_names
from dpclip.audit.attacks import model_outputs
from dpclip.data import select
from dpclip.data.split import split_fingerprint
from dpclip.errors import DpclipError
from dpclip.files import private_dir, write_json_atomic
from dpclip.models import build_model
from dpclip.recipe.schema import Audit
from dpclip.rundir.checkpoint import latest_checkpoint, load_checkpoint
from dpclip.rundir.run import load_run_recipe
from dpclip.train.workflow import train

PER_EXAMPLE_VARIANCE_MIN = 32
KEEP_FILE = "keep.json"
# What a shadow takes over from the target's meta.json "plan" (σ split as in the target).
IMITATED = ("sample_rate", "steps", "noise_multiplier", "gradient_noise_multiplier", "sigma_aux")


def shadow_keep(num_shadows: int, pool_size: int, seed: int) -> np.ndarray:
    """bool [shadows, pool]: which examples each shadow trains on. Each example is in
    exactly ⌊M/2⌋ shadows, chosen at random (the paper's balanced design)."""
    rng = np.random.default_rng(seed)
    ranks = rng.random((num_shadows, pool_size)).argsort(axis=0).argsort(axis=0)
    return ranks < num_shadows // 2


def shadow_data(pool, keep: np.ndarray, people: np.ndarray | None = None):
    """The PrivateData a shadow trains on: its kept pool rows, the rest held out. With
    ``people`` (the person index of each pool row) the shadow's people are numbered
    0..P'-1 in order of first appearance and its held-out people on from there, as the data
    loader numbers them."""
    train_idx, test_idx = np.flatnonzero(keep), np.flatnonzero(~keep)
    data = replace(pool.data, train=select(pool.tensors, torch.as_tensor(train_idx)),
                   test=select(pool.tensors, torch.as_tensor(test_idx)), train_indices=train_idx,
                   test_indices=test_idx, fingerprint=split_fingerprint(train_idx, test_idx))
    if people is None:
        return data
    numbering = {int(person): n for n, person in enumerate(dict.fromkeys(people[train_idx].tolist()))}
    for person in people[test_idx].tolist():
        numbering.setdefault(int(person), len(numbering))
    number = lambda rows: torch.as_tensor([numbering[int(p)] for p in people[rows]], dtype=torch.int64)  # noqa: E731
    return replace(data, train_users=number(train_idx), test_users=number(test_idx))


def target_plan(run_dir: Path) -> dict[str, Any]:
    """What the target run released per step and for how long, from its meta.json."""
    meta = json.loads((Path(run_dir) / layout.META).read_text(encoding="utf-8"))
    plan = with_current_names(meta["plan"])  # a run written before issue 27 holds sigma_total, sigma_gradient
    return {key: plan[key] for key in IMITATED}


def shadow_plan(target: dict[str, Any], num_train: int, num_users: int | None = None) -> dict[str, Any]:
    """How a shadow with ``num_train`` examples (of ``num_users`` people at the user level)
    imitates ``target`` (a ``target_plan``).

    Re-planning the recipe for the shadow's own N' would give q' = B/N', as many steps as
    its epochs make at that rate and, with privacy.epsilon set, a σ calibrated for both:
    a different mechanism from the target's, and so a weaker attack. Instead the expected
    batch is round(q·N'), the closest an integer batch gets to q (|q' − q| ≤ 1/(2N')),
    and steps and σ are the target's. At the user level N' counts people (q = B/U).
    """
    units = num_train if num_users is None else num_users
    batch = min(max(round(target["sample_rate"] * units), 1), units)
    plan = {"num_train": num_train, "batch_size": batch, "sample_rate": batch / units,
            "steps": target["steps"], "noise_multiplier": target["noise_multiplier"]}
    if num_users is not None:
        plan["num_users"] = num_users
    return plan


def shadow_recipe(recipe, index: int, plan: dict[str, Any]):
    """The run's recipe for shadow ``index`` with ``plan`` (a ``shadow_plan``): its own seed,
    no canaries.

    ``privacy.epsilon`` is dropped: σ is given, so nothing is calibrated, and a shadow is
    the attacker's own model, which no budget cap should stop short of the target's steps.
    σ is the total noise multiplier, which training splits between the gradient and any
    threshold statistic exactly as it did for the target (the same recipe, model and σ).
    """
    # model_copy on the loaded sections keeps every other field as the run had it, whatever
    # fields the schema has by now.
    training = recipe.training.model_copy(update={"epochs": None, "steps": plan["steps"],
                                                  "batch_size": plan["batch_size"]})
    privacy = recipe.privacy.model_copy(update={"epsilon": None, "noise_multiplier": plan["noise_multiplier"]})
    return recipe.model_copy(update={"name": f"shadow-{index:03d}", "seed": recipe.seed + 1 + index,
                                     "audit": Audit(), "training": training, "privacy": privacy})


def _load_or_make_keep(folder: Path, num_shadows: int, pool_size: int, seed: int, target: dict[str, Any],
                       people: np.ndarray | None = None) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """(keep [M, units], each shadow's plan); the units are the pool's rows, or its people."""
    units = pool_size if people is None else int(people.max()) + 1
    path = folder / KEEP_FILE
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        keep = np.asarray(stored["keep"], dtype=bool)
        if "imitates" not in stored:
            raise DpclipError(f"{folder} holds shadow models trained before shadows imitated the target: each was "
                              "planned for its own data size (another sample rate, number of steps and noise "
                              "multiplier), which makes LiRA weaker than it should be",
                              f"delete {folder} and run the audit again to train shadows that imitate the target")
        if with_current_names(stored["imitates"]) != target:
            raise DpclipError(f"the shadow models in {folder} imitate {stored['imitates']}, but the run's plan "
                              f"is now {target}", f"delete {folder} and run the audit again")
        unit = "people" if people is not None else "examples"
        if stored.get("unit", "examples") != unit or keep.shape != (num_shadows, units):
            raise DpclipError(f"{folder} holds {keep.shape[0]} shadow models over {keep.shape[1]} "
                              f"{stored.get('unit', 'examples')}, not {num_shadows} over {units} {unit}",
                              f"pass --shadows {keep.shape[0]} to reuse them, or delete {folder} to start over")
        return keep, [with_current_names(plan) for plan in stored["shadows"]]
    keep = shadow_keep(num_shadows, units, seed)
    if people is None:
        plans = [shadow_plan(target, int(row.sum())) for row in keep]
    else:
        plans = [shadow_plan(target, int(row[people].sum()), int(row.sum())) for row in keep]
    private_dir(folder)
    write_json_atomic(path, {"seed": seed, "imitates": target, "unit": "examples" if people is None else "people",
                             "shadows": plans, "keep": keep.astype(int).tolist()})
    return keep, plans


def _check_trained_as_planned(shadow_dir: Path, plan: dict[str, Any]) -> None:
    """A shadow found on disk must have been trained with ``plan`` (it may predate keep.json)."""
    trained = realised_plan(shadow_dir)
    if any(trained.get(key) != plan.get(key) for key in ("num_train", "num_users", "sample_rate", "steps",
                                                          "noise_multiplier")):
        raise DpclipError(f"{shadow_dir} was trained with {trained}, not with the plan in its {KEEP_FILE} ({plan})",
                          f"delete {shadow_dir.parent} and run the audit again")


def realised_plan(shadow_dir: Path) -> dict[str, Any]:
    """What a shadow run planned and released (from its meta.json), for the audit report."""
    plan = with_current_names(json.loads((Path(shadow_dir) / layout.META).read_text(encoding="utf-8"))["plan"])
    realised = {key: plan[key] for key in ("num_train", *IMITATED)}
    if plan.get("num_users") is not None:
        realised["num_users"] = plan["num_users"]
    return realised


def train_shadows(run_dir: Path, recipe, pool, num_shadows: int, seed: int,
                  observer_for: Callable[[int, int], Any] | None = None) -> tuple[np.ndarray, list[Path]]:
    """Train (or finish, or reuse) the shadow models; returns (keep [M, units], shadow dirs),
    the units being the pool's rows, or at the user level its people (``pool.people``).

    ``observer_for(index, total)`` gives the TrainObserver of one shadow (a progress bar).
    """
    folder = layout.audit_dir(run_dir) / layout.SHADOWS
    people = pool.people if recipe.privacy.unit == "user" else None
    keep, plans = _load_or_make_keep(folder, num_shadows, pool.size, seed, target_plan(run_dir), people)
    dirs = []
    for index in range(num_shadows):
        shadow_dir = folder / f"shadow_{index:03d}"
        dirs.append(shadow_dir)
        if (shadow_dir / layout.META).exists():
            _check_trained_as_planned(shadow_dir, plans[index])
        summary = shadow_dir / layout.SUMMARY
        if summary.exists() and json.loads(summary.read_text())["stopped"] == "completed":
            continue
        observer = observer_for(index, num_shadows) if observer_for else None
        data = shadow_data(pool, keep[index] if people is None else keep[index][people], people)
        if (shadow_dir / layout.RECIPE).exists():
            train(resume=shadow_dir, data=data, observer=observer)
        else:
            train(shadow_recipe(recipe, index, plans[index]), data=data, run_dir=shadow_dir, observer=observer)
    return keep, dirs


def shadow_confidences(dirs: list[Path], pool) -> np.ndarray:
    """φ of every shadow (its last checkpoint, loaded from safetensors) on the pool: [M, n]."""
    rows = []
    for shadow_dir in dirs:
        recipe = load_run_recipe(shadow_dir)
        model, loss_fn = build_model(recipe.model, pool.data, seed=recipe.seed)
        load_checkpoint(latest_checkpoint(shadow_dir), model)
        rows.append(model_outputs(model, loss_fn, pool.tensors, pool.data.task).confidence)
    return np.stack(rows)


def _fit(values: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-example mean and std of ``values`` [M, n] where ``mask``; pooled std with few
    shadows; std None when no example has two observations on this side (pooling has no
    degree of freedom: two shadows give each example one "in" and one "out")."""
    counts = mask.sum(axis=0)
    safe = np.maximum(counts, 1)
    mean = np.where(mask, values, 0.0).sum(axis=0) / safe
    deviation = np.where(mask, values - mean, 0.0)
    if counts.min() >= PER_EXAMPLE_VARIANCE_MIN:
        return mean, np.maximum(np.sqrt((deviation ** 2).sum(axis=0) / (counts - 1)), 1e-6)
    freedom = int((counts - 1).clip(min=0).sum())
    if freedom == 0:
        return mean, None
    return mean, np.full(values.shape[1], max(np.sqrt((deviation ** 2).sum() / freedom), 1e-6))


def gaussians(shadows: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(μ_in, σ_in, μ_out, σ_out) per example from the shadows' φ [M, n] (module doc).

    Where a side has no degree of freedom for its variance, both sides are taken to share
    one σ, estimated from the examples seen on both sides: Var(φ_in − φ_out) = 2σ² around
    the mean gap."""
    mu_in, sd_in = _fit(shadows, keep)
    mu_out, sd_out = _fit(shadows, ~keep)
    if sd_in is None or sd_out is None:
        both = (keep.sum(axis=0) > 0) & ((~keep).sum(axis=0) > 0)
        gap = (mu_in - mu_out)[both]
        shared = max(float(np.sqrt(np.var(gap, ddof=1) / 2)) if gap.size > 1 else 1.0, 1e-6)
        sd_in = np.full(shadows.shape[1], shared) if sd_in is None else sd_in
        sd_out = np.full(shadows.shape[1], shared) if sd_out is None else sd_out
    return mu_in, sd_in, mu_out, sd_out


def lira_scores(target: np.ndarray, shadows: np.ndarray, keep: np.ndarray) -> dict[str, np.ndarray]:
    """Online and offline LiRA scores of the target's confidences ``target`` [n] (module doc)."""
    mu_in, sd_in, mu_out, sd_out = gaussians(shadows, keep)
    no_in = keep.sum(axis=0) == 0
    if no_in.any():  # no "in" fit for some examples: shift the "out" fit by the mean gap
        gap = np.mean(mu_in[~no_in] - mu_out[~no_in]) if (~no_in).any() else 0.0
        mu_in = np.where(no_in, mu_out + gap, mu_in)
    online = norm.logpdf(target, mu_in, sd_in) - norm.logpdf(target, mu_out, sd_out)
    offline = norm.logcdf((target - mu_out) / sd_out)
    return {"online": online, "offline": offline}
