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
from dpclip.integrations.rows import data_leaves


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
            if n > 1 and self._half_kept(batch, rows, slice(0, half), [rows[0], *rows[half:]], before) \
                    and self._half_kept(batch, rows, slice(half, n), [rows[-1], *rows[:half]], before):
                return batch
        finally:
            _set_random_states(after)
        raise DpclipError("the collate_fn's rows depend on the other examples of the draw (collated again with "
                          "half its examples replaced, a row changed): one example would move several clipped rows, "
                          "more than the noise is calibrated for; nothing was released", COLLATE_HINT)

    def _half_kept(self, batch: Any, rows: list, kept: slice, fills: list, before: tuple) -> bool:
        """Whether the rows ``kept`` come out the same with every other row a copy of ``fills[0]``.
        Where that moves the padding (the longest example replaced), a random draw over the padded
        batch (masked-LM masking) moves with it: the check is then made with the first of
        ``fills`` (the replaced rows) that keeps the batch's shapes."""
        def collated(fill):
            return self._collated([row if kept.start <= i < kept.stop else fill for i, row in enumerate(rows)], before)

        other = collated(fills[0])
        if self._kept(batch, other, kept, len(rows)):
            return True
        if _same_shapes(batch, other, len(rows)):   # the padding did not move: a row did
            return False
        for fill in fills[1:]:
            other = collated(fill)
            if _same_shapes(batch, other, len(rows)):
                return self._kept(batch, other, kept, len(rows))
        return False

    def _collated(self, rows: list, states: tuple) -> Any:
        _set_random_states(states)
        return self.collate(rows)

    @staticmethod
    def _kept(batch: Any, other: Any, kept: slice, rows: int) -> bool:
        """Whether ``other``'s rows ``kept`` are ``batch``'s, in every tensor with ``rows`` rows."""
        ours, theirs = data_leaves(batch), data_leaves(other)
        if len(ours) != len(theirs):
            return False
        pairs = [(a, b) for a, b in zip(ours, theirs) if isinstance(a, Tensor) and a.dim() and a.shape[0] == rows]
        return all(isinstance(b, Tensor) and b.dim() == a.dim() and b.shape[0] >= kept.stop
                   and _same_rows(a[kept], b[kept]) for a, b in pairs)


def _same_shapes(batch: Any, other: Any, rows: int) -> bool:
    """Whether the tensors of ``batch`` with ``rows`` rows have the same shapes in ``other``."""
    ours, theirs = data_leaves(batch), data_leaves(other)
    return len(ours) == len(theirs) and all(
        isinstance(b, Tensor) and a.shape == b.shape for a, b in zip(ours, theirs)
        if isinstance(a, Tensor) and a.dim() and a.shape[0] == rows)


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
