"""Which recipe fields decide a run's ledger, and how two recipes differ in them: the privacy
fingerprint written when a run starts (a resume refuses a recipe whose fingerprint moved) and the
field-by-field changes a resume records (docs/training.md, "Interruptions and resume")."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dpclip.recipe import Recipe


# Fields whose change would change what the ledger means: a run refuses to resume if any differ.
PRIVACY_FIELDS = ("seed", "data", "privacy", "clipping", "training.batch_size", "training.sampling",
                  "training.epochs", "training.steps", "training.micro_batch_size", "public", "continual")
# Fields left out of the fingerprint while unset, so runs from before they existed still resume.
_OPTIONAL_FIELDS = ("public", "continual")


def privacy_fingerprint(recipe: Recipe) -> str:
    """Hash of the recipe fields that decide the ledger (see PRIVACY_FIELDS)."""
    dumped = recipe.model_dump(mode="json")
    picked = {}
    for dotted in PRIVACY_FIELDS:
        node: Any = dumped
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None and dotted in _OPTIONAL_FIELDS:
            continue
        if dotted == "data" and isinstance(node, dict) and node.get("public_fraction") is None:
            node = {k: v for k, v in node.items() if k != "public_fraction"}
        picked[dotted] = node
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


# Fields the privacy plan's q and steps come from (PRIVACY_FIELDS outside privacy.*).
PLAN_FIELDS = ("training.batch_size", "training.sampling", "training.epochs", "training.steps")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def recipe_changes(old: Recipe, new: Recipe) -> dict[str, list[Any]]:
    """``{dotted field: [old value, new value]}`` of every field that differs (leaves only)."""
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return {key: [a.get(key), b.get(key)] for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)}


def privacy_diff(old: Recipe, new: Recipe) -> list[str]:
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    changed = []
    for dotted in PRIVACY_FIELDS:
        x, y = a, b
        for part in dotted.split("."):
            x = x.get(part) if isinstance(x, dict) else None
            y = y.get(part) if isinstance(y, dict) else None
        if x != y:
            changed.append(dotted)
    return changed
