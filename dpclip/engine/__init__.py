"""The private gradient: book-keeping norms, group-wise clipping, noise (docs/engine.md).

Pure torch: no YAML, no CLI, no IO. Entry point: :class:`DPEngine`.
"""

from dpclip.engine.engine import DEFAULT_CLIPPING, DPEngine, StepReport
from dpclip.engine.groups import Groups, build_groups, trainable_params
from dpclip.engine.noise import effective_noise_multiplier
from dpclip.engine.layers import LayerRule, register_layer_rule
from dpclip.engine.policies import (AuxRelease, PolicyContext, PolicySpec, ThresholdPolicy, build_policy,
                                    initial_thresholds, register_policy, register_threshold_policy)
from dpclip.engine.policies.fixed import FixedThreshold

__all__ = [
    "DPEngine", "StepReport", "DEFAULT_CLIPPING", "Groups", "build_groups", "trainable_params",
    "effective_noise_multiplier", "LayerRule", "register_layer_rule", "AuxRelease",
    "FixedThreshold", "PolicyContext", "PolicySpec", "ThresholdPolicy", "build_policy", "initial_thresholds",
    "register_policy", "register_threshold_policy",
]
