"""The arithmetic of continual runs (docs/continual.md): the schedules' α, the mixed
gradient, the optimizer reset at the switch, the output layer (and the classes it is trained on),
the public batches.

Bu et al., "Pre-training Differentially Private Models with Limited Public Data": section 4
(the mixed gradient), Table 2 (the schedules), appendix B.3 (the reset ablation).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dpclip.data import ShuffleSampler
from dpclip.errors import DpclipError
from dpclip.recipe.continual import MIXING

#: Optimizer state keys each ``continual.at_switch.reset`` entry sets to zero.
RESET_KEYS = {"m": ("exp_avg", "momentum_buffer"), "v": ("exp_avg_sq",), "t": ("step",)}


def dpmd_alpha(step: int, total: int) -> float:
    """α_t = 1 − cos(π t / 2K) for step t = 0 … K − 1 of K (Table 2, DPMD): 0 at the first
    step and below 1 at every step, so every step of the schedule is a private step."""
    return 1.0 - math.cos(math.pi * step / (2 * total))


def sample_alpha(num_public: int, num_private: int) -> float:
    """α = n_pub / (n_pub + n_priv) (Table 2, Sample): each row weighted as if drawn from the union."""
    return num_public / (num_public + num_private)


def mix_gradients(params, public: dict[int, torch.Tensor], alpha: float) -> None:
    """``p.grad = α · public_mean + (1 − α) · p.grad`` in place, ``p.grad`` being the engine's
    (Σ clipped + noise) / B (section 4's g_α)."""
    for p in params:
        private = p.grad if p.grad is not None else torch.zeros_like(p)
        mixed = private.mul(1.0 - alpha)
        if id(p) in public:
            mixed.add_(public[id(p)], alpha=alpha)
        p.grad = mixed


def reset_states(state: dict[str, Any], reset: list[str]) -> dict[str, Any]:
    """A copy of one parameter's optimizer state with the ``reset`` entries set to zero
    (appendix B.3: resetting m only was best)."""
    out = {}
    zeroed = {key for name in reset for key in RESET_KEYS[name]}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            value = torch.zeros_like(value) if key in zeroed else value.detach().clone()
        out[key] = value
    return out


def find_head(model: nn.Module, num_classes: int | None) -> tuple[nn.Module, str, nn.Linear]:
    """(parent, attribute, module) of the output layer: the last ``nn.Linear`` with
    ``num_classes`` outputs (any output size when ``num_classes`` is None)."""
    found = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (num_classes is None or module.out_features == num_classes):
            found = name
    if found is None:
        raise DpclipError(f"the model has no output layer (an nn.Linear with {num_classes} outputs) to re-initialise",
                          "set continual.at_switch.reinit_head: false, or use a model whose last layer is a Linear")
    parent_name, _, attribute = found.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return parent, attribute, getattr(parent, attribute)


def modules_sharing(model: nn.Module, head: nn.Module) -> list[str]:
    """The names of the modules other than ``head`` that hold one of its parameters (tied weights)."""
    owned = {id(p) for p in head.parameters()}
    return [name or "(the model)" for name, module in model.named_modules(remove_duplicate=False)
            if module is not head and any(id(p) in owned for p in module.parameters(recurse=False))]


class PublicSampler(ShuffleSampler):
    """Plain shuffled public batches; its own purpose keeps its stream apart from the private samplers'."""

    purpose = "public-sampler"


def class_names(data) -> list[str] | None:
    """The classes of a data set as its labels spell them, in class-id order (ids spelled as
    numbers when its labels are whole numbers); None when it is not classification."""
    if data.task != "classification":
        return None
    return list(data.label_names) if data.label_names is not None else [str(i) for i in range(data.num_classes)]


def check_class_names(public, private, schedule: str, reinit_head: bool) -> None:
    """As many public as private classes, but other ones (a public "fox" at the private "dog"'s id)
    would train the private output layer on the wrong labels: refused unless the head is re-initialised."""
    names = class_names(public), class_names(private)
    if names[0] == names[1] or (reinit_head and schedule == "switch"):
        return
    shown = [repr(n) if len(n) <= 8 else f"{n[:8]!r} and {len(n) - 8} more" for n in names]
    hint = ("use schedule: switch with at_switch.reinit_head: true" if schedule in MIXING else
            "set continual.at_switch.reinit_head: true (the head is re-initialised at the switch), or relabel the "
            "public data with the private classes")
    raise DpclipError(f"the public data has classes {shown[0]} and the private data {shown[1]}: the same class id "
                      "would mean another class to the output layer", hint)
