"""Fixtures shared by every test folder."""

from pathlib import Path

import pytest
import torch

from dpclip.cli.main import main
from dpclip.recipe import load_recipe


class CliResult:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def cli(capsys):
    """Run `dpclip ARGS` in-process; returns exit code, stdout and stderr."""

    def run(*args):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


REPO = Path(__file__).resolve().parents[1]
# A fixed noise multiplier in place of the recipe's ε = 8, for end-to-end tests of interrupting
# and resuming: over a short run ε = 8 calibrates a σ below 1, whose per-step accounting (RDP at
# fractional orders) took about two thirds of such a test's time.
FIXED_SIGMA = ("privacy.epsilon=null", "privacy.noise_multiplier=1.0")


def pytest_collection_modifyitems(config, items):
    """The default run (the README's `python -m pytest -n 2`) leaves out the `slow` tests: the
    end-to-end runs, the model zoo's full cross product and the thorough property tests.
    `python -m pytest -m slow` runs them (.ci/run does, after the default run); any `-m`
    expression, or a slow test named by its node id, selects as written."""
    if config.option.markexpr:
        return
    named = [arg.split("[")[0] for arg in config.args if "::" in arg]
    kept, left_out = [], []
    for item in items:
        chosen = any(item.nodeid == arg or item.nodeid.startswith((arg + "[", arg + "::")) for arg in named)
        (left_out if item.get_closest_marker("slow") and not chosen else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture
def quickstart(tmp_path):
    """``quickstart(*overrides)``: the quickstart recipe with overrides, writing under tmp_path."""

    def make(*overrides):
        return load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path / 'runs'}", *overrides])

    return make


@pytest.fixture
def small_recipe(quickstart):
    """The quickstart recipe, shortened to a few seconds of training, writing under tmp_path."""

    def make(*overrides):
        return quickstart("training.epochs=null", "training.steps=12", "checkpoint.every_steps=4",
                          "eval.every_steps=6", *overrides)

    return make


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (small models: threads only add overhead)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def saved_checkpoint_steps(monkeypatch):
    """The step of every checkpoint training saves from now on, in order."""
    from dpclip.train import state as state_module

    saved, save = [], state_module.save_checkpoint

    def recorded(run_dir, step, model, state, keep):
        saved.append(step)
        return save(run_dir, step, model, state, keep)

    monkeypatch.setattr(state_module, "save_checkpoint", recorded)
    return saved


@pytest.fixture(scope="session")
def public_held_out(tmp_path_factory):
    """Overrides giving the quickstart recipe the digits as files with a separate held-out file,
    the public held-out set ``tuning.score: public`` needs (a held-out split cut from the private
    rows is private data): the 1,797 digits shuffled with a fixed seed, 1,437 to train.csv (the
    builtin's 80 %), 360 to test.csv, features scaled to [0, 1] as the builtin's are."""
    import numpy as np

    from dpclip.data.builtin import load_digits_arrays

    folder = tmp_path_factory.mktemp("public-held-out")
    features, labels = load_digits_arrays(as_images=False)
    order = np.random.default_rng(0).permutation(len(labels))
    header = ",".join([f"x{i}" for i in range(features.shape[1])] + ["label"])
    for name, rows in (("train", order[:1437]), ("test", order[1437:])):
        table = np.column_stack([features[rows], labels[rows]])
        np.savetxt(folder / f"{name}.csv", table, delimiter=",", header=header, comments="",
                   fmt=["%.6g"] * features.shape[1] + ["%d"])
    return (f"data={{source: files, format: csv, train: '{folder / 'train.csv'}', test: '{folder / 'test.csv'}', "
            "label_field: label, labels: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}",)
