"""``clipping.grouping``: its names and forms, normalised and checked (docs/engine.md, "Groups and
early finalization"); and what training.parallel does not run with, known from the recipe alone."""

from __future__ import annotations

import re
from typing import Any

GROUPING_NAMES = ("all-layer", "layer", "param", "block")
GROUPING_HELP = ("all-layer, layer, param, block, {uniform: M}, {groups: [[regex, ...], ...]} "
                 "or {stages: [regex, ...]}")


def validate_grouping(value: Any) -> Any:
    """Normalise and check ``clipping.grouping`` (a name or a one-key mapping)."""
    if isinstance(value, str):
        if value not in GROUPING_NAMES:
            raise ValueError(f"{value!r} is not one of {GROUPING_HELP}")
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"must be one of {GROUPING_HELP}")
    (key, arg), = value.items()
    if key == "uniform":
        if not isinstance(arg, int) or isinstance(arg, bool) or arg < 1:
            raise ValueError("{uniform: M} needs a whole number M >= 1 of groups")
        return {"uniform": arg}
    if key == "groups":
        if (not isinstance(arg, list) or not arg
                or not all(isinstance(g, list) and g and all(isinstance(p, str) for p in g) for g in arg)):
            raise ValueError("{groups: ...} needs a non-empty list of non-empty lists of regexes")
        patterns = [p for g in arg for p in g]
    elif key == "stages":
        if not isinstance(arg, list) or not arg or not all(isinstance(p, str) for p in arg):
            raise ValueError("{stages: ...} needs a non-empty list of regexes, one per stage")
        patterns = arg
    else:
        raise ValueError(f"{{{key}: ...}} is not one of {GROUPING_HELP}")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a valid regex: {exc}") from None
    return {key: arg}


def check_parallel(recipe) -> None:
    """What training.parallel does not run with, known from the recipe alone (docs/distributed.md):
    refused by validation, so ``dpclip validate``, ``account`` and ``tune-cost`` refuse it as training does."""
    training, grouping = recipe.training, recipe.clipping.grouping
    if training.parallel == "pipeline" and training.precision != "fp32":
        raise ValueError(f"training.precision {training.precision!r} does not run on pipeline stages yet; set "
                         "training.precision: fp32 with training.parallel: pipeline")
    if training.parallel == "pipeline" and recipe.clipping.threshold.kind not in ("fixed", "quantile"):
        raise ValueError(f"clipping.threshold kind {recipe.clipping.threshold.kind!r} does not run on pipeline stages "
                         "yet; use kind fixed or quantile (per-stage quantiles) with training.parallel: pipeline")
    if training.parallel == "fsdp" and isinstance(grouping, dict) and "stages" in grouping:
        raise ValueError("clipping.grouping {stages: ...} clips per pipeline stage, and training.parallel fsdp has "
                         "no stages; use training.parallel: pipeline for per-device clipping, or another grouping")
