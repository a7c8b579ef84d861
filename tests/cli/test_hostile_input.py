"""Input a hostile review fed the command line ends in an `error:` and a `hint:`, never in
"unexpected" (the catch-all that asks for a bug report) or a traceback."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def _refused(result) -> bool:
    return result.code == 2 and "error: " in result.err and "hint: " in result.err and \
        "unexpected" not in result.err and "Traceback" not in result.err


def test_epochs_too_many_to_count_as_steps_are_refused_by_validate_and_account(cli):
    for command in ("validate", "account"):
        result = cli(command, QUICKSTART, "training.epochs=1e308")
        assert _refused(result), result.err
        assert "too many steps to count" in result.err.replace("\n", "")
    flags = cli("account", "--eps", "8", "--delta", "1e-5", "-q", "1e-300", "--epochs", "1e300")
    assert _refused(flags), flags.err
