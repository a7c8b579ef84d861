"""The Hessian diagnostics' plots (docs/hessian-diagnostics.md), drawn like the
run's other plots (:mod:`dpclip.train.plots`: matplotlib without a display, atomic PNGs):

- ``hessian_over_training.png``: tr(H) and the three terms of eq. (6)'s denominator
  (B·GᵀHG, tr(HΣ), the decelerator) against the step (the pre-training paper's Figure 6);
- ``improvement_vs_batch.png``: ΔL*(B) on a log grid of B, private and non-private, with
  B*_DP marked (its Figure 5).

A plot that shows anything measured on private data says "not covered by ε" in its title.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dpclip import layout
from dpclip.diagnose import HessianDiagnostics
from dpclip.train.plots import integer_steps, load_pyplot, save_figure

HESSIAN_PLOT = layout.HESSIAN_PLOT
IMPROVEMENT_PLOT = layout.IMPROVEMENT_PLOT
NOT_COVERED = "not covered by ε"


def _label(private: bool) -> str:
    return f" — private data, {NOT_COVERED}" if private else " — public data"


def _value(record: dict[str, Any], key: str) -> float:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def hessian_figure(records: list[dict[str, Any]]):
    """tr(H) (± one standard error) and the denominator terms of eq. (6) against the step."""
    plt = load_pyplot()
    records = sorted(records, key=lambda r: r["step"])
    steps = [int(r["step"]) for r in records]
    private = any(r.get("data") == "private" for r in records)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
    trace = [_value(r, "trace_h") for r in records]
    top.errorbar(steps, trace, yerr=[_value(r, "trace_h_stderr") for r in records], marker="o", markersize=3,
                 capsize=2, label="tr(H) (Hutchinson ± s.e.)")
    top.set_ylabel("tr(H)")
    top.legend(fontsize=7)
    terms = {
        "B·GᵀHG": [_value(r, "batch_size_dp") * _value(r, "gthg") for r in records],
        "tr(HΣ)": [_value(r, "trace_h_sigma") for r in records],
        "decelerator σ²tr(H)/(Bc²)": [_value(r, "decelerator") for r in records],
    }
    for name, values in terms.items():
        bottom.plot(steps, values, marker="o", markersize=3, label=name)
    sizes = [abs(v) for values in terms.values() for v in values if math.isfinite(v) and v != 0]
    if sizes:  # GᵀHG and tr(H) can be negative early in training: log scale away from 0, linear near it
        bottom.set_yscale("symlog", linthresh=max(min(sizes), max(sizes) * 1e-4))
    bottom.set_ylabel("denominator terms of ΔL*")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7)
    integer_steps(bottom)
    figure.suptitle(f"Hessian diagnostics over training{_label(private)}", fontsize=9)
    figure.tight_layout()
    return figure


def plot_hessian_over_training(records: list[dict[str, Any]], out_path: Path) -> None:
    """hessian_over_training.png from diagnostics.jsonl records (nothing without a record)."""
    if records:
        save_figure(hessian_figure(records), out_path)


def batch_grid(*anchors: float, points: int = 200) -> list[float]:
    """B from 1 to ten times the largest finite anchor (at least 1000), evenly on a log scale."""
    top = max([1000.0] + [10 * a for a in anchors if a is not None and math.isfinite(a) and a > 0])
    return [10 ** (math.log10(top) * k / (points - 1)) for k in range(points)]


def improvement_figure(diag: HessianDiagnostics, *, sigma: float, clip_factor: float, batch_size: int,
                       private: bool):
    """ΔL*(B) of eq. (6) (DP-SGD at σ, c) and eq. (7) (SGD) over B, B*_DP and the recipe's B marked."""
    plt = load_pyplot()
    best = diag.b_star_dp(sigma, clip_factor)
    grid = batch_grid(best, batch_size)
    dp = [diag.improvement(b, sigma, clip_factor) for b in grid]
    sgd = [diag.improvement(b, 0.0, 1.0) for b in grid]
    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    axis.plot(grid, dp, label=f"DP-SGD, σ = {sigma:.3g}, c = {clip_factor:.3g} (eq. 6)", color="tab:red")
    axis.plot(grid, sgd, label="non-private SGD (eq. 7)", color="tab:blue")
    if math.isfinite(best):
        axis.axvline(best, color="tab:red", linestyle="--", linewidth=1, label=f"B*_DP = {best:.3g}")
    axis.axvline(batch_size, color="0.4", linestyle=":", linewidth=1, label=f"recipe's B = {batch_size}")
    axis.set_xscale("log")
    values = [v for v in dp + sgd if math.isfinite(v)]
    if values and min(values) > 0:
        axis.set_yscale("log")
    axis.set_xlabel("batch size B")
    axis.set_ylabel("ΔL*(B), per-sample improvement")
    axis.legend(fontsize=7)
    note = "" if math.isfinite(best) else f" (B*_DP {'= ∞: GᵀHG ≤ 0' if best == math.inf else 'undefined: tr(H) < 0'})"
    axis.set_title(f"best per-sample improvement against B{note}{_label(private)}", fontsize=9)
    figure.tight_layout()
    return figure


def plot_improvement(diag: HessianDiagnostics, out_path: Path, *, sigma: float, clip_factor: float,
                     batch_size: int, private: bool) -> None:
    save_figure(improvement_figure(diag, sigma=sigma, clip_factor=clip_factor, batch_size=batch_size,
                                   private=private), out_path)
