"""Shared rendering: one console for results, one for errors, JSON output."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from rich.console import Console
from rich.markup import escape

from dpclip.accounting import bound_text
from dpclip.errors import without_native_backtrace


console = Console(highlight=False)
error_console = Console(stderr=True, highlight=False)
#: Beside a printed N (examples or people): q = B/N releases it; treated as public (docs/accounting.md).
N_LABEL = "public, not covered by ε"


def print_error(message: str, hint: str | None = None) -> None:
    # escape: a message may quote text with brackets (a path, a library's "[file:line]")
    # a torch error's text quoted in a message carries its C++ backtrace: never on an error: line
    message = without_native_backtrace(message)
    error_console.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    if hint:
        error_console.print(f"[yellow]hint:[/] {escape(hint)}", markup=True, soft_wrap=True)


class WarningLines(logging.Handler):
    """dpclip's own log records of level WARNING and above as ``warning:`` lines on stderr
    (the library logs; the command renders)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        error_console.print(f"[bold yellow]warning:[/] {escape(record.getMessage())}", markup=True, soft_wrap=True)


def show_library_warnings() -> None:
    """Route the ``dpclip`` loggers' warnings to :class:`WarningLines` (once per process)."""
    logger = logging.getLogger("dpclip")
    if not any(isinstance(handler, WarningLines) for handler in logger.handlers):
        logger.addHandler(WarningLines())


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def print_json(payload: dict[str, Any]) -> None:
    """Plain JSON on stdout (no rich markup), so `| jq` and json.loads work."""
    print(json.dumps(json_safe(payload), indent=2))


def fmt_upper(value: float | None, digits: int = 4) -> str:
    """An upper bound (an ε spent, a TPR the ledger allows), rounded up: never printed below the computed one."""
    return bound_text(value, digits)


def fmt_lower(value: float | None, digits: int = 4) -> str:
    """A lower bound (an audit's ε ≥ ...), rounded down."""
    return bound_text(value, digits, upper=False)


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}g}"
