"""The ``make_private`` loop's rules: one noisy step per drawn batch (:class:`DrawTracker`), over
that batch's own rows, each once, in order (:class:`DrawnRows`, :class:`ModelRowsWatch`).

The sensitivity that calibrates the noise holds when row i of the step is example i's alone: one
example then moves one clipped row. A loop that builds its rows from several examples (mixup,
in-loop normalisation by batch statistics, a repeated or reordered example, a loss weight
normalised over the batch, another slice of the same size) makes one example move many rows,
and the certificate cannot see it: it checks the model on the rows it was given. So what reaches
the model, the criterion's targets and a per-sample loss weight is checked against the rows the
loader drew (docs/python-api.md, "What the loop must do").
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from dpclip.engine.bookkept_ops import refuse_transform
from dpclip.engine.certificate.replay import equal_values
from dpclip.errors import DpclipError
from dpclip.torch_compat import tree_flatten

ROWS_HINT = ("pass the rows the loader drew as they came (moving them to a device or dtype, reshaping each row, "
             "or one slice of every row, x[:, 1:], is fine); transform examples in the dataset, in a collate_fn "
             "that treats each alone, inside the model or inside the criterion, one sample at a time")


def data_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, opening the mappings torch's pytree keeps whole: Hugging Face's
    ``BatchEncoding`` (what its data collators return), any ``UserDict`` or other ``Mapping``.
    Kept whole, their tensors went unseen by the row and collate checks."""
    leaves = []
    for leaf in tree_flatten(tree)[0]:
        leaves.extend(data_leaves(dict(leaf)) if isinstance(leaf, Mapping) else [leaf])
    return leaves


def tensor_rows(tree: Any, rows: int) -> list[Tensor]:
    """The tensors of ``tree`` with ``rows`` rows (dim 0), the per-sample ones of a call."""
    return [t for t in data_leaves(tree) if isinstance(t, Tensor) and t.dim() and t.shape[0] == rows]


def batch_rows(batch: Any) -> int:
    """The rows of a collated batch: dim 0 of its first tensor."""
    if isinstance(batch, Tensor) and batch.dim():
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        try:
            return batch_rows(value)
        except DpclipError:
            continue
    raise DpclipError("a batch of the data loader holds no tensor with rows", "return tensors from the dataset")


def _sorted_rows(t: Tensor) -> Tensor:
    flat = t.detach().reshape(t.shape[0], -1)
    return (flat.to(torch.uint8) if flat.dtype == torch.bool else flat).sort(1).values


def same_rows(drawn: Tensor, t: Tensor, any_row: bool = False) -> bool:
    """Whether each row of ``t`` holds the values of the same row of ``drawn`` (in any order
    within the row: a reshape or transpose of a sample is still that sample's); ``any_row``:
    whether some row does."""
    if drawn.shape[0] != t.shape[0] or drawn[:1].numel() != t[:1].numel() or t.is_complex() != drawn.is_complex():
        return False
    if drawn.is_floating_point() and not t.is_floating_point():   # rounded to whole numbers: not the same values
        return False
    if not any_row and drawn.shape == t.shape:   # as drawn, or moved or cast (the loop's usual): no sort needed
        if (drawn.device, drawn.dtype, drawn.data_ptr(), drawn.stride()) == (t.device, t.dtype, t.data_ptr(), t.stride()):
            return True
        if equal_values(drawn.to(device=t.device, dtype=t.dtype), t.detach()):
            return True
    if t.is_complex():
        a, b = drawn.to(device=t.device, dtype=t.dtype).reshape(t.shape[0], -1), t.detach().reshape(t.shape[0], -1)
    else:
        a, b = _sorted_rows(drawn.to(device=t.device, dtype=t.dtype)), _sorted_rows(t)
    if any_row:
        same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
        return bool(same.all(1).any())
    return equal_values(a, b)


