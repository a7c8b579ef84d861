"""Which dpclip every rank runs (docs/distributed.md, "Faults").

Rank 0 plans the run, draws the noise and writes the ledger; every other rank samples and clips
its own examples with the code installed on its own node. A node with another dpclip (an older
release, a checkout edited on one machine) may sample, clip or count otherwise than the plan
rank 0 charges, and nothing in the released sums shows it. So the ranks compare
:func:`code_fingerprint` before anything is drawn: dpclip's version, a hash of its source files
(the version string alone does not move between commits) and torch's release (without the local
build suffix, "+cu121").
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

import dpclip
from dpclip.errors import DpclipError


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """``dpclip VERSION (source HASH), torch RELEASE`` of this process: HASH is SHA-256 of every
    ``.py`` file of the installed package, by path, in path order (12 hex digits shown)."""
    root = Path(dpclip.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root).as_posix()}:{path.stat().st_size}:".encode())
        digest.update(path.read_bytes())
    return f"dpclip {dpclip.__version__} (source {digest.hexdigest()[:12]}), torch {torch.__version__.split('+')[0]}"


CODE_HINT = ("install the same dpclip (and torch release) on every node, from the same wheel or checkout: rank 0's "
             "plan and noise cover the other ranks' sampling and clipping only when they run rank 0's code")


def check_same_code(world) -> None:
    """Refuse, on every rank, ranks whose :func:`code_fingerprint` differs from rank 0's (a collective)."""
    codes = world.all_gather(code_fingerprint())
    other = next((r for r, code in enumerate(codes) if code != codes[0]), None)
    if other is not None:
        raise DpclipError(f"the ranks run other code: rank {other} runs {codes[other]}, rank 0 {codes[0]}", CODE_HINT)
