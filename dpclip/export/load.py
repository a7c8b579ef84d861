"""Loading a plain-torch export back: the module ``model_card.json`` describes, with its weights.

``dpclip export`` writes a model dpclip built itself (``model.kind`` mlp, cnn or custom) as
``model.safetensors`` beside ``model_card.json`` (the recipe's model section, the input shape,
the task and the number of classes). :func:`load_exported` rebuilds that module with the same
builders training used (dpclip's MLP, for one, begins with an ``nn.Flatten``, so its state
dict names ``1.weight``, ``3.weight``, ...) and loads the weights strictly. A transformers or
peft export loads with their own ``from_pretrained`` instead (docs/export.md, "Loading").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load_file

from dpclip import layout
from dpclip.errors import DpclipError
from dpclip.models.build import build_model
from dpclip.recipe.schema import ModelConfig

CARD = "model_card.json"


@dataclass
class _Shapes:
    """What the model builders read of a data set, from the card: no data is loaded."""

    task: str
    input_shape: tuple[int, ...]
    num_classes: int | None
    label_names: list[str] | None = None
    vocab_size: int | None = None   # text models export through transformers, not here
    train: dict = field(default_factory=lambda: {"features": None})


def build_described(config, task: str | None, input_shape, num_classes: int | None,
                    label_names: list[str] | None = None) -> torch.nn.Module:
    """The module a recipe's model section ``config`` builds for data of these sizes (no data
    loaded): what :func:`load_exported` loads into, and what ``dpclip export`` checks against."""
    model, _ = build_model(config, _Shapes(task, tuple(input_shape), num_classes, label_names))
    return model


def load_exported(folder: str | Path) -> torch.nn.Module:
    """The module of a plain-torch export in ``folder`` (``dpclip export``'s OUT_DIR), in eval
    mode, with the exported weights. Refuses a folder without ``model_card.json`` (a
    transformers export: use ``from_pretrained``) and weights that do not fit the module."""
    folder = Path(folder)
    card_file = folder / CARD
    if not card_file.is_file():
        hint = ("a transformers export loads with AutoModel...from_pretrained(folder)"
                if (folder / "config.json").is_file() else "pass the OUT_DIR of `dpclip export` for an mlp, cnn or "
                "custom model")
        raise DpclipError(f"{folder} has no {CARD}", hint)
    try:
        card = json.loads(card_file.read_text(encoding="utf-8"))
        config = TypeAdapter(ModelConfig).validate_python(card["model"])
        shapes = _Shapes(card["task"], tuple(card["input_shape"]), card.get("num_classes"), card.get("label_names"))
    except (ValueError, KeyError, TypeError, ValidationError) as exc:
        raise DpclipError(f"{card_file} is not a dpclip model card ({type(exc).__name__}: {str(exc)[:200]})",
                          "export the run again with `dpclip export RUN_DIR OUT_DIR --force`") from None
    model = build_described(config, shapes.task, shapes.input_shape, shapes.num_classes, shapes.label_names)
    try:
        model.load_state_dict(load_file(folder / card.get("weights", layout.MODEL_WEIGHTS)))
    except (RuntimeError, OSError) as exc:
        raise DpclipError(f"the weights in {folder} do not fit the module its card describes ({str(exc)[:200]})",
                          "export the run again with `dpclip export RUN_DIR OUT_DIR --force`") from None
    return model.eval()


__all__ = ["load_exported"]
