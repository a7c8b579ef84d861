"""One process trains a run directory at a time.

Two processes resuming one run would each write checkpoints, metrics and the recipe over the
other's (and, from the same checkpoint, draw the same batches and noise while the ledger charges
the steps once). The training process holds an exclusive ``flock`` on the run directory itself
(no lock file: nothing is added to the run's released files); the system drops it when the
process ends, however it ends.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from dpclip.errors import DpclipError


class RunLock:
    """The run directory's lock, taken by :meth:`take` and dropped by :meth:`release`."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def take(self, run_dir: Path) -> None:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DpclipError(f"{run_dir} is being trained by another process",
                              "wait for it to end (or stop it with Ctrl-C), then resume: two processes on one run "
                              "would overwrite each other's checkpoints") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)   # closing the descriptor drops the lock
            self.fd = None
