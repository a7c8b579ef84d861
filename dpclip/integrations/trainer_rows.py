"""``DPTrainer``'s rows: each ``training_step`` takes the part the Trainer fetched from the Poisson
loader, and the model's training forwards inside ``per_sample_loss`` take that part's rows, each
once, in order (make_private's loop is held to the same: :mod:`dpclip.integrations.rows`).

The noise is calibrated to one example moving one clipped row. A ``per_sample_loss`` that gives
the model rows built from several examples (token cutmix with the next example, mixup of two
images), or a ``training_step`` override that does so before ``super().training_step``, makes one
example move two rows or more; the certificate checks the model on the rows it was given, and the
loss check (:mod:`dpclip.integrations.loss_alone`) has the model answer each row's recorded output,
so neither sees it. Both are refused here, before the engine's backward.

Limits: the parts are those the Trainer fetches through ``get_batch_samples`` (transformers 4.46 on;
before, a ``training_step``'s inputs have nothing to be compared with); with
``PrivacyArguments(compile=True)`` the forwards inside ``per_sample_loss`` are checked on the pieces
the compiled step verifies eagerly (the first of each shape), not inside the graph.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from dpclip.errors import DpclipError
from dpclip.integrations.rows import DrawnRows, data_leaves, tensor_rows

HINT = ("give the model the rows the Trainer's data loader drew, as they came (moved to a device or dtype, or "
        "reshaped within a row, is fine): transform examples in the dataset, in a data_collator that treats each "
        "alone, or inside the model; per_sample_loss computes each example's loss from its own rows, and a "
        "training_step override passes the Trainer's inputs to super().training_step unchanged")


def part_rows(inputs: Mapping[str, Any]) -> int:
    """The rows of a part (its first tensor's; 0 for an empty part)."""
    return next((len(value) for value in inputs.values() if isinstance(value, Tensor) and value.dim()), 0)


def _layout(t: Tensor) -> tuple:
    return t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride()


def check_tree(drawn: DrawnRows, tree: Any, what: str) -> None:
    """The per-sample tensors of ``tree`` are the first rows of ``drawn``'s, in order; a tensor
    shared by them is no statistic of the draw (:meth:`DrawnRows.check_shared`)."""
    first = next((t for t in data_leaves(tree) if isinstance(t, Tensor) and t.dim()), None)
    if first is None:
        return
    n = first.shape[0]
    as_drawn = {_layout(leaf) for leaf in drawn.leaves}
    for t in tensor_rows(tree, n):
        if _layout(t) not in as_drawn:   # (the part's own tensor, one expanded over its rows included)
            drawn.check(t, 0, what, HINT)
    for t in data_leaves(tree):
        if isinstance(t, Tensor) and t.dim() and t.shape[0] != n:
            drawn.check_shared(t, 0, n, what)


def _is_part(part: Any, inputs: Mapping[str, Any]) -> bool:
    try:
        check_tree(DrawnRows(part, part_rows(part)), dict(inputs), "")
    except DpclipError:
        return False
    return True


class PartRows:
    """The parts the Trainer fetched (``get_batch_samples``) and not yet trained on, in order."""

    def __init__(self) -> None:
        self.fetched: deque[Any] = deque()
        self.last: Any = None   # the part taken last

    def fetch(self, parts: list[Any]) -> None:
        self.fetched.extend(parts)

    def take(self, inputs: Mapping[str, Any]) -> None:
        """``training_step``'s ``inputs`` are the next part fetched (nothing to compare them with where
        this Trainer fetches no parts through ``get_batch_samples``: transformers before 4.46)."""
        if not self.fetched:
            return
        part, last, self.last = self.fetched.popleft(), self.last, None
        try:
            check_tree(DrawnRows(part, part_rows(part)), dict(inputs), "an input of training_step")
        except DpclipError:
            if last is not None and _is_part(last, inputs):
                raise DpclipError("a training step over more parts than the draw has: this part went through "
                                  "training_step already, so each of its examples' clipped gradients would enter "
                                  "the step twice, more than the noise is calibrated for", "call "
                                  "super().training_step once per part, on the inputs the Trainer gave") from None
            raise
        self.last = part

    @staticmethod
    @contextmanager
    def forwards_over(model: nn.Module, inputs: Mapping[str, Any]) -> Iterator[None]:
        """Inside (``per_sample_loss`` running on ``inputs``), each outermost forward of ``model`` with
        gradients on takes ``inputs``' rows; refused, before the forward runs, otherwise."""
        drawn, depth = DrawnRows(dict(inputs), part_rows(inputs)), [0]

        def enter(module: nn.Module, args: Any, kwargs: Any) -> None:
            depth[0] += 1
            if depth[0] == 1 and torch.is_grad_enabled():   # (the engine's probes run nested in it)
                check_tree(drawn, (args, kwargs), "the model's input in per_sample_loss")

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            depth[0] -= 1
        handles = (model.register_forward_pre_hook(enter, with_kwargs=True, prepend=True),
                   model.register_forward_hook(leave, always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
