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


@pytest.fixture
def quickstart(tmp_path):
    """``quickstart(*overrides)``: the quickstart recipe with overrides, writing under tmp_path."""

    def make(*overrides):
        return load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path / 'runs'}", *overrides])

    return make


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (small models: threads only add overhead)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
