"""What the ``dpclip`` command sets in its process before training, for Python API users.

``dpclip train`` (and every other command) keeps freed memory in the process
(:func:`dpclip.allocator.keep_freed_memory`) and, with ``--threads N``, runs torch on N
threads. A script that trains through the Python API gets the same with one call::

    import dpclip.threads
    dpclip.threads.configure(1)      # or configure() to keep torch's thread count

Both settings are process-wide, which is why the library never applies them behind a
user's back. The measurements behind the default (torch's own, one thread per core;
``--threads 1`` when several trainings share a machine) are in docs/training.md, "Threads".
"""

from __future__ import annotations

from typing import Any

from dpclip.allocator import keep_freed_memory
from dpclip.errors import DpclipError


def configure(threads: int | None = None) -> dict[str, Any]:
    """Apply the command's process settings; returns ``{"threads": n, "keep_freed_memory": bool}``.

    ``threads``: torch's intra-op thread count (``torch.set_num_threads``); None keeps
    the current one. Resuming a run replays its last steps, which must release exactly
    what they released before: resume with the thread count the run started with.
    """
    import torch  # lazy: `dpclip --help` must not import torch

    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise DpclipError(f"the number of threads must be a whole number >= 1, got {threads!r}",
                              "e.g. --threads 1 on a machine shared with other jobs")
        torch.set_num_threads(threads)
    return {"threads": torch.get_num_threads(), "keep_freed_memory": keep_freed_memory()}
