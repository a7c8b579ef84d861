"""Keep freed memory in the process between training steps (glibc malloc on Linux).

Why: by default glibc serves blocks above a moving threshold (128 KiB up to 32 MiB) with
fresh ``mmap`` pages and returns the top of its heap to the OS as soon as 2x that
threshold is free. A training step frees and re-allocates the same large tensors every
step, so every step page-faults them in again, a private step (with the engine's
short-lived per-sample tensors) up to three times as many as a non-private one
(``python benchmarks/dp_cost.py --allocator glibc-default`` counts them: on the GPT-2 of
docs/performance.md, 12,256 per non-private step and 39,330 per all-layer step).
PyTorch's CPU performance guide recommends swapping in jemalloc or tcmalloc for the same
reason; this does the smallest equivalent with glibc's own ``mallopt``:

    M_MMAP_MAX = 0            every block comes from the heap, where it is reused
    M_TRIM_THRESHOLD = 2 GiB  free memory returns to the OS only above 2 GiB

Known limit: in a small probe process (tests/test_allocator.py's, a 64 MiB tensor freed
and re-allocated) the reuse held in only about half of the runs; the other half still
faulted every page, for a reason not yet found. The GPT-2 benchmark runs all showed
0–2 faults per step with the setting. Resident memory then stays at its peak until the process exits instead of shrinking
between steps (docs/performance.md measures step memory with this setting).
It is process-wide, so only entry points that own the process call it (the ``dpclip``
command, the benchmarks); the library never does it behind a user's back. Set
``DPCLIP_MALLOC=default`` to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 2**31 - 1   # mallopt takes an int

_state: dict[str, bool] = {}


def keep_freed_memory() -> bool:
    """Apply the setting above once per process; True if glibc accepted it."""
    if "applied" in _state:
        return _state["applied"]
    applied = False
    if (os.environ.get("DPCLIP_MALLOC", "").lower() != "default"
            and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"):
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            applied = (mallopt(M_MMAP_MAX, 0) == 1
                       and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
        except (OSError, AttributeError):
            applied = False
    _state["applied"] = applied
    return applied
