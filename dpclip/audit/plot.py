"""audit/roc.png: each attack's ROC on log-log axes, under the ceiling DP puts on it
(docs/auditing.md, "roc.png").

An empirical ROC is a step function: a threshold on the scores reaches only the measured
points (FPR_i, TPR_i), so the best TPR at an FPR x is that of the last point with
FPR_i ≤ x. Joining the points by straight lines would claim operating points no threshold
reaches (a long TPR = 0 stretch of a loss attack, then a jump, drawn as a diagonal);
:func:`roc_staircase` draws the steps instead, and places FPR = 0 and TPR = 0, which a log
axis cannot show, on the axes' floors, drawn and labelled as such.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dpclip.accounting import bound_text
from dpclip.audit.metrics import dp_tpr_bound
from dpclip.files import write_with_atomic


def axis_floors(report: dict) -> tuple[float, float]:
    """(x floor, y floor): half the smallest measurable FPR (1/n non-members) and TPR (1/m
    members) of the report's attacks; FPR = 0 and TPR = 0 are drawn there."""
    attacks = report["attacks"].values()
    non_members = max((r["non_members"] for r in attacks), default=1000)
    members = max((r["members"] for r in attacks), default=1000)
    return 0.5 / max(non_members, 1), 0.5 / max(members, 1)


def roc_staircase(fpr, tpr, x_floor: float, y_floor: float) -> tuple[np.ndarray, np.ndarray]:
    """The polyline of an empirical ROC as the step function it is: from each measured
    point, right at the same TPR to the next point's FPR, then up to its TPR. Values below
    the floors (the zeros) are drawn on the floors; nothing is raised above the ROC."""
    fpr = np.asarray(fpr, dtype=float)
    tpr = np.asarray(tpr, dtype=float)
    order = np.lexsort((tpr, fpr))  # sklearn's order already, made sure of
    fpr, tpr = fpr[order], np.maximum.accumulate(tpr[order])
    xs, ys = [fpr[0]], [tpr[0]]
    for x, y in zip(fpr[1:], tpr[1:]):
        if x != xs[-1]:
            xs.append(x)          # right, at the TPR reached so far
            ys.append(ys[-1])
        if y != ys[-1]:
            xs.append(x)          # then up
            ys.append(y)
    return np.maximum(np.asarray(xs), x_floor), np.maximum(np.asarray(ys), y_floor)


def roc_figure(report: dict):
    """The figure of :func:`plot_roc` (returned open, for tests and the run report)."""
    import matplotlib  # lazy: slow to import, and only a written report draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_floor, y_floor = axis_floors(report)
    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    grid = np.logspace(math.log10(x_floor), 0, 400)
    ledger = report["ledger"]
    if math.isfinite(ledger["epsilon"]):
        ax.plot(grid, np.maximum(dp_tpr_bound(grid, ledger["epsilon"], ledger["delta"]), y_floor), "k--", lw=1.0,
                label=f"DP bound TPR ≤ e^ε·FPR + δ (ε = {bound_text(ledger['epsilon'], 3)}, δ = {ledger['delta']:.1g})")
    ax.plot(grid, np.maximum(grid, y_floor), color="0.7", lw=0.8, label="chance")
    for name, result in report["attacks"].items():
        xs, ys = roc_staircase(result["roc"]["fpr"], result["roc"]["tpr"], x_floor, y_floor)
        ax.plot(xs, ys, lw=1.3, label=f"{name} (AUC {result['auc']:.3f})")
    ax.axvline(x_floor, color="0.85", lw=0.6, ls=":")
    ax.axhline(y_floor, color="0.85", lw=0.6, ls=":")
    ax.text(x_floor, y_floor * 1.15, " FPR = 0, TPR = 0 drawn on these floors", fontsize=6, color="0.45")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_floor / 1.3, 1.05)
    ax.set_ylim(y_floor / 1.3, 1.05)
    ax.set_xlabel(f"false positive rate (floor 1/(2n) = {x_floor:.2g})")
    ax.set_ylabel(f"true positive rate (floor 1/(2m) = {y_floor:.2g})")
    ax.set_title(f"membership inference, {report['checkpoint']}\n"
                 "(attack results are measured on private data, not covered by ε)", fontsize=8)
    ax.legend(fontsize=6.5, loc="lower right", bbox_to_anchor=(1.0, 0.07))
    fig.tight_layout()
    return fig


def plot_roc(report: dict, path: Path) -> None:
    """Draw every attack's ROC (as a step function, :func:`roc_staircase`) and the DP bound
    TPR ≤ e^ε·FPR + δ of the ledger's (ε, δ) into ``path``, atomically.

    Log-log axes show the low-FPR corner, where membership inference matters most
    (docs/auditing.md). With n non-members no FPR between 0 and 1/n can be measured, so
    the x axis starts at 1/(2n), where FPR = 0 is drawn; TPR = 0 likewise at 1/(2m).
    """
    import matplotlib.pyplot as plt

    fig = roc_figure(report)
    try:   # the atomic writers' temporary name: a crash's leftover to the release manifest
        write_with_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120), durable=False)
    finally:
        plt.close(fig)
