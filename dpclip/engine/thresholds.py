"""Compatibility: threshold policies moved to :mod:`dpclip.engine.policies` (one file each).

Kept so that existing imports (``dpclip.engine.engine``, ``dpclip.tuning.compare``) keep
working until they import from the new home; new code imports from there.
"""

from dpclip.engine.policies import (AuxRelease, PolicyContext, ThresholdPolicy, build_policy, initial_thresholds,
                                    register_threshold_policy, threshold_kinds)
from dpclip.engine.policies.fixed import FixedThreshold

__all__ = ["AuxRelease", "PolicyContext", "ThresholdPolicy", "FixedThreshold", "build_policy", "initial_thresholds",
           "register_threshold_policy", "threshold_kinds"]
