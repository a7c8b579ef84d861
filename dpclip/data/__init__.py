"""Data: builtin sets, local files, Hugging Face datasets, the split and the sampler.

The training workflow needs only::

    from dpclip.data import load_data, PoissonSampler, ShuffleSampler, micro_batches, select
    data = load_data(recipe.data, seed=recipe.seed)          # PrivateData
    for indices in PoissonSampler(data.num_train, q, steps):   # batches from OS entropy
        for chunk in micro_batches(indices, micro_batch_size):
            batch = select(data.train, chunk)

The names below are imported on first use (PEP 562), so that `dpclip account RECIPE`,
which needs only :mod:`dpclip.data.size`, does not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CanarySet": "dpclip.data.canaries",
    "make_canaries": "dpclip.data.canaries",
    "read_canary_secret": "dpclip.data.canaries",
    "with_canaries": "dpclip.data.canaries",
    "IGNORE_INDEX": "dpclip.data.columns",
    "TASKS": "dpclip.data.dataset",
    "PrivateData": "dpclip.data.dataset",
    "load_data": "dpclip.data.dataset",
    "select": "dpclip.data.dataset",
    "PoissonSampler": "dpclip.data.sampler",
    "ShuffleSampler": "dpclip.data.sampler",
    "micro_batches": "dpclip.data.sampler",
    "training_set_size": "dpclip.data.size",
    "split_fingerprint": "dpclip.data.split",
    "split_indices": "dpclip.data.split",
    "ByteTokenizer": "dpclip.data.tokenizers",
    "HFTokenizer": "dpclip.data.tokenizers",
    "load_tokenizer": "dpclip.data.tokenizers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dpclip.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