#: the most places a window is looked for in each drawn tensor (``x[:, 1:]`` has 2, a 28 x 28 crop of 32 x 32 25)
WINDOW_PLACES = 1024


def same_window(drawn: Tensor, t: Tensor) -> bool:
    """Whether ``t`` is one window of ``drawn``'s rows, cut at the same place in every row: a causal
    LM's ``x[:, :-1]`` and ``x[:, 1:]``, a crop ``x[..., 2:30, 2:30]``. Row i of ``t`` then holds
    row i's values alone, as a reshape of it does (the place is taken as it is, as a number is)."""
    if drawn.dim() != t.dim() or drawn.shape[0] != t.shape[0] or drawn.shape == t.shape \
            or any(s > d for s, d in zip(t.shape, drawn.shape)) or t.is_complex() != drawn.is_complex() \
            or (drawn.is_floating_point() and not t.is_floating_point()):
        return False
    places = [range(d - s + 1) for s, d in zip(t.shape[1:], drawn.shape[1:])]
    if math.prod(len(p) for p in places) > WINDOW_PLACES:
        return False
    drawn, t = drawn.to(device=t.device, dtype=t.dtype), t.detach()
    return any(equal_values(drawn[(slice(None), *(slice(o, o + s) for o, s in zip(offsets, t.shape[1:])))], t)
               for offsets in itertools.product(*places))


def broadcast_rows(t: Tensor) -> bool:
    """One row for every sample (``positions.expand(B, T)``): shared, not a sample's own."""
    return t.stride(0) == 0


def _column_statistics(x: Tensor) -> Iterator[Tensor]:
    """Per-column statistics of the rows ``x`` ([n, d], float64) a loop might share with every sample."""
    yield from (x.mean(0), x.sum(0))
    if x.shape[0] > 1:
        yield from (x.std(0), x.var(0), x.std(0, correction=0), x.var(0, correction=0))
    if x.shape[1] > 1:   # a lone maximum is too often a round number a shared input holds anyway
        yield from (x.amax(0), x.amin(0))


def _close(statistic: Tensor, t: Tensor) -> bool:
    """``t`` equals ``statistic`` up to its own dtype's rounding (the loop computed it in t's dtype)."""
    rounding = 16 * torch.finfo(t.dtype).eps
    scale = statistic.abs().amax().clamp_min(torch.finfo(t.dtype).tiny)
    return bool(((statistic - t.detach().to(torch.float64)).abs() <= rounding * scale).all())


SHARED_HINT = ("a tensor shared by every sample must not be computed from the batch: compute it from public data "
               "or fixed numbers, or normalise each example alone (in the dataset, the collate_fn or the model)")


