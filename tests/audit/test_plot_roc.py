import math

import numpy as np
import pytest

from dpclip.audit.metrics import attack_metrics, dp_tpr_bound
from dpclip.audit.plot import axis_floors, plot_roc, roc_figure, roc_staircase

# A loss attack's ROC with a long TPR = 0 stretch (the 30 non-members with the best scores
# come first) and then a tie: 20 members and 20 non-members share one score.
FPR = [0.0, 0.3, 0.5, 1.0]
TPR = [0.0, 0.0, 0.2, 1.0]


def true_roc(fpr, tpr, x):
    """The best TPR any threshold reaches at FPR ≤ x (the empirical ROC step function)."""
    reached = [t for f, t in zip(fpr, tpr) if f <= x * (1 + 1e-9)]
    return max(reached) if reached else 0.0


def points_above_roc(xs, ys, fpr, tpr, x_floor, y_floor, samples=50):
    """Points of the drawn polyline (straight in log-log space, as matplotlib draws on log
    axes) that lie above the true ROC; a point on a floor stands for 0."""
    bad = []
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        for s in np.linspace(0, 1, samples):
            x = math.exp((1 - s) * math.log(x0) + s * math.log(x1))
            y = math.exp((1 - s) * math.log(y0) + s * math.log(y1))
            real_x = 0.0 if x <= x_floor * (1 + 1e-9) else x
            real_y = 0.0 if y <= y_floor * (1 + 1e-9) else y
            if real_y > true_roc(fpr, tpr, real_x) + 1e-9:
                bad.append((x, y))
    return bad


def _report(fpr=FPR, tpr=TPR, n=100):
    return {"checkpoint": "step_000012", "ledger": {"epsilon": 2.0, "delta": 1e-5},
            "attacks": {"loss": {"roc": {"fpr": list(fpr), "tpr": list(tpr)}, "auc": 0.55,
                                 "members": n, "non_members": n}}}


def test_drawn_roc_never_lies_above_the_true_step_function():
    report = _report()
    x_floor, y_floor = axis_floors(report)
    figure = roc_figure(report)
    drawn = next(line for line in figure.axes[0].get_lines() if line.get_label().startswith("loss"))
    xs, ys = np.asarray(drawn.get_xdata(), float), np.asarray(drawn.get_ydata(), float)
    assert not points_above_roc(xs, ys, FPR, TPR, x_floor, y_floor)
    # every measured point is on the drawn curve (nothing is hidden by the steps either)
    for f, t in zip(FPR, TPR):
        assert any(math.isclose(x, max(f, x_floor)) and math.isclose(y, max(t, y_floor)) for x, y in zip(xs, ys))


def test_joining_the_points_by_lines_would_draw_a_false_diagonal():
    # The check above can fail: the straight-line drawing of the same points does.
    x_floor, y_floor = axis_floors(_report())
    xs, ys = np.maximum(FPR, x_floor), np.maximum(TPR, y_floor)
    assert points_above_roc(xs, ys, FPR, TPR, x_floor, y_floor)


def test_staircase_of_a_real_attack_stays_under_its_roc():
    rng = np.random.default_rng(0)
    labels = np.r_[np.ones(200), np.zeros(200)]
    scores = np.round(np.r_[rng.normal(0.3, 1, 200), rng.normal(0, 1, 200)], 1)  # ties, as losses have
    roc = attack_metrics(labels, scores, bootstrap=0)["roc"]
    x_floor, y_floor = 0.5 / 200, 0.5 / 200
    xs, ys = roc_staircase(roc["fpr"], roc["tpr"], x_floor, y_floor)
    assert not points_above_roc(xs, ys, roc["fpr"], roc["tpr"], x_floor, y_floor, samples=5)
    assert np.all(np.diff(xs) >= 0) and np.all(np.diff(ys) >= 0)
    assert all(a == c or b == d for (a, b), (c, d) in zip(zip(xs, ys), zip(xs[1:], ys[1:])))  # axis-aligned


def test_the_dp_bound_is_drawn_with_the_ledgers_epsilon_and_delta():
    figure = roc_figure(_report())
    bound = next(line for line in figure.axes[0].get_lines() if line.get_label().startswith("DP bound"))
    x = np.asarray(bound.get_xdata())
    _, y_floor = axis_floors(_report())
    assert np.asarray(bound.get_ydata()) == pytest.approx(np.maximum(dp_tpr_bound(x, 2.0, 1e-5), y_floor))
    assert "ε = 2" in bound.get_label() and "not covered by ε" in figure.axes[0].get_title()


def test_plot_roc_writes_a_png(tmp_path):
    plot_roc(_report(), tmp_path / "roc.png")
    assert (tmp_path / "roc.png").read_bytes()[:4] == b"\x89PNG"


def test_a_roc_save_cut_short_leaves_a_name_the_release_manifest_knows_as_a_leftover(tmp_path, monkeypatch):
    from pathlib import Path

    from matplotlib.figure import Figure

    from dpclip.release.files import is_leftover

    written, real = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, fname, *a, **k: (written.append(Path(fname)),
                                                                         real(self, fname, *a, **k)))
    plot_roc(_report(), tmp_path / "roc.png")
    (temporary,) = written
    assert temporary.name != "roc.png" and is_leftover(temporary.relative_to(tmp_path))
