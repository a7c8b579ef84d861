"""Hessian diagnostics of DP training (docs/hessian-diagnostics.md).

Pure torch, at the engine's layer: :func:`measure` takes a model, a per-sample loss and a
batch of rows and returns a :class:`HessianDiagnostics` (tr(H) by Hutchinson, GᵀHG,
tr(HΣ), |G|², E‖g_i‖²), whose methods give the pre-training paper's decelerator, ΔL*(B),
B*_DP and α*. Where the rows come from, and how the result is labelled, is the caller's
business (``dpclip.train.diagnostics``).
"""

from dpclip.diagnose.hessian import HessianDiagnostics, measure, typical_clip_factor

__all__ = ["HessianDiagnostics", "measure", "typical_clip_factor"]