class DrawnRows:
    """The open draw's per-sample tensors (the collated batch's leaves with one row per example)."""

    def __init__(self, batch: Any, rows: int):
        self.leaves = tensor_rows(batch, rows)
        # those holding examples' own rows: a collated tensor expanded over the rows (position ids,
        # arange(T).expand(n, T)) is one row shared by all, which the collate check saw depend on no
        # example; compared with itself it was taken for an example's row, and refused
        self.own = [leaf for leaf in self.leaves if not broadcast_rows(leaf)]

    def check_shared(self, t: Tensor, start: int, n: int, what: str) -> None:
        """``t``, one value shared by the rows ``start ... start + n - 1``, is none of the draw's (or
        those rows') per-column statistics: mean, sum, standard deviation, variance, maximum, minimum.
        Such a tensor lets one example move every sample's gradient. Other functions of the batch
        cannot be seen here (docs/python-api.md, "What the loop must do")."""
        if not t.is_floating_point() or t.numel() == 0 or not t.detach().ne(0).any():
            return   # all zeros: a statistic of nothing in particular, and the common initial state
        for leaf in self.own:
            if leaf[:1].numel() != t.numel() or leaf.is_complex():
                continue
            rows = leaf.detach().reshape(leaf.shape[0], -1).to(device=t.device, dtype=torch.float64)
            for part in (rows, rows[start:start + n]) if n and n < len(rows) else (rows,):
                if any(_close(s, t.reshape(-1)) for s in _column_statistics(part)):
                    raise DpclipError(f"{what} holds a statistic of the drawn batch (its mean, sum, deviation, "
                                      "maximum or minimum over the samples), shared by every sample: one example "
                                      "then moves every clipped row, more than the noise is calibrated for",
                                      SHARED_HINT)

    def check(self, t: Tensor, start: int, what: str, hint: str = ROWS_HINT) -> None:
        """``t``'s rows are the drawn rows ``start ... start + len(t) - 1`` of one of the draw's tensors."""
        n = t.shape[0]
        if n == 0:
            return
        if broadcast_rows(t):   # one row for all (positions): refused only where that row is an example's
            if not any(same_rows(leaf, t[:1].expand(leaf.shape[0], *t.shape[1:]), any_row=True)
                       for leaf in self.own):
                self.check_shared(t[:1], start, n, what)
                return
        elif any(same_rows(leaf[start:start + n], t) or same_window(leaf[start:start + n], t) for leaf in self.leaves):
            return
        raise DpclipError(f"{what} is not the rows the data loader drew, in order: a row built from other "
                          "examples (mixed, normalised over the batch, repeated, reordered, already backwarded, or "
                          "another slice) lets one example move several clipped rows, more than the noise is "
                          "calibrated for", hint)


EVAL_HINT = "to evaluate other data between steps, run the model under `with torch.no_grad():`"


def model_input(training: bool) -> tuple[str, str]:
    """What a model forward's rows check calls its input, and its hint: a forward with gradients on
    while a batch is drawn is the training step's, an evaluation in eval mode too."""
    if training:
        return "the model's input", f"{ROWS_HINT}; {EVAL_HINT}"
    return ("the model's input (in eval mode, but with gradients on: while a batch is drawn, such a forward counts "
            "as training)", f"{EVAL_HINT}; {ROWS_HINT}")


LOOP_HINT = ("one batch from make_private's data loader, then loss.backward() once over it, then optimizer.step() "
             "once (docs/python-api.md, \"What the loop must do\"); to go through a large batch in parts, pass "
             "max_physical_batch_size= to make_private")


def unit_weights(rows: int, weight: float) -> Tensor:
    """``rows`` user-level row weights of ``weight`` = 1/k, in float64 on the CPU: the engine casts
    them to its own precision toward zero. Built in the losses' dtype, bfloat16's 1/3 (0.333984375)
    made a person's three rows weigh 1.002 together, past the one unit the noise is calibrated to."""
    return torch.full((rows,), weight, dtype=torch.float64)


