"""The collate function of ``make_private``'s and ``DPTrainer``'s Poisson loader: an empty draw
as zero-row tensors, one row per example drawn (no packing), and a ``collate_fn`` of your own
checked to treat each example alone and not to use the draw's count (docs/python-api.md, "What
the loop must do")."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.data import Dataset, default_collate

from dpclip.engine.certificate.replay import equal_values
from dpclip.errors import DpclipError
from dpclip.integrations.rows import batch_rows, data_leaves
from dpclip.torch_compat import zero_draws_cpu_state


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


ONE_ROW_HINT = ("collate one row per example, padded to the longest (DataCollatorWithPadding, "
                "DataCollatorForLanguageModeling), a tensor shared by every example after the per-example ones; "
                "to train on blocks of text, make the blocks the dataset's rows: "
                "ε then protects a block, not a document, unless each document is cut alone and named as the user "
                "(users=, users_column=: docs/users.md, \"A document cut into blocks\")")

COLLATE_HINT = ("collate each example alone (stack, pad to the longest, tokenize); transform examples in the "
                "dataset's __getitem__ or inside the model, one sample at a time; to mix examples, mix only "
                "public data")


class EmptyDrawCollate:
    """The loader's collate function, and an empty Poisson draw as zero-row tensors (the step
    still happens: it releases noise and is charged).

    A collate function of your own sees the whole draw, so it could mix examples (mixup,
    normalising by the batch) or use their count (``x / len(rows)``: the count is Poisson, private)
    before the loop's rows are checked against the draw; it could also pack several examples into
    one row, or cut one into several. Each batch must therefore have one row per example (any
    collate, the default too), and is collated again:

    - from the same random state (the same count drawn), keeping some rows and replacing every
      other by copies of the first kept one, m times: row i gets a distinct set of m // 2 of the m
      checks (m the fewest with C(m, m // 2) >= n), and is kept in those. Every ordered pair of
      rows (i, j) has a check keeping i and replacing j, so any row depending on another is seen,
      in one half or across (a mix with the next row, a pairwise swap, a batch minimum);
    - with a copy of its first example added (n + 1 rows), where the first n rows must come out the
      same: a division by the count or a mean over the batch moves. From the same random state
      first (exact where draws come row by row); a collate whose torch draws span the batch (randn
      over 16 numbers or more, several draws) is then collated both ways from a torch state that
      draws only zeros, whatever the count.

    Padding to the longest may change only the padding, a constant beyond the rows' common size;
    where a replacement moves it, a random draw over the padded batch (masked-LM masking) moves
    with it, and the check is made with a replacement that keeps the shapes. A one-row batch has
    only the count check. A row that moves is refused. Cost: m + 1 more collates per batch (m = 6
    for 20 rows, 8 for 64, 13 for 1,000), two more for a collate drawing from torch's random state
    whose count check moved, and up to n - 1 more, once per batch, to find a shape-keeping
    replacement where one moves the padding. The check draws no random numbers of its own.
    Where every draw is zero, torch.poisson and torch.binomial would never return: refused."""

    def __init__(self, dataset: Dataset, collate: Callable | None):
        self.dataset = dataset
        self.collate = collate or default_collate
        self.checked = collate is not None and collate is not default_collate

    def __call__(self, rows: list) -> Any:
        if not rows:
            return empty_batch_like(self.collate([self.dataset[0]]))
        before = _random_states() if self.checked else None
        batch = self.collate(rows)
        _refuse_other_row_counts(batch, len(rows))
        if not self.checked:
            return batch
        after = _random_states()
        rows, shape_keeping = list(rows), []
        try:
            if not all(self._kept_with_others_replaced(batch, rows, kept, before, shape_keeping)
                       for kept in _kept_sets(len(rows))):
                raise DpclipError("the collate_fn's rows depend on the other examples of the draw (collated again "
                                  "with some of its examples replaced, a kept row changed): one example would move "
                                  "several clipped rows, more than the noise is calibrated for; nothing was released",
                                  COLLATE_HINT)
            if not self._count_kept(batch, rows, before, after):
                raise DpclipError("the collate_fn's rows depend on the number of examples drawn (collated again with "
                                  "a copy of its first example added, a row changed): the count of a Poisson draw is "
                                  "private, and one example would move every row; nothing was released", COLLATE_HINT)
        finally:
            _set_random_states(after)
        return batch

    def _kept_with_others_replaced(self, batch: Any, rows: list, kept: list, before: tuple,
                                   shape_keeping: list) -> bool:
        """Whether the rows ``kept`` come out the same with every other row a copy of the first kept.
        Where that moves the padding (the longest example replaced), a random draw over the padded
        batch (masked-LM masking) moves with it: the check is then made with the first replaced
        row, largest first, that keeps the batch's shapes (``shape_keeping`` remembers it for the next checks)."""
        keep = set(kept)
        replaced = [i for i in range(len(rows)) if i not in keep]

        def collated(fill):
            return self._collated([row if i in keep else rows[fill] for i, row in enumerate(rows)], before)

        other = collated(kept[0])
        if self._kept(batch, other, kept, len(rows)):
            return True
        if _same_shapes(batch, other, len(rows)):   # the padding did not move: a row did
            return False
        by_size = sorted((i for i in replaced if i not in shape_keeping), key=lambda i: -_size(rows[i]))
        for fill in [i for i in shape_keeping if i not in keep] + by_size:   # the longest first, most likely
            other = collated(fill)
            if _same_shapes(batch, other, len(rows)):
                shape_keeping.append(fill)
                return self._kept(batch, other, kept, len(rows))
        return False

    def _count_kept(self, batch: Any, rows: list, before: tuple, after: tuple) -> bool:
        """Whether the rows come out the same with a copy of the first example added, from the same
        random state, or, for a collate that drew from torch's, from a state that draws only zeros."""
        more, kept, n = rows + [rows[0]], list(range(len(rows))), len(rows)
        if self._kept(batch, self._collated(more, before), kept, n):
            return True
        zeros = None if torch.equal(before[0], after[0]) else zero_draws_cpu_state(before[0])
        if zeros is None:
            return False
        states = (zeros, *before[1:])
        try:
            with _NoRejectionSampling():
                return self._kept(self._collated(rows, states), self._collated(more, states), kept, n)
        except _RejectionSampler:
            return False

    def _collated(self, rows: list, states: tuple) -> Any:
        _set_random_states(states)
        return self.collate(rows)

    @staticmethod
    def _kept(batch: Any, other: Any, kept: list, rows: int) -> bool:
        """Whether ``other``'s rows ``kept`` are ``batch``'s, in every tensor with ``rows`` rows."""
        ours, theirs = data_leaves(batch), data_leaves(other)
        if len(ours) != len(theirs):
            return False
        pairs = [(a, b) for a, b in zip(ours, theirs) if isinstance(a, Tensor) and a.dim() and a.shape[0] == rows]
        index = torch.tensor(kept)
        return all(isinstance(b, Tensor) and b.dim() == a.dim() and b.shape[0] > max(kept)
                   and _same_rows(a.index_select(0, index.to(a.device)), b.index_select(0, index.to(b.device)))
                   for a, b in pairs)


def _refuse_other_row_counts(batch: Any, examples: int) -> None:
    """The collated batch has one row per example drawn (its first tensor's rows, as the loader
    counts them). Packing several examples into one row (``DataCollatorWithFlattening``, a
    padding-free collator) or cutting one into several (concatenate-and-chunk) passed the checks
    below, which compare the rows of tensors with one row per example: a batch with none had
    nothing compared, and its one clipped row held a whole draw."""
    try:
        rows = batch_rows(batch)
    except DpclipError:
        return   # no tensor with rows: the loader refuses the batch itself
    if rows != examples:   # no counts in the message: a Poisson draw's size is private
        raise DpclipError("the collate_fn's batch does not have one row per example drawn (its first tensor, by "
                          "which the loader counts the rows): it packs several examples into one row "
                          "(DataCollatorWithFlattening, padding-free or packing collators) or cuts one example into "
                          "several rows; each row is clipped as one example, so one example would move a clipped row "
                          "holding others, or several rows, more than the noise is calibrated for (ε is "
                          "example-level); nothing was released", ONE_ROW_HINT)


def _size(example: Any) -> int:
    """How many numbers and characters an example holds: the longest is likely the one padded to."""
    if isinstance(example, Tensor):
        return example.numel()
    if isinstance(example, (str, bytes)):
        return len(example)
    if isinstance(example, Mapping):
        return sum(_size(value) for value in example.values())
    if isinstance(example, (list, tuple)):
        return sum(_size(value) for value in example)
    return 1


def _kept_sets(n: int) -> list[list[int]]:
    """The rows each check keeps: row i gets the i-th set of m // 2 out of m checks, m the fewest
    with C(m, m // 2) >= n. Two rows' sets differ and are of one size, so for every ordered pair
    (i, j) a check keeps i and replaces j (a Sperner family; bits of i and their complements would
    take 2 log2 n checks). Checks keeping no row or every row are left out."""
    m = 0
    while math.comb(m, m // 2) < n:
        m += 1
    codes = list(itertools.islice(itertools.combinations(range(m), m // 2), n))
    sets = [[i for i, code in enumerate(codes) if check in code] for check in range(m)]
    return [kept for kept in sets if 0 < len(kept) < n]


class _RejectionSampler(Exception):
    """A sampler that would draw forever where every draw is zero."""


class _NoRejectionSampling(TorchFunctionMode):
    """Stops torch's Poisson (rate 10 or more) and binomial samplers, whose rejection loops never
    end where every draw is zero: such a collate is refused rather than left hanging."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.poisson, torch.binomial):
            raise _RejectionSampler(func.__name__)
        return func(*args, **(kwargs or {}))


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
