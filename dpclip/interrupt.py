"""Ctrl-C and SIGTERM honoured at step boundaries only (docs/training.md, "Checkpoints and resuming")."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator


class DeferredInterrupt:
    """Turn Ctrl-C (SIGINT) and SIGTERM (``kill``, a batch scheduler's pre-emption) into a
    flag the loop reads between steps, so a step is never half done (a gradient applied but
    not yet in the ledger); the run then checkpoints at that step boundary. A second signal
    interrupts at once, unless it comes within :attr:`GRACE_S` of the first (a double press of
    Ctrl-C, a launcher that signals twice): that one is the same request, and the run still
    checkpoints. Signal handlers can only be set from the main thread: elsewhere (a training
    thread of the caller's) the signals keep their behaviour."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    #: seconds after the first signal in which another is taken as the same request
    GRACE_S = 2.0

    def __init__(self):
        self.requested = False
        self.signal: int | None = None
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self._first < self.GRACE_S:
                return
            raise KeyboardInterrupt
        self.requested = True
        self.signal = signum
        self._first = time.monotonic()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous = {}
        return False



@contextmanager
def shielded() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back while a checkpoint is written, so that no signal leaves half a
    checkpoint (a staging folder, LATEST still at an older step); a signal that came meanwhile is
    delivered once the write is done, to whatever handler was in place (the loop's
    :class:`DeferredInterrupt`, or the default: KeyboardInterrupt). Outside the main thread signal
    handlers cannot be set, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in DeferredInterrupt.SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in caught:
            signal.raise_signal(signum)
