"""User-facing errors.

Library code raises a :class:`DpclipError` subclass with a message and a hint; only the
CLI turns it into ``error: ...`` / ``hint: ...`` and a non-zero exit code.
"""

from __future__ import annotations


class DpclipError(Exception):
    """An expected user mistake or impossible request, with a hint on how to fix it."""

    exit_code = 2
    #: True when another process shows this error (a rank of a data-parallel run whose
    #: launcher or rank 0 prints it once): the CLI then exits with its code, silently.
    quiet = False

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        """The message and, on a line of its own, the hint: what a Python caller's traceback shows
        (the CLI prints the two as ``error:`` and ``hint:`` lines from the attributes)."""
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


#: what an error raised while a private batch is in the engine says of itself: the tensor shapes
#: and counts it shows follow the realised batch size (a Poisson draw), which no DpEvent accounts for
PRIVATE_BATCH_NOTE = " [raised on a private batch: its shapes and counts are not covered by ε]"


def raised_on_private_batch(exc: DpclipError) -> DpclipError:
    """``exc`` labelled with :data:`PRIVATE_BATCH_NOTE` (once; not where it says so already)."""
    if "not covered by ε" not in exc.message:
        exc.message += PRIVATE_BATCH_NOTE
        exc.args = (exc.message, *exc.args[1:])
    return exc


#: what an error that quotes the data's rows says of itself (a row's value, its number, a count of the rows
#: failing a check, a count of rows shared with the public data): the operator needs it to find the row, and
#: it is read from the data (private, unless it is the public data's), which no DpEvent accounts for
QUOTES_DATA_NOTE = " [quotes the data's rows: not covered by ε]"


def quoting_data(message: str) -> str:
    """``message`` labelled with :data:`QUOTES_DATA_NOTE`: it shows a row's value or number, or a count of rows."""
    return message.replace(QUOTES_DATA_NOTE, "") + QUOTES_DATA_NOTE


class RecipeError(DpclipError):
    """A recipe file or override that does not validate."""


class AccountingError(DpclipError):
    """An accounting request that cannot be met (impossible split, bad ε/δ, ...)."""


class EngineError(DpclipError):
    """A model or configuration the private engine cannot handle exactly."""


class AuditFlagged(DpclipError):
    """``audit-mia --fail-if-flagged``: the one-run audit's ε lower bound exceeds the ledger's ε
    (the report is printed and written first; the distinct code tells a CI gate this from an
    audit that could not run, code 2)."""

    exit_code = 3


class InterruptedRun(DpclipError):
    """Training stopped by Ctrl-C after saving a checkpoint."""

    exit_code = 130


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s text (its type's name when it has none): torch's C++ errors carry
    the native backtrace ("Exception raised from ... frame #0: ...") on the lines after it."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__


def without_native_backtrace(text: str) -> str:
    """``text`` cut before a C++ backtrace that torch put in an exception's message and a message
    quoted (the ``Exception raised from`` line and the ``frame #N:`` lines after it)."""
    kept = []
    for line in text.splitlines():
        if line.startswith("Exception raised from ") or line.lstrip().startswith("frame #"):
            break
        kept.append(line)
    return "\n".join(kept).rstrip() if kept else text.splitlines()[0] if text else text
