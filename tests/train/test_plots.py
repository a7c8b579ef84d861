import json
from pathlib import Path

import pytest

from dpclip.train.plots import (read_metrics, threshold_layout, threshold_rows, thresholds_figure, training_figure,
                                training_series)
from dpclip.train.workflow import train


def _records(steps=6, diagnostics=True, evals=(3, 6)):
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "epsilon": 0.5 * step if step % 2 == 0 else None, "lr": 0.1,
                  "thresholds": [1.0, 0.5 + 0.1 * step], "noise_std": [0.1, 0.1], "policy": None}
        if diagnostics:
            record["diagnostics"] = {"train_loss": 2.0 / step}
            record["not_covered_by_epsilon"] = ["diagnostics"]
        records.append(record)
        if diagnostics and step in evals:
            records.append({"step": step, "eval": {"loss": 1.0 / step, "accuracy": 0.1 * step},
                            "not_covered_by_epsilon": ["eval"]})
    return records


def _titles(figure):
    return [axis.get_title() for axis in figure.axes] + [figure._suptitle.get_text()]


def test_training_plot_draws_loss_accuracy_and_epsilon_and_labels_diagnostics_not_covered():
    figure = training_figure(_records(), epsilon_cap=4.0, delta=1e-5)
    titles = _titles(figure)
    assert len(figure.axes) == 3
    assert "NOT covered by ε" in titles[0] and "NOT covered by ε" in titles[1]
    assert "ledger" in titles[2] and "not covered" not in titles[2]
    loss_lines = {line.get_label(): list(line.get_ydata()) for line in figure.axes[0].get_lines()}
    assert loss_lines["training batch loss"] == pytest.approx([2.0 / s for s in range(1, 7)])
    assert loss_lines["held-out loss"] == pytest.approx([1.0 / 3, 1.0 / 6])
    accuracy = figure.axes[1].get_lines()[0]
    assert list(accuracy.get_xdata()) == [3, 6] and list(accuracy.get_ydata()) == pytest.approx([0.3, 0.6])
    epsilon = figure.axes[2].get_lines()[0]
    assert list(epsilon.get_xdata()) == [2, 4, 6]  # steps without a computed ε are left out, not drawn as 0


def test_training_plot_without_exact_diagnostics_has_epsilon_only_and_says_why():
    figure = training_figure(_records(diagnostics=False))
    assert len(figure.axes) == 1
    assert "exact_diagnostics is false" in " ".join(_titles(figure))
    assert set(training_series(_records(diagnostics=False))) == {"epsilon"}


def test_threshold_layout_is_constant_lines_or_heatmap():
    assert threshold_layout([[1.0, 0.5]] * 4) == "constant"
    assert threshold_layout([[1.0, 0.5], [1.1, 0.5]]) == "lines"
    assert threshold_layout([[1.0] * 13, [1.1] * 13]) == "heatmap"
    assert threshold_layout([[1.0] * 13, [1.1] * 13], max_lines=20) == "lines"


def test_adaptive_thresholds_are_named_lines_with_a_legend():
    steps, rows = threshold_rows(_records())
    figure = thresholds_figure(steps, rows, ["fc1", "fc2"], policy="quantile")
    axis = figure.axes[0]
    assert [t.get_text() for t in axis.get_legend().get_texts()] == ["fc1", "fc2"]
    assert list(axis.get_lines()[1].get_ydata()) == pytest.approx([0.5 + 0.1 * s for s in steps])


def test_many_groups_are_a_heatmap_with_every_group_named():
    names = [f"layers.{k}.weight" for k in range(20)]
    rows = [[1.0 + 0.01 * k * s for k in range(20)] for s in range(1, 5)]
    figure = thresholds_figure([1, 2, 3, 4], rows, names)
    axis = figure.axes[0]
    assert not axis.get_lines() and axis.collections, "a heat-map, not the first 12 lines"
    assert [t.get_text() for t in axis.get_yticklabels()] == names
    assert "20 groups" in axis.get_title()


def test_fixed_thresholds_are_one_line_per_value_with_the_groups_named():
    rows = [[1.0, 1.0, 0.25]] * 5
    figure = thresholds_figure([1, 2, 3, 4, 5], rows, ["fc1", "fc2", "head"], policy="fixed")
    axis = figure.axes[0]
    assert "fixed thresholds" in axis.get_title() and "constant" in axis.get_title()
    labels = sorted(t.get_text() for t in axis.get_legend().get_texts())
    assert labels == ["C = 0.25: 1 group: head", "C = 1: 2 groups: fc1, fc2"]
    assert sorted(line.get_ydata()[0] for line in axis.get_lines()) == [0.25, 1.0]


def test_read_metrics_stops_at_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "epsilon": 1.0}) + "\n" + '{"step": 2, "eps')
    assert read_metrics(path) == [{"step": 1, "epsilon": 1.0}]


@pytest.mark.slow
def test_a_run_writes_training_and_thresholds_plots(small_recipe):
    run = train(small_recipe("privacy.exact_diagnostics=false")).run_dir
    assert (run / "training.png").stat().st_size > 0 and (run / "thresholds.png").stat().st_size > 0


def test_a_plot_save_cut_short_leaves_a_name_the_release_manifest_knows_as_a_leftover(tmp_path, monkeypatch):
    """A crash mid-save leaves the temporary file savefig was writing: the manifest check passes it
    over as a leftover (dpclip.release.is_leftover), it does not report it as an unlisted output."""
    from matplotlib.figure import Figure

    from dpclip.release.files import is_leftover
    from dpclip.train.plots import save_figure

    written = []
    real = Figure.savefig

    def recorded(self, fname, *args, **kwargs):
        written.append(Path(fname))
        return real(self, fname, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", recorded)
    save_figure(training_figure(_records(), epsilon_cap=4.0, delta=1e-5), tmp_path / "training.png")
    (temporary,) = written
    assert temporary.parent == tmp_path and temporary.name != "training.png"
    assert is_leftover(temporary.relative_to(tmp_path))
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["training.png"]
