"""The private gradient: book-keeping norms, group-wise clipping, noise (docs/engine.md).

Pure torch: no YAML, no CLI, no IO. Entry point: :class:`DPEngine`.
"""

from dpclip.engine.engine import DEFAULT_CLIPPING, DPEngine, StepReport
from dpclip.engine.groups import Groups, build_groups, trainable_params
from dpclip.engine.noise import effective_noise_multiplier
from dpclip.engine.layers import LayerRule, register_layer_rule
from dpclip.engine.thresholds import (AuxRelease, FixedThreshold, PolicyContext, ThresholdPolicy,
                                      register_threshold_policy)

__all__ = [
    "DPEngine", "StepReport", "DEFAULT_CLIPPING", "Groups", "build_groups", "trainable_params",
    "effective_noise_multiplier", "LayerRule", "register_layer_rule", "AuxRelease",
    "FixedThreshold", "PolicyContext", "ThresholdPolicy", "register_threshold_policy",
]

# Threshold policies that live in their own modules register themselves on import.
from dpclip.engine import quantile as _quantile  # noqa: E402,F401
from dpclip.engine import dcsgd as _dcsgd  # noqa: E402,F401
from dpclip.engine import discriminative as _discriminative  # noqa: E402,F401
