"""What the ``dpclip`` command sets in its process before training, for Python API users.

``dpclip train`` (and every other command) keeps freed memory in the process
(:func:`dpclip.allocator.keep_freed_memory`) and runs torch on the number of threads
``--threads`` says: ``auto`` (the default) takes the cores the machine's load leaves free
(:func:`auto_threads`), a number sets exactly that many. A script that trains through the
Python API gets the same with one call::

    import dpclip
    dpclip.configure_speed()           # "auto" threads, as `dpclip train`; or configure_speed(1)

(``dpclip.configure_speed`` is :func:`configure` with ``dpclip train``'s default;
``configure()`` alone keeps torch's thread count.)

Both settings are process-wide, which is why the library never applies them behind a
user's back. Why ``auto`` is the default (two threads on two busy cores took several times
longer than one) is measured in docs/training.md, "Threads".
"""

from __future__ import annotations

import os
from typing import Any

from dpclip.allocator import keep_freed_memory
from dpclip.errors import DpclipError


def auto_threads(cores: int | None = None, load: float | None = None, ceiling: int | None = None) -> int:
    """The cores the 1-minute load average leaves free, rounded, at least 1, at most ``ceiling``.

    ``cores``, ``load`` and ``ceiling`` default to ``os.cpu_count()``, ``os.getloadavg()[0]``
    and torch's own thread count (one per physical core). On an idle machine this is
    torch's default; beside one busy job on 2 cores it is 1, where 2 threads would each
    wait on a core the other job holds (docs/training.md, "Threads").
    """
    if cores is None:
        cores = os.cpu_count() or 1
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if ceiling is None:
        import torch  # lazy: `dpclip --help` must not import torch

        ceiling = torch.get_num_threads()
    return max(1, min(ceiling, int(cores - load + 0.5)))


def configure(threads: int | str | None = None) -> dict[str, Any]:
    """Apply the command's process settings; returns ``{"threads": n, "keep_freed_memory": bool}``.

    ``threads``: torch's intra-op thread count (``torch.set_num_threads``): a whole number,
    ``"auto"`` (:func:`auto_threads`), or None to keep the current one. Resuming a run
    replays its last steps, which must release exactly what they released before: resume
    with the thread count the run started with (``dpclip train --resume`` does, from the
    run's ``meta.json``).
    """
    import torch  # lazy: `dpclip --help` must not import torch

    if threads == "auto":
        threads = auto_threads()
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise DpclipError(f"the number of threads must be a whole number >= 1 or 'auto', got {threads!r}",
                              "e.g. --threads 1 on a machine shared with other jobs, or --threads auto")
        torch.set_num_threads(threads)
    return {"threads": torch.get_num_threads(), "keep_freed_memory": keep_freed_memory()}
