"""Plots written into a run directory (matplotlib, no display needed): docs/training.md,
"Plots and logging".

Every plot is drawn only from metrics.jsonl. ``training.png`` shows ε (charged, in the
ledger) beside the loss and held-out metrics, which are exact diagnostics not covered by ε
and are labelled so on the plot; ``thresholds.png`` shows the clipping thresholds (charged
releases) per named group: lines with a legend, a heat-map for many groups, or the
constant values of a run whose thresholds never moved.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dpclip import layout
from dpclip.errors import DpclipError
from dpclip.files import read_jsonl as read_metrics  # noqa: F401  (re-exported: report.py, tests)
from dpclip.files import write_with_atomic
from dpclip.rundir.metrics import is_step

TRAINING_PLOT = layout.TRAINING_PLOT
THRESHOLDS_PLOT = layout.THRESHOLDS_PLOT
#: Above this many groups thresholds.png is a heat-map (steps x groups) instead of lines.
MAX_LINES = 12
NOT_COVERED = "exact, NOT covered by ε"


def load_pyplot():
    import matplotlib  # lazy: slow to import, and only the end of a run (or a report) draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, out_path: Path) -> None:
    """Write ``figure`` as PNG atomically (owner-only; a save cut short leaves the atomic writers'
    ``.NAME.XXXXXXXX.tmp``, which the release manifest knows as a crash's leftover) and close it."""
    plt = load_pyplot()
    try:   # (bbox tight: legends outside the axes are kept)
        write_with_atomic(out_path, lambda tmp: figure.savefig(tmp, format="png", dpi=100, bbox_inches="tight"),
                          durable=False)
    finally:
        plt.close(figure)


# ------------------------------------------------------------------ training.png

def training_series(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """The curves of training.png from metrics.jsonl records: ``epsilon`` (charged), and the
    diagnostics ``train_loss`` and ``eval_<metric>`` (held-out), present only when the run
    wrote them (``privacy.exact_diagnostics: true``)."""
    series: dict[str, tuple[list[int], list[float]]] = {}

    def add(name: str, step: int, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps, values = series.setdefault(name, ([], []))
            steps.append(int(step))
            values.append(float(value))

    for record in records:
        if not is_step(record.get("step")):
            continue   # not a record the loop wrote (an edited file): nothing to draw
        if "eval" in record:
            for metric, value in (record["eval"] if isinstance(record["eval"], dict) else {}).items():
                add(f"eval_{metric}", record["step"], value)
            continue
        add("epsilon", record["step"], record.get("epsilon"))
        add("train_loss", record["step"], (record.get("diagnostics") or {}).get("train_loss"))
    return series


def training_figure(records: list[dict[str, Any]], *, epsilon_cap: float | None = None,
                    delta: float | None = None):
    """Loss, held-out metrics and ε over the steps; the diagnostics' panels say they are
    not covered by ε, and without diagnostics only ε is drawn, with the reason."""
    plt = load_pyplot()
    series = training_series(records)
    evals = sorted(k for k in series if k.startswith("eval_") and k != "eval_loss")
    losses = [k for k in ("train_loss", "eval_loss") if k in series]
    panels = (["loss"] if losses else []) + (["eval"] if evals else []) + ["epsilon"]
    figure, axes = plt.subplots(len(panels), 1, figsize=(6.4, 2.4 * len(panels) + 0.6), sharex=True, squeeze=False)
    axes = [row[0] for row in axes]
    for axis, panel in zip(axes, panels):
        if panel == "loss":
            labels = {"train_loss": "training batch loss", "eval_loss": "held-out loss"}
            for key in losses:
                steps, values = series[key]
                axis.plot(steps, values, marker="o" if key == "eval_loss" else None, markersize=3,
                          linewidth=1.0 if key == "train_loss" else 1.4, label=labels[key])
            axis.set_ylabel("loss")
            axis.set_title(f"loss ({NOT_COVERED})", fontsize=9)
            axis.legend(fontsize=7)
        elif panel == "eval":
            for key in evals:
                steps, values = series[key]
                axis.plot(steps, values, marker="o", markersize=3, label=key[len("eval_"):])
            axis.set_ylabel("held-out")
            axis.set_title(f"held-out metrics ({NOT_COVERED})", fontsize=9)
            axis.legend(fontsize=7)
        else:
            steps, values = series.get("epsilon", ([], []))
            axis.plot(steps, values, marker=".", markersize=3, color="tab:red", label="ε spent (ledger)")
            if epsilon_cap is not None:
                axis.axhline(epsilon_cap, color="0.4", linestyle="--", linewidth=0.8, label=f"cap ε = {epsilon_cap:g}")
            axis.set_ylabel("ε" + (f" (δ = {delta:.1g})" if delta is not None else ""))
            axis.set_title("privacy spent (charged in the ledger)", fontsize=9)
            axis.legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("step")
    integer_steps(axes[-1])
    figure.suptitle("training: loss and held-out metrics are diagnostics not covered by ε" if len(panels) > 1
                    else "training: privacy spent. No loss or accuracy: privacy.exact_diagnostics is false\n"
                    "(exact diagnostics would not be covered by ε)", fontsize=9)
    figure.tight_layout()
    return figure


def plot_training(metrics_path: Path, out_path: Path, *, epsilon_cap: float | None = None,
                  delta: float | None = None) -> None:
    """training.png of a run from its metrics.jsonl (nothing when it holds no step)."""
    records = read_metrics(metrics_path)
    if not any("eval" not in r for r in records):
        return
    save_figure(training_figure(records, epsilon_cap=epsilon_cap, delta=delta), out_path)


# ------------------------------------------------------------------ thresholds.png

def threshold_rows(records: list[dict[str, Any]]) -> tuple[list[int], list[list[float]]]:
    """(steps, thresholds per group) of the step records; a record whose thresholds are not one
    finite number per group (as many as the first record's) is refused: metrics.jsonl is damaged."""
    steps, rows = [], []
    for record in records:
        if record.get("thresholds") is not None and "eval" not in record and is_step(record.get("step")):
            row = record["thresholds"]
            if not (isinstance(row, list) and row and all(_finite_number(c) for c in row)
                    and len(row) == len(rows[0] if rows else row)):
                raise DpclipError(f"{layout.METRICS} step {record['step']}: the thresholds are not one number "
                                  "per clipping group: the file is damaged",
                                  f"restore {layout.METRICS} from a backup of the run directory")
            steps.append(record["step"])
            rows.append([float(c) for c in row])
    return steps, rows


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def threshold_layout(rows: list[list[float]], max_lines: int = MAX_LINES) -> str:
    """How thresholds.png draws the run: ``"constant"`` (no threshold ever moved),
    ``"lines"`` (one named line per group) or ``"heatmap"`` (more than ``max_lines`` groups)."""
    if all(row == rows[0] for row in rows):
        return "constant"
    return "lines" if len(rows[0]) <= max_lines else "heatmap"


def _names(names: list[str], limit: int = 4) -> str:
    import textwrap

    shown = ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
    return "\n".join(textwrap.wrap(shown, 70))


def integer_steps(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def _tight(figure) -> None:
    import warnings

    with warnings.catch_warnings():  # long group names: savefig's bbox_inches="tight" makes room
        warnings.simplefilter("ignore", UserWarning)
        figure.tight_layout()


def thresholds_figure(steps: list[int], rows: list[list[float]], group_names: list[str], *,
                      policy: str | None = None, max_lines: int = MAX_LINES):
    """C_t per named group over the steps (see :func:`threshold_layout`)."""
    plt = load_pyplot()
    groups = len(rows[0])
    names = list(group_names)[:groups] + [f"group {k}" for k in range(len(group_names), groups)]
    layout = threshold_layout(rows, max_lines)
    about = f" ({policy} policy)" if policy else ""
    if layout == "constant":
        distinct = sorted(set(rows[0]))
        figure, axis = plt.subplots(figsize=(8.5, 2.4 + 0.25 * len(distinct)))
        for value in distinct:
            members = [n for n, c in zip(names, rows[0]) if c == value]
            axis.plot([steps[0], steps[-1]], [value, value], linewidth=2,
                      label=f"C = {value:g}: {len(members)} group{'s' * (len(members) != 1)}: {_names(members)}")
        axis.set_title(f"fixed thresholds{about}: constant over all {len(steps)} steps", fontsize=9)
        axis.set_xlabel("step")
        axis.set_ylabel("clipping threshold C")
        axis.set_ylim(0, max(distinct) * 1.25)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    elif layout == "lines":
        figure, axis = plt.subplots(figsize=(8.5, 3.8))
        for k, name in enumerate(names):
            axis.plot(steps, [row[k] for row in rows], label=name, linewidth=1.2)
        axis.set_xlabel("step")
        axis.set_ylabel("clipping threshold C")
        axis.set_yscale("log")
        axis.set_title(f"thresholds per group{about}", fontsize=9)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        import numpy as np

        every_step = max(1, math.ceil(len(steps) / 2000))  # at most ~2000 columns
        steps, rows = steps[::every_step], rows[::every_step]
        values = np.log10(np.maximum(np.asarray(rows, dtype=float).T, 1e-30))  # groups x steps
        figure, axis = plt.subplots(figsize=(8.5, min(2.0 + 0.14 * groups, 14)))
        edges = np.r_[steps[0] - 0.5, (np.asarray(steps[:-1]) + np.asarray(steps[1:])) / 2, steps[-1] + 0.5]
        mesh = axis.pcolormesh(edges, np.arange(groups + 1) - 0.5, values, shading="flat", cmap="viridis")
        figure.colorbar(mesh, ax=axis, label="log10 C")
        every = max(1, math.ceil(groups / 60))
        axis.set_yticks(range(0, groups, every))
        axis.set_yticklabels(names[::every], fontsize=6)
        axis.invert_yaxis()
        axis.set_xlabel("step")
        axis.set_title(f"thresholds of {groups} groups{about} (heat-map, log10 C)", fontsize=9)
    integer_steps(axis)
    _tight(figure)
    return figure


def plot_thresholds(metrics_path: Path, out_path: Path, group_names: list[str], *, policy: str | None = None,
                    max_lines: int = MAX_LINES) -> None:
    """thresholds.png of a run from its metrics.jsonl (nothing when it holds no step)."""
    steps, rows = threshold_rows(read_metrics(metrics_path))
    if not steps:
        return
    save_figure(thresholds_figure(steps, rows, group_names, policy=policy, max_lines=max_lines), out_path)


def plot_run(run_dir: Path, group_names: list[str], *, policy: str | None = None,
             epsilon_cap: float | None = None, delta: float | None = None) -> None:
    """Both plots of a run directory (the end of a run: :func:`dpclip.train.workflow.train`)."""
    run_dir = Path(run_dir)
    metrics = run_dir / layout.METRICS
    plot_training(metrics, run_dir / TRAINING_PLOT, epsilon_cap=epsilon_cap, delta=delta)
    plot_thresholds(metrics, run_dir / THRESHOLDS_PLOT, group_names, policy=policy)
