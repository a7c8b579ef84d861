"""The private gradient: book-keeping norms, group-wise clipping, noise (docs/engine.md).

Pure torch: no YAML, no CLI, no IO. Entry point: :class:`DPEngine`.

The names below are loaded on first use (PEP 562): the recipe schema imports
``dpclip.engine.policies`` for the policies' specs, and loading a recipe should not pay for
the whole engine (dp_accounting, transformers' Conv1D, torch.func), about three seconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "DPEngine": "engine", "StepReport": "report", "CLIPPING_DEFAULTS": "spec", "ClippingSpec": "spec",
    "Groups": "groups", "build_groups": "groups", "trainable_params": "groups",
    "effective_noise_multiplier": "noise",
    "LayerRule": "layers", "register_layer_rule": "layers",
    "AuxRelease": "policies", "PolicyContext": "policies", "PolicySpec": "policies", "ThresholdPolicy": "policies",
    "build_policy": "policies", "initial_thresholds": "policies", "register_policy": "policies",
    "register_threshold_policy": "policies",
    "FixedThreshold": "policies.fixed",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dpclip.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dpclip.engine.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from dpclip.engine.engine import DPEngine
    from dpclip.engine.spec import CLIPPING_DEFAULTS, ClippingSpec
    from dpclip.engine.report import StepReport
    from dpclip.engine.groups import Groups, build_groups, trainable_params
    from dpclip.engine.layers import LayerRule, register_layer_rule
    from dpclip.engine.noise import effective_noise_multiplier
    from dpclip.engine.policies import (AuxRelease, PolicyContext, PolicySpec, ThresholdPolicy, build_policy,
                                        initial_thresholds, register_policy, register_threshold_policy)
    from dpclip.engine.policies.fixed import FixedThreshold
