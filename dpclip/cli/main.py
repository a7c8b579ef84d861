"""The `dpclip` command: wires the sub-commands and turns DpclipErrors into error/hint lines."""

from __future__ import annotations

import errno
import logging
import os
import sys
import traceback

import typer

from dpclip import __version__
from dpclip.allocator import keep_freed_memory
from dpclip.cli import account, recipes, report, train, tune_cost, validate
from dpclip.cli import audit
from dpclip.cli import bench
from dpclip.cli import diagnose
from dpclip.cli import export
from dpclip.cli.render import print_error, show_library_warnings
from dpclip.errors import DpclipError, first_line

app = typer.Typer(
    name="dpclip",
    help="Differentially private deep learning with modern clipping methods, driven by YAML recipes.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)

_debug = {"on": bool(os.environ.get("DPCLIP_DEBUG"))}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dpclip {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show a traceback for errors."),
) -> None:
    """Differentially private deep learning with modern clipping methods, driven by YAML recipes."""
    _debug["on"] = _debug["on"] or debug


app.command("train")(train.train)
app.command("account")(account.account)
app.command("validate")(validate.validate)
app.command("audit-mia")(audit.audit_mia)
app.command("tune-cost")(tune_cost.tune_cost)
app.command("bench")(bench.bench)
app.command("export")(export.export)
app.command("report")(report.report)
app.command("diagnose")(diagnose.diagnose)
app.add_typer(recipes.app, name="recipes")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (tests call this in-process)."""
    args = list(sys.argv[1:] if argv is None else argv)
    passed_on = "--debug" in args and not os.environ.get("DPCLIP_DEBUG")
    if passed_on:   # the ranks `train --nproc` starts inherit it (their command line has no --debug)
        os.environ["DPCLIP_DEBUG"] = "1"
    try:
        return _main(args)
    finally:
        if passed_on:
            del os.environ["DPCLIP_DEBUG"]


def _main(args: list[str]) -> int:
    keep_freed_memory()  # the command owns its process: reuse freed memory across steps
    _debug["on"] = bool(os.environ.get("DPCLIP_DEBUG")) or "--debug" in args
    if not _debug["on"]:
        # dp_accounting logs through absl when its RDP series skips an order (harmless: the
        # remaining orders still bound ε); users see such details only with --debug.
        logging.getLogger("absl").setLevel(logging.ERROR)
    show_library_warnings()
    try:
        code = app(args=args, prog_name="dpclip", standalone_mode=False)
        # Outside standalone mode Typer returns an Exit's code instead of raising it, and it
        # turns Ctrl-C into Exit(130): without this, an interrupted command exited 0, silently.
        if code == 130:
            print_error("interrupted", INTERRUPTED_HINT)
            return 130
        return code if isinstance(code, int) and not isinstance(code, bool) else 0
    except DpclipError as exc:
        if _debug["on"]:
            traceback.print_exc()
        if not exc.quiet:
            print_error(exc.message, exc.hint)
        return exc.exit_code
    except KeyboardInterrupt:
        print_error("interrupted", INTERRUPTED_HINT)
        return 130
    except Exception as exc:
        code = _click_exit_code(exc)
        if code is not None:
            return code
        unwritable = _file_system_error(exc)
        if unwritable is not None:
            if _debug["on"]:
                traceback.print_exc()
            print_error(*unwritable)
            return 2
        if _debug["on"]:
            traceback.print_exc()
            return 1
        # notes added on the way up (a private batch's error says so: dpclip/train/step.py)
        notes = "".join(f" [{note}]" for note in getattr(exc, "__notes__", ()))
        print_error(f"unexpected {type(exc).__name__}: {first_line(exc)}{notes}",
                    "rerun with --debug for a traceback, and please report it")
        return 1


INTERRUPTED_HINT = ("nothing was left half written: run the command again (a training run that had started "
                    "resumes with `dpclip train --resume RUN_DIR`)")


def _file_system_error(exc: Exception) -> tuple[str, str] | None:
    """(error, hint) for a folder the command may not write (read-only, permission, full disk, a path
    through a file or to a folder that is not there, a name too long, a NUL in a path)."""
    if isinstance(exc, ValueError) and "embedded null byte" in str(exc):   # os.fspath's refusal of a path with NUL
        return ("a path given holds a NUL character (\\0)", "check the paths given: no file or folder name can hold it")
    if not isinstance(exc, OSError) or exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC,
                                                          errno.EDQUOT, errno.ENOTDIR, errno.EISDIR, errno.ENOENT,
                                                          errno.ENAMETOOLONG):
        return None
    where = exc.filename or "a file"
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.ENAMETOOLONG):
        what = {errno.ENOTDIR: "a part of that path is a file, not a folder", errno.EISDIR: "it is a folder",
                errno.ENOENT: "no such file or folder",
                errno.ENAMETOOLONG: "a name in that path is longer than the file system allows"}[exc.errno]
        return (f"cannot use {where}: {what}", "check the paths given (output_dir=... for train, --out for export, "
                "report and tune-cost, the run directory); if they are right, rerun with --debug and please report it")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left to write {where}", ("free some space (old checkpoints: checkpoint.keep), then run it again; a "
                                                 "training run goes on with dpclip train --resume RUN_DIR (a new run "
                                                 "would spend ε on the same data again)")
    return (f"cannot write {where}: {exc.strerror or 'permission denied'}",
            "make the folder writable (chmod u+w), or write elsewhere: output_dir=... for train, --out for "
            "export; a run directory that cannot be written cannot be resumed or audited in place")


def _click_exit_code(exc: Exception) -> int | None:
    """Render click's own exceptions (help, usage errors, exit); None for anything else.

    Typer vendors click in recent versions, so match click's exception interface
    instead of importing its (private) classes.
    """
    name = type(exc).__name__
    if name == "NoArgsIsHelpError":  # the help text has already been printed
        return 0
    if name == "Exit":
        return int(getattr(exc, "exit_code", 0) or 0)
    if name == "Abort":
        print_error("interrupted")
        return 130
    if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "dpclip"
        print_error(exc.format_message(), f"see `{command} --help`")
        return int(exc.exit_code) or 2
    return None


def run() -> None:
    sys.exit(main())
