"""Plots written into a run directory (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_thresholds(metrics_path: Path, out_path: Path, group_names: list[str], max_groups: int = 12) -> None:
    """C_t per group over the steps of a run (thresholds.png)."""
    import matplotlib  # lazy: slow to import, and only the end of a run draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, thresholds = [], []
    for line in Path(metrics_path).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "thresholds" in record:
            steps.append(record["step"])
            thresholds.append(record["thresholds"])
    if not steps:
        return
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    for k, name in enumerate(group_names[:max_groups]):
        axis.plot(steps, [row[k] for row in thresholds], label=name, linewidth=1.2)
    axis.set_xlabel("step")
    axis.set_ylabel("clipping threshold C")
    axis.set_yscale("log")
    axis.set_title("thresholds per group" + (f" (first {max_groups})" if len(group_names) > max_groups else ""))
    if len(group_names) <= 8:
        axis.legend(fontsize=7)
    figure.tight_layout()
    tmp = out_path.with_name(out_path.name + ".tmp.png")
    figure.savefig(tmp)
    plt.close(figure)
    tmp.replace(out_path)
