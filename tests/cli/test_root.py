import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpclip import __version__
from dpclip.errors import DpclipError

REPO = Path(__file__).resolve().parents[2]


def test_version(cli):
    result = cli("--version")
    assert result.code == 0 and result.out.strip() == f"dpclip {__version__}"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command(cli, flag):
    result = cli(flag)
    assert result.code == 0
    for command in ("account", "validate", "recipes"):
        assert command in result.out


def test_no_arguments_prints_help(cli):
    result = cli()
    assert result.code == 0 and "Usage" in result.out


def test_unknown_command_is_an_error_with_a_hint(cli):
    result = cli("bogus")
    assert result.code == 2
    assert result.err.startswith("error: No such command 'bogus'") and "hint: see `dpclip --help`" in result.err


def test_missing_argument_is_an_error_with_a_hint(cli):
    result = cli("validate")
    assert result.code == 2 and "error: Missing argument" in result.err and "hint:" in result.err


def test_an_unexpected_exception_gives_one_error_line_and_debug_gives_the_traceback(cli, monkeypatch, capsys):
    import dpclip.recipe as recipe_module  # `dpclip validate` imports load_recipe from here when it runs

    def boom(*args, **kwargs):
        secret_local = "do-not-print-me"  # noqa: F841  (locals must never be printed)
        raise RuntimeError("kaboom")

    monkeypatch.setattr(recipe_module, "load_recipe", boom)
    result = cli("validate", REPO / "recipes" / "quickstart.yaml")
    assert result.code == 1
    assert "error: unexpected RuntimeError: kaboom" in result.err and "--debug" in result.err
    assert "Traceback" not in result.err and "do-not-print-me" not in result.err
    debug = cli("--debug", "validate", REPO / "recipes" / "quickstart.yaml")
    assert debug.code == 1 and "Traceback" in debug.err and "do-not-print-me" not in debug.err


NATIVE_ERROR = ("empty(): argument 'size' failed to unpack the object at pos 1 with error \"Overflow when unpacking "
                "long long\nException raised from THPUtils_unpackLong at python_numbers.h:79 (most recent call first):\n"
                "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7fc6 in libc10.so)\n"
                "frame #1: <unknown function> + 0x49071e (0x7fc6 in libtorch_python.so)\n\"")


@pytest.mark.parametrize("raised", [TypeError(NATIVE_ERROR), DpclipError(f"building failed ({NATIVE_ERROR})", "hint")],
                         ids=["unexpected", "quoted in a user error"])
def test_a_torch_errors_native_backtrace_never_reaches_the_error_line(cli, monkeypatch, raised):
    # torch's C++ errors carry their backtrace in the message: "unexpected TypeError: ... frame #43 ..."
    import dpclip.recipe as recipe_module

    def boom(*args, **kwargs):
        raise raised

    monkeypatch.setattr(recipe_module, "load_recipe", boom)
    result = cli("validate", REPO / "recipes" / "quickstart.yaml")
    assert result.code in (1, 2) and "error: " in result.err and "Overflow when unpacking" in result.err
    assert "frame #" not in result.err and "Exception raised from" not in result.err and "c10::" not in result.err


@pytest.mark.parametrize("command", [("validate", "recipe"), ("account", "--sigma", "1", "--delta", "1e-5", "-q",
                                                                 "0.01", "--steps", "10")])
def test_ctrl_c_outside_the_training_loop_exits_130_and_says_interrupted(cli, monkeypatch, command):
    import dpclip.recipe as recipe_module  # `dpclip validate` imports load_recipe from here when it runs
    import dpclip.planning.plan as planning    # `dpclip account` solves its plan through this module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe_module, "load_recipe", interrupted)
    monkeypatch.setattr(planning, "solve_plan", interrupted)
    args = [REPO / "recipes" / "quickstart.yaml" if a == "recipe" else a for a in command]
    result = cli(*args)
    # a script's `dpclip ... && next-step` must not go on after a Ctrl-C
    assert result.code == 130 and "error: interrupted" in result.err
    assert "hint: nothing was left half written" in result.err and "--resume" in result.err


def test_user_error_with_debug_shows_the_traceback_too(cli, tmp_path):
    result = cli("--debug", "validate", tmp_path / "missing.yaml")
    assert result.code == 2 and "Traceback" in result.err and "error: recipe file not found" in result.err


def test_console_script_runs_as_a_user_would_without_a_traceback(tmp_path):
    env = dict(os.environ, COLUMNS="200")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    script = Path(sys.executable).parent / "dpclip"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dpclip"]
    done = subprocess.run([*command, "validate", str(bad)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "\nhint: " in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_the_command_starts_without_importing_torch():
    # `dpclip --help`, `validate` and typos must answer fast: commands import torch inside
    # themselves (dpclip/cli/__init__.py says why).
    code = "import sys, dpclip.cli.main; print(sorted(m for m in ('torch', 'transformers', 'sklearn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_debug_reaches_the_ranks_nproc_starts_and_is_not_left_set(cli, monkeypatch):
    """`--nproc` ranks run `dpclip train` without `--debug` on their command line: the flag goes to
    them through DPCLIP_DEBUG (else "rerun with --debug" gave no rank's traceback)."""
    import dpclip.train.launch as train_launch

    seen = []
    monkeypatch.delenv("DPCLIP_DEBUG", raising=False)
    monkeypatch.setattr(train_launch, "launch", lambda args, nproc, master_port=None, debug=False: seen.append(
        (debug, os.environ.get("DPCLIP_DEBUG"))))
    result = cli("--debug", "train", REPO / "recipes" / "quickstart.yaml", "--nproc", "2", "--dry-run")
    assert result.code == 0, result.err
    assert seen == [(True, "1")]
    assert "DPCLIP_DEBUG" not in os.environ


def test_a_ctrl_c_while_the_cli_is_still_importing_exits_130_with_error_and_hint(monkeypatch, capsys):
    """A Ctrl-C in the first second or two (dp_accounting, scipy and rich importing) printed a
    traceback through the import machinery; it ends now as one after the imports does."""
    import types

    from dpclip.cli import entry

    class Importing(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt   # where the import was when the user pressed Ctrl-C

    monkeypatch.setitem(sys.modules, "dpclip.cli.main", Importing("dpclip.cli.main"))
    with pytest.raises(SystemExit) as stopped:
        entry.run()
    err = capsys.readouterr().err
    assert stopped.value.code == 130
    assert err.startswith("error: interrupted\nhint: ") and "Traceback" not in err


def test_the_installed_command_and_python_m_dpclip_start_at_the_entry_that_catches_an_early_ctrl_c():
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'dpclip = "dpclip.cli.entry:run"' in pyproject
    result = subprocess.run([sys.executable, "-m", "dpclip", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and __version__ in result.stdout
