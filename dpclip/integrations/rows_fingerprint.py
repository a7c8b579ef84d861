"""What the ranks of make_private and DPTrainer compare of their datasets (docs/python-api.md,
"Several processes").

Across W ranks, rank r draws the examples at positions r, r + W, ... of ITS dataset. That is a
Poisson sample of the whole data only when every rank holds the same rows in the same order: a
rank whose dataset was shuffled on its own (``datasets``' ``.shuffle()`` without a seed, a
per-rank seed, files listed in another order on another node) owns some examples that another
rank owns too (each then in a batch with probability about 2q, twice in some) and none of
others, which the accountant's q does not cover. Equal lengths, which the ranks already
compare, do not show it.

:func:`rows_fingerprint` hashes the rows at fixed positions (every row up to :data:`ROWS` rows,
else :data:`ROWS` evenly spaced ones, the first and the last among them), as ``dataset[i]``
gives them: tensors by dtype, shape and bytes, arrays and images by their bytes, mappings and
sequences element by element, numbers and strings by value. The rows are read with torch's,
Python's and NumPy's global generators seeded alike on every rank (a random augmentation then
reads alike) and put back after. A reorder or another file changes the sampled rows but for a
vanishing chance; a change to rows between the sampled positions of a dataset over ROWS rows is
not seen.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Mapping
from typing import Any

import torch

#: rows read: every row of a dataset up to this size, else this many evenly spaced ones
ROWS = 1024


def sampled_positions(size: int, rows: int = ROWS) -> list[int]:
    """Every position of a dataset of ``size`` rows up to ``rows``, else ``rows`` evenly spaced
    ones from 0 to size - 1."""
    if size <= rows:
        return list(range(size))
    return sorted({round(k * (size - 1) / (rows - 1)) for k in range(rows)})


def _feed(digest, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"tensor:{flat.dtype}:{tuple(value.shape)}:".encode())
        if not flat.is_sparse:
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        return
    if isinstance(value, Mapping):
        digest.update(f"map:{len(value)}:".encode())
        for key in sorted(value, key=str):
            _feed(digest, key)
            _feed(digest, value[key])
        return
    if isinstance(value, (list, tuple)):
        digest.update(f"seq:{len(value)}:".encode())
        for item in value:
            _feed(digest, item)
        return
    if value is None or isinstance(value, (str, bytes, int, float, bool, complex)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
        return
    tobytes = getattr(value, "tobytes", None)   # NumPy arrays, PIL images
    shape = getattr(value, "shape", getattr(value, "size", None))
    digest.update(f"{type(value).__name__}:{getattr(value, 'dtype', '')}:{shape}:".encode())
    if callable(tobytes):
        digest.update(tobytes())


def rows_fingerprint(dataset: Any, rows: int = ROWS) -> str:
    """A hex digest of the dataset's length and its rows at :func:`sampled_positions` (module doc)."""
    digest = hashlib.sha256(f"rows:{len(dataset)}:".encode())
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            random.seed(0)
            if numpy is not None:
                numpy.random.seed(0)
            for position in sampled_positions(len(dataset), rows):
                digest.update(f"row:{position}:".encode())
                _feed(digest, dataset[position])
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
    return digest.hexdigest()
