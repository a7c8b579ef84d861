"""dpclip: differentially private deep learning with modern clipping methods."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def configure_speed(threads: int | str | None = "auto") -> dict[str, Any]:
    """Set up this process for speed as the ``dpclip`` command does; returns what it set.

    Call it once at the start of your own training loop (docs/performance.md, "Your own
    loop"). It applies the two process-wide settings ``dpclip train`` applies before it
    trains: freed memory kept in the process between steps (glibc, Linux;
    :func:`dpclip.allocator.keep_freed_memory`) and torch's thread count, ``"auto"`` by
    default (the cores the machine's load leaves free, as ``dpclip train``'s default
    ``--threads auto``), a whole number, or None to keep torch's. Returns
    ``{"threads": n, "keep_freed_memory": bool}`` (False where glibc is not there or
    ``DPCLIP_MALLOC=default``). The library never applies either behind your back.
    """
    from dpclip.threads import configure  # lazy: `import dpclip` must not import torch

    return configure(threads)


def make_private(*args: Any, **kwargs: Any) -> Any:
    """dpclip in your own PyTorch loop, as Opacus users write it: see
    :func:`dpclip.integrations.private.make_private` and docs/python-api.md."""
    from dpclip.integrations.private import make_private as make  # lazy: `import dpclip` must not import torch

    return make(*args, **kwargs)
