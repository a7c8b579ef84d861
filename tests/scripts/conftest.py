"""Load a script of scripts/ as a module, for its tests (scripts are not a package)."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    """``scripts/<name>.py`` as a module registered under ``name`` (dataclasses look their
    module up in sys.modules); the caller removes it again."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_script():
    """``load_script(name)``: scripts/<name>.py as a module (see ``_load``)."""
    return _load
