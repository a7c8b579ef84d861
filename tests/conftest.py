"""Fixtures shared by every test folder."""

import pytest

from dpclip.cli.main import main


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