class DrawTracker:
    """Where the loop is: the drawn batch that is open (its rows; the rows handed out, in parts,
    and backwarded so far). Each noisy step is one whole draw, backwarded once; a loss or step
    over anything else, a second backward, a draw skipped or two draws in one step are refused
    before anything is released or charged: the ledger then charges exactly what ran."""

    def __init__(self, row_weight: float | None = None) -> None:
        self.draws = 0                 # batches drawn so far
        self.rows: int | None = None   # rows of the open draw (None: none open)
        self.handed = 0                # of them, handed to the loop so far (parts)
        self.backwarded = 0
        self.drawn: DrawnRows | None = None   # the open draw's per-sample tensors
        self.spoiled: str | None = None       # the error a backward raised inside the engine: nothing more is released
        self.busy = False                     # the engine's own forwards (the certificate's replays) run
        self.releasing = False                # optimizer.step() has the engine release (seal.py)
        self._losses_read = False             # a private loss's value left for the loop (the statement says so)
        self.on_first_read: Callable[[], None] = lambda: None   # make_private: restates the saved privacy.json
        # user-level privacy: every row weighs 1/k (k: a person's most records in a step), so a
        # person's rows weigh at most 1 together whichever rows the loop backwards together
        self.row_weight = row_weight
        self.other_loader = False   # make_private's batches drawn by another DataLoader (accelerate's prepare)

    @property
    def losses_read(self) -> bool:
        """Whether a private loss's value has left for the loop: set once, never cleared."""
        return self._losses_read

    @losses_read.setter
    def losses_read(self, value: bool) -> None:
        if self._losses_read and not value:
            raise DpclipError("the mark that the loop read a private loss's value cleared: the values have left "
                              "without noise, and the statement names them as long as the run goes on",
                              "leave losses_read as it is; a run whose loop reads no loss value is one that calls "
                              "loss.backward() and optimizer.step() and prints nothing of the loss")
        if value and not self._losses_read:
            self._losses_read = True
            self.on_first_read()

    def weights(self, rows: int) -> Tensor | None:
        """The engine's row weights for ``rows`` rows (None: example-level)."""
        return None if self.row_weight is None else unit_weights(rows, self.row_weight)

    def open(self, rows: int, batch: Any = None) -> None:
        self.refuse_if_spoiled()
        if self.rows is not None:
            raise DpclipError(f"the data loader drew batch {self.draws + 1} before optimizer.step() of batch "
                              f"{self.draws}: each drawn batch is one noisy step, an empty one too (several "
                              "batches in one step would cost more ε than the ledger charges; a loop that broke out "
                              "after a draw left it open: finish it with loss.backward() and optimizer.step())",
                              LOOP_HINT)
        self.draws += 1
        self.rows, self.handed, self.backwarded = rows, 0, 0
        self.drawn = None if batch is None else DrawnRows(batch, rows)

    def check_rows(self, tree: Any, rows: int, what: str, hint: str = ROWS_HINT) -> None:
        """The per-sample tensors of ``tree`` are the draw's next rows (:mod:`dpclip.integrations.rows`)."""
        if self.drawn is not None and self.rows is not None:
            for t in tensor_rows(tree, rows):
                self.drawn.check(t, self.backwarded, what, hint)
            for t in data_leaves(tree):   # shared by all rows: one value for the batch
                if isinstance(t, Tensor) and t.dim() and t.shape[0] != rows:
                    self.drawn.check_shared(t, self.backwarded, rows, what)

    @contextmanager
    def engine_backward(self) -> Iterator[None]:
        """The engine's backward of a loss: its own forwards are not the loop's, and a failure
        spoils the run (the draw's sums may hold rows the engine refused)."""
        self.busy = True
        try:
            yield
        except BaseException as exc:
            self.spoil("a loss.backward()", exc)
            raise
        finally:
            self.busy = False

    @contextmanager
    def engine_release(self) -> Iterator[None]:
        """``optimizer.step()``'s release: the one place make_private's engine may privatize."""
        self.releasing = True
        try:
            yield
        finally:
            self.releasing = False

    def spoil(self, what: str, exc: BaseException) -> None:
        """``what`` failed inside the engine with ``exc``: nothing more of this run is released."""
        # only the error's type: its message (shapes of the private batch) was printed, labelled
        self.spoiled = f"{what} of this run failed inside the engine (the {type(exc).__name__} above)"

    def refuse_if_spoiled(self) -> None:
        if self.spoiled is not None:
            raise DpclipError(self.spoiled + "; the "
                              "clipped sums of its draw may be partial or unchecked, so nothing more is released",
                              "fix what the first error says, then start again (from a checkpoint saved before it, "
                              "with load_checkpoint): catching a refusal and going on would release what it refused")

    def hand(self, rows: int) -> None:
        self.handed += rows

    def _open_draw(self, what: str, hint: str = LOOP_HINT) -> None:
        self.refuse_if_spoiled()
        if self.rows is None and self.other_loader:
            raise DpclipError(f"{what} without a batch drawn by make_private's data loader: its batches were drawn "
                              "by another DataLoader built from it (accelerate's Accelerator.prepare(data_loader) "
                              "builds one), whose batches the loop's checks do not see",
                              "iterate the data loader make_private returned itself, not one that accelerate's "
                              "prepare() or another wrapper rebuilt from it (a Trainer script: dpclip's DPTrainer)")
        if self.rows is None:
            raise DpclipError(f"{what} without a batch drawn by make_private's data loader (a batch of your own "
                              "loader, or a second step over one batch): ε covers the Poisson draws only", hint)

    def loss(self, rows: int) -> None:
        hint = LOOP_HINT + "; to evaluate, call the criterion you passed to make_private, not the returned one"
        self._open_draw("a loss", hint)
        if rows > self.handed:   # no counts in the message: a Poisson draw's size is private
            raise DpclipError("a loss over more rows than the data loader handed out of this batch", hint)

    def backward(self, rows: int) -> None:
        self._open_draw("loss.backward()")
        if self.backwarded + rows > self.handed:
            raise DpclipError(f"a second backward over batch {self.draws}: each example's clipped gradient may "
                              "enter its step once", LOOP_HINT)
        self.backwarded += rows

    def step(self) -> bool:
        """Whether the noisy step is due now (False: parts of the draw are still to come)."""
        self._open_draw("optimizer.step()")
        if self.backwarded < self.handed:
            raise DpclipError(f"optimizer.step() with rows of batch {self.draws} not backwarded", LOOP_HINT)
        if self.handed < self.rows:
            return False
        self.rows, self.drawn = None, None
        return True

    def state_dict(self) -> dict[str, int]:
        return {"draws": self.draws}


