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
    therefore collated again, from the same random state (the same count drawn), with its second
    half replaced by copies of its first example, then its first half by copies of its last: the
    rows kept must come out the same in both (a mix across the halves, a statistic of the batch
    or a permutation does not; padding to the longest may change only the padding, a constant
    beyond the rows' common size). A repeated example alone is not enough: it leaves a mix with
    the next row and a batch minimum unchanged. A one-row batch is collated with its example
    repeated. A row that moves is refused. It costs two more collates per batch."""

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
            if n == 1 and self._kept(batch, self._collated(rows + [rows[0]], before), slice(0, n), n):
                return batch
            half = (n + 1) // 2
            if n > 1 and self._kept(batch, self._collated(rows[:half] + [rows[0]] * (n - half), before),
                                    slice(0, half), n) \
                    and self._kept(batch, self._collated([rows[-1]] * half + rows[half:], before), slice(half, n), n):
                return batch
        finally:
            _set_random_states(after)
        raise DpclipError("the collate_fn's rows depend on the other examples of the draw (collated again with "
                          "half its examples replaced, a row changed): one example would move several clipped rows, "
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
        return all(isinstance(b, Tensor) and b.dim() == a.dim() and b.shape[0] >= kept.stop
                   and _same_rows(a[kept], b[kept]) for a, b in pairs)


def _same_rows(ours: Tensor, theirs: Tensor) -> bool:
    """Whether two collations of the same examples agree: equal, or padded to another size (right
    or left) with the parts beyond their common size one constant each (the padding value)."""
    if ours.shape == theirs.shape:
        return equal_values(ours, theirs)
    if ours.dtype != theirs.dtype:
        return False
    common = [min(a, b) for a, b in zip(ours.shape[1:], theirs.shape[1:])]
    for at_end in (False, True):
        boxes = [(slice(None),) + tuple(slice(size - c, size) if at_end else slice(0, c)
                                        for size, c in zip(t.shape[1:], common)) for t in (ours, theirs)]
        if equal_values(ours[boxes[0]], theirs[boxes[1]]) and all(
                _constant_outside(t, box) for t, box in zip((ours, theirs), boxes)):
            return True
    return False


def _constant_outside(tensor: Tensor, box: tuple) -> bool:
    outside = torch.ones(tensor.shape, dtype=torch.bool, device=tensor.device)
    outside[box] = False
    rest = tensor[outside]
    return rest.numel() == 0 or bool((rest == rest[0]).all())
