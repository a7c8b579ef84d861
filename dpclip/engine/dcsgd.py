"""Compatibility: DC-SGD moved to :mod:`dpclip.engine.policies.histogram`.

Kept so that existing imports (scripts/methods_evidence.py, tests/privacy) keep working until
they import from the new home; new code imports from there.
"""

from dpclip.engine.policies.histogram import (CANDIDATE_STEPS, MAX_RECENTRE, HistogramThreshold, error_range,
                                              error_threshold, expected_error, histogram_counts,
                                              histogram_sensitivity, midpoints, percentile_threshold)

__all__ = ["CANDIDATE_STEPS", "MAX_RECENTRE", "HistogramThreshold", "error_range", "error_threshold",
           "expected_error", "histogram_counts", "histogram_sensitivity", "midpoints", "percentile_threshold"]
