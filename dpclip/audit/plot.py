"""audit/roc.png: each attack's ROC on log-log axes, under the ceiling DP puts on it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dpclip.audit.metrics import dp_tpr_bound


def plot_roc(report: dict, path: Path) -> None:
    """Draw every attack's ROC and the DP bound TPR ≤ e^ε·FPR + δ of the ledger's (ε, δ).

    Log-log axes show the low-FPR corner, where membership inference matters most
    (Carlini et al. 2022). With n non-members no FPR between 0 and 1/n can be measured,
    so the x axis starts at 1/(2n): points at FPR = 0 are drawn there, and TPR = 0 at the
    y floor.
    """
    import matplotlib  # lazy: slow to import, and only a written report draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-4
    counts = [r["non_members"] for r in report["attacks"].values()]
    x_floor = 0.5 / max(counts) if counts else floor
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    grid = np.logspace(math.log10(x_floor), 0, 200)
    ledger = report["ledger"]
    if math.isfinite(ledger["epsilon"]):
        ax.plot(grid, np.maximum(dp_tpr_bound(grid, ledger["epsilon"], ledger["delta"]), floor), "k--",
                label=f"DP bound (ε = {ledger['epsilon']:.3g}, δ = {ledger['delta']:.1g})")
    ax.plot(grid, grid, color="0.7", lw=0.8, label="chance")
    for name, result in report["attacks"].items():
        fpr = np.maximum(np.asarray(result["roc"]["fpr"]), x_floor)
        tpr = np.maximum(np.asarray(result["roc"]["tpr"]), floor)
        ax.plot(fpr, tpr, label=f"{name} (AUC {result['auc']:.3f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_floor, 1)
    ax.set_ylim(floor, 1.05)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(f"membership inference, {report['checkpoint']}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