class ModelRowsWatch:
    """Checks, at each outermost forward of ``model`` with gradients on while a draw is open, that
    its per-sample inputs are the draw's next rows (``tracker``: the loop's
    :class:`DrawTracker`). Forwards without gradients (evaluation), the
    engine's own (its probes run inside the checked call; the certificate's replays while
    ``tracker.busy``) and those with no draw open are not the loop's step, and pass unchecked."""

    def __init__(self, model: torch.nn.Module, tracker):
        self.tracker, self.depth = tracker, 0
        self.outer = None   # the outermost call's frame, while it runs
        model.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True)
        model.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module, args, kwargs):
        if self.depth and not self._outer_running():
            self._interrupted()
        if self.depth == 0:
            self.outer = sys._getframe(1)   # torch's call of the model, which runs this hook
        self.depth += 1
        tracker = self.tracker
        if self.depth == 1 and torch.is_grad_enabled() and not tracker.busy:
            tracker.refuse_if_spoiled()   # the cause first, not a symptom of it (the rows check below)
        if self.depth == 1 and torch.is_grad_enabled() and tracker.rows is not None and not tracker.busy:
            first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.dim()), None)
            if first is not None:   # (a refusal here still runs _leave: it is called always)
                # inside a torch.func transform the input is a wrapper without storage: refused by name
                refuse_transform(type(module).__name__, around_the_model=True)
                tracker.check_rows((args, kwargs), first.shape[0], *model_input(module.training))

    def _leave(self, module, args, output):
        self.depth -= 1
        if self.depth == 0:
            self.outer = None

    def _outer_running(self) -> bool:
        """Whether the outermost call is still on the stack (this one is nested in it). torch skips
        the hooks after a forward on a KeyboardInterrupt (it runs them on an Exception only)."""
        frame = sys._getframe(2)
        while frame is not None and frame is not self.outer:
            frame = frame.f_back
        return frame is not None

    def _interrupted(self) -> None:
        """A forward left without its hooks (a caught KeyboardInterrupt): the engine's record of it,
        and of its checks, is partial, so the rows and clipping checks after it would not hold."""
        self.depth, self.outer = 0, None
        self.tracker.spoiled = ("a forward of the model was interrupted (a KeyboardInterrupt caught, in a notebook "
                                "too) before its hooks ran, so the engine's record of it and its checks are partial; "
                                "interrupt between steps, after optimizer.step()")
