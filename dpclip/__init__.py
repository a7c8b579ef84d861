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


def __getattr__(name: str) -> Any:
    """``dpclip.make_private`` (and ``make_private_with_epsilon``, ``fix``): dpclip in your own PyTorch
    loop, as Opacus users write it (:func:`dpclip.integrations.private.make_private`,
    docs/python-api.md). Imported on first use (PEP 562), so that ``import dpclip`` imports no
    torch, and each is the function itself: ``help()`` and ``inspect.signature`` show its arguments."""
    if name in _LAZY:
        module = __import__(_LAZY[name], fromlist=[name])
        globals()[name] = getattr(module, name)
        return globals()[name]
    raise AttributeError(f"module 'dpclip' has no attribute {name!r}")


#: names imported on first use: the Python API (docs/python-api.md)
_LAZY = {"make_private": "dpclip.integrations.private", "make_private_with_epsilon": "dpclip.integrations.private",
         "fix": "dpclip.models.fix"}


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
