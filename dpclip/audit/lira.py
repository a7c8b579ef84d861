"""LiRA, the likelihood-ratio attack (Carlini, Chien, Nasr, Song, Terzis, Tramèr 2022).

Shadow models are trained from the run's own recipe, each on a random half of the
pool (the run's members + non-members), so that every example is "in" for half of the
shadows and "out" for the other half. For each example, the logit-scaled confidences
φ of the shadows that trained on it and of those that did not are fitted with two
Gaussians N(μ_in, σ_in²) and N(μ_out, σ_out²). The target model's φ is then scored by

    online:   log N(φ; μ_in, σ_in²) − log N(φ; μ_out, σ_out²)       (likelihood ratio)
    offline:  log Φ((φ − μ_out) / σ_out)                              (one-sided, "out" only)

Means are always per example. Variances are per example only with at least
``PER_EXAMPLE_VARIANCE_MIN`` observations on each side; with fewer shadows a variance
pooled over all examples is used, as the paper recommends for small shadow counts.

Shadow runs live in ``RUN/audit/shadows/shadow_NNN/`` (ordinary run directories; the
split of each is in ``RUN/audit/shadows/keep.json``); a finished shadow is reused and a
partly trained one resumed, so an interrupted audit picks up where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from scipy.stats import norm

from dpclip.errors import DpclipError

PER_EXAMPLE_VARIANCE_MIN = 32
KEEP_FILE = "keep.json"


def shadow_keep(num_shadows: int, pool_size: int, seed: int) -> np.ndarray:
    """bool [shadows, pool]: which examples each shadow trains on. Each example is in
    exactly ⌊M/2⌋ shadows, chosen at random (the paper's balanced design)."""
    rng = np.random.default_rng(seed)
    ranks = rng.random((num_shadows, pool_size)).argsort(axis=0).argsort(axis=0)
    return ranks < num_shadows // 2


def shadow_data(pool, keep: np.ndarray):
    """The PrivateData a shadow trains on: its kept pool examples, the rest held out."""
    from dpclip.data import select
    from dpclip.data.split import split_fingerprint

    train_idx, test_idx = np.flatnonzero(keep), np.flatnonzero(~keep)
    return replace(pool.data, train=select(pool.tensors, torch.as_tensor(train_idx)),
                   test=select(pool.tensors, torch.as_tensor(test_idx)), train_indices=train_idx,
                   test_indices=test_idx, fingerprint=split_fingerprint(train_idx, test_idx))


def shadow_recipe(recipe, index: int):
    """The run's recipe for shadow ``index``: its own seed (init, sampling, noise), no canaries."""
    from dpclip.recipe.schema import Audit

    return recipe.model_copy(update={"name": f"shadow-{index:03d}", "seed": recipe.seed + 1 + index,
                                     "audit": Audit()})


def _load_or_make_keep(folder: Path, num_shadows: int, pool_size: int, seed: int) -> np.ndarray:
    path = folder / KEEP_FILE
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        keep = np.asarray(stored["keep"], dtype=bool)
        if keep.shape != (num_shadows, pool_size):
            raise DpclipError(f"{folder} holds {keep.shape[0]} shadow models over {keep.shape[1]} examples, "
                              f"not {num_shadows} over {pool_size}",
                              f"pass --shadows {keep.shape[0]} to reuse them, or delete {folder} to start over")
        return keep
    from dpclip.train.files import write_json_atomic

    keep = shadow_keep(num_shadows, pool_size, seed)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"seed": seed, "keep": keep.astype(int).tolist()})
    return keep


def train_shadows(run_dir: Path, recipe, pool, num_shadows: int, seed: int,
                  observer_for: Callable[[int, int], Any] | None = None) -> tuple[np.ndarray, list[Path]]:
    """Train (or finish, or reuse) the shadow models; returns (keep [M, n], shadow dirs).

    ``observer_for(index, total)`` gives the TrainObserver of one shadow (a progress bar).
    """
    from dpclip.train.workflow import train

    folder = Path(run_dir) / "audit" / "shadows"
    keep = _load_or_make_keep(folder, num_shadows, pool.size, seed)
    dirs = []
    for index in range(num_shadows):
        shadow_dir = folder / f"shadow_{index:03d}"
        dirs.append(shadow_dir)
        summary = shadow_dir / "summary.json"
        if summary.exists() and json.loads(summary.read_text())["stopped"] == "completed":
            continue
        observer = observer_for(index, num_shadows) if observer_for else None
        data = shadow_data(pool, keep[index])
        if (shadow_dir / "recipe.yaml").exists():
            train(resume=shadow_dir, data=data, observer=observer)
        else:
            train(shadow_recipe(recipe, index), data=data, run_dir=shadow_dir, observer=observer)
    return keep, dirs


def shadow_confidences(dirs: list[Path], pool) -> np.ndarray:
    """φ of every shadow (its last checkpoint, loaded from safetensors) on the pool: [M, n]."""
    from dpclip.audit.attacks import model_outputs
    from dpclip.models import build_model
    from dpclip.train.checkpoint import latest_checkpoint, load_checkpoint
    from dpclip.train.workflow import load_run_recipe

    rows = []
    for shadow_dir in dirs:
        recipe = load_run_recipe(shadow_dir)
        model, loss_fn = build_model(recipe.model, pool.data, seed=recipe.seed)
        load_checkpoint(latest_checkpoint(shadow_dir), model)
        rows.append(model_outputs(model, loss_fn, pool.tensors, pool.data.task).confidence)
    return np.stack(rows)


def _fit(values: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-example mean and std of ``values`` [M, n] where ``mask``; pooled std with few shadows."""
    counts = mask.sum(axis=0)
    safe = np.maximum(counts, 1)
    mean = np.where(mask, values, 0.0).sum(axis=0) / safe
    deviation = np.where(mask, values - mean, 0.0)
    if counts.min() >= PER_EXAMPLE_VARIANCE_MIN:
        std = np.sqrt((deviation ** 2).sum(axis=0) / (counts - 1))
    else:
        pooled = (deviation ** 2).sum() / max(int((counts - 1).clip(min=0).sum()), 1)
        std = np.full(values.shape[1], np.sqrt(pooled))
    return mean, np.maximum(std, 1e-6)


def lira_scores(target: np.ndarray, shadows: np.ndarray, keep: np.ndarray) -> dict[str, np.ndarray]:
    """Online and offline LiRA scores of the target's confidences ``target`` [n] (module doc)."""
    mu_in, sd_in = _fit(shadows, keep)
    mu_out, sd_out = _fit(shadows, ~keep)
    no_in = keep.sum(axis=0) == 0
    if no_in.any():  # a single shadow: no "in" fit for some examples, shift the "out" fit by the mean gap
        gap = np.mean(mu_in[~no_in] - mu_out[~no_in]) if (~no_in).any() else 0.0
        mu_in = np.where(no_in, mu_out + gap, mu_in)
    online = norm.logpdf(target, mu_in, sd_in) - norm.logpdf(target, mu_out, sd_out)
    offline = norm.logcdf((target - mu_out) / sd_out)
    return {"online": online, "offline": offline}
