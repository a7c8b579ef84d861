"""The collate function of ``make_private``'s and ``DPTrainer``'s Poisson loader: an empty draw
as zero-row tensors, and a ``collate_fn`` of your own checked to treat each example alone
(docs/python-api.md, "What the loop must do")."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy
import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate

from dpclip.engine.certificate.replay import equal_values
from dpclip.errors import DpclipError
from dpclip.torch_compat import tree_flatten


def empty_batch_like(batch: Any) -> Any:
    """``batch`` with zero rows: the shapes and dtypes of a real batch, for an empty draw."""
    if isinstance(batch, Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({key: empty_batch_like(value) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        items = [empty_batch_like(value) for value in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def _random_states() -> tuple:
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state()


def _set_random_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    numpy.random.set_state(states[2])


COLLATE_HINT = ("collate each example alone (stack, pad to the longest, tokenize); transform examples in the "
                "dataset's __getitem__ or inside the model, one sample at a time; to mix examples, mix only "
                "public data")


class EmptyDrawCollate:
    """The loader's collate function, and an empty Poisson draw as zero-row tensors (the step
    still happens: it releases noise and is charged).

    A collate function of your own sees the whole draw, so it could mix examples (mixup,
    normalising by the batch) before the loop's rows are checked against the draw. Each batch is
    therefore collated again, from the same random state, with its first example appended again:
    each row must come out the same (padding to the longest is unchanged by a repeat; a
    statistic of the batch or a permutation is not). Where a random draw over the whole batch
    differs with one row more, the batch is collated with its last example replaced by its
    first, then its first by its last (the same count drawn): the rows kept must come out the
    same in both. A row that moves is refused. It costs a second (or third) collate per batch."""

    def __init__(self, dataset: Dataset, collate: Callable | None):
        self.dataset = dataset
        self.collate = collate or default_collate
        self.checked = collate is not None and collate is not default_collate

    def __call__(self, rows: list) -> Any:
        if not rows:
            return empty_batch_like(self.collate([self.dataset[0]]))
        if not self.checked:
            return self.collate(rows)
        before = _random_states()
        batch = self.collate(rows)
        after = _random_states()
        rows, n = list(rows), len(rows)
        try:
            if self._kept(batch, self._collated(rows + [rows[0]], before), slice(0, n), n):
                return batch
            if n > 1 and self._kept(batch, self._collated(rows[:-1] + [rows[0]], before), slice(0, n - 1), n) \
                    and self._kept(batch, self._collated([rows[-1]] + rows[1:], before), slice(1, n), n):
                return batch
        finally:
            _set_random_states(after)
        raise DpclipError("the collate_fn's rows depend on the other examples of the draw (collated again with "
                          "one example repeated, a row changed): one example would move several clipped rows, "
                          "more than the noise is calibrated for; nothing was released", COLLATE_HINT)

    def _collated(self, rows: list, states: tuple) -> Any:
        _set_random_states(states)
        return self.collate(rows)

    @staticmethod
    def _kept(batch: Any, other: Any, kept: slice, rows: int) -> bool:
        """Whether ``other``'s rows ``kept`` are ``batch``'s, in every tensor with ``rows`` rows."""
        ours, theirs = tree_flatten(batch)[0], tree_flatten(other)[0]
        if len(ours) != len(theirs):
            return False
        pairs = [(a, b) for a, b in zip(ours, theirs) if isinstance(a, Tensor) and a.dim() and a.shape[0] == rows]
        return all(isinstance(b, Tensor) and b.dim() == a.dim() and b.shape[1:] == a.shape[1:]
                   and b.shape[0] >= kept.stop and equal_values(a[kept], b[kept]) for a, b in pairs)
