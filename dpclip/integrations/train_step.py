"""``private.train_step(inputs, targets)``: a whole private step that dpclip runs, forward included
(docs/python-api.md, "One call per step, compiled").

The classic loop (``criterion(model(x), y).backward()``, ``optimizer.step()``) runs the forward in
the caller's code, where no graph dpclip compiles can hold it. ``train_step`` runs the forward
itself, so that with ``make_private(compile=True)`` each piece of the batch goes through one
``torch.compile`` graph: forward, book-kept backward and clip
(:class:`~dpclip.engine.compiled.CompiledMicroBatch`, docs/compiled.md). Without ``compile`` it is
the classic loop's three calls in one.

It keeps the loop's rules (:class:`~dpclip.integrations.rows.DrawTracker`): the rows must come from
make_private's data loader, each drawn batch (or part of one) is backwarded once, and the noisy step
is taken, and charged, after its last part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dpclip.engine import DPEngine
from dpclip.engine.compiled import CompiledMicroBatch
from dpclip.errors import DpclipError
from dpclip.integrations.loaders import batch_rows
from dpclip.integrations.parts import PrivateCriterion, PrivateOptimizer
from dpclip.integrations.rows import DrawTracker

#: what make_private(compile=True)'s classic loop is told
COMPILED_LOOP_HINT = ("with make_private(compile=True) dpclip runs the forward inside its graph: call "
                      "loss = private.train_step(inputs, targets) once per batch of the returned data loader, in "
                      "place of the criterion, loss.backward() and optimizer.step() (docs/python-api.md, \"One call "
                      "per step, compiled\")")


def check_backend(backend: Any) -> None:
    """``compile_backend`` names one of torch.compile's backends (None: the graph's function uncompiled)."""
    if backend is not None and (not isinstance(backend, str)
                                or backend not in torch.compiler.list_backends(exclude_tags=())):
        raise DpclipError(f"compile_backend must be a torch.compile backend's name, got {backend!r}",
                          "leave it out (\"inductor\"); torch.compiler.list_backends() names the others")


def check_compile(model: nn.Module, compile: Any, backend: Any) -> None:
    """Refuse, with the fix, a ``make_private(compile=...)`` the compiled step cannot take (docs/compiled.md)."""
    if not isinstance(compile, bool):
        raise DpclipError(f"compile must be True or False, got {compile!r}", "compile=True")
    if not compile:
        return
    check_backend(backend)
    half = sorted({str(p.dtype) for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)})
    if half:
        raise DpclipError(f"make_private(compile=True) runs in float32 or float64, and the model holds {half[0]} "
                          "parameters", "keep the model in float32, or compile=False")


def train_step_for(engine: DPEngine, model: nn.Module, criterion: PrivateCriterion, optimizer: PrivateOptimizer,
                   tracker: DrawTracker, *, compile: bool, backend: str | None, piece_rows: int) -> TrainStep:
    """make_private's ``train_step``: with ``compile``, through one compiled graph of ``piece_rows`` rows
    (``backend``: torch.compile's; None runs the graph's function uncompiled), and the classic loop's
    criterion refused. A model the graph cannot take is refused here, the engine detached from it."""
    compiled = None
    if compile:
        try:
            compiled = CompiledMicroBatch(engine, model, flat_loss(criterion), backend=backend)
        except DpclipError:
            engine.detach()   # the model as it was given: make_private may be called again on it
            raise
        criterion.refusal = COMPILED_LOOP_HINT
    return TrainStep(model, criterion, optimizer, tracker, compiled, piece_rows)


def call_model(model: nn.Module, inputs: Any) -> Any:
    """The model on ``inputs``: keyword arguments for a mapping, positional ones for a tuple or list,
    else one argument."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


class TrainStep:
    """One call per drawn batch (or part): forward, per-sample losses, the engine's backward (or the
    compiled graph), then ``optimizer.step()`` (noise and charge after the draw's last part).

    ``piece_rows``: the compiled graph's batch; each part is cut into pieces of that many rows, the
    last padded with copies of its first row at loss weight 0 (they add nothing, and the threshold
    policy never sees them): one batch shape, whatever the Poisson draw."""

    def __init__(self, model: nn.Module, criterion: PrivateCriterion, optimizer: PrivateOptimizer,
                 tracker: DrawTracker, compiled: CompiledMicroBatch | None, piece_rows: int):
        self.model, self.criterion, self.optimizer, self.tracker = model, criterion, optimizer, tracker
        self.compiled, self.piece_rows = compiled, piece_rows

    def __call__(self, inputs: Any, targets: Any) -> Tensor:
        """The mean loss of these rows, detached (computed without noise from private data: for your
        own logs, **not covered by ε**; NaN for an empty draw)."""
        rows = batch_rows((inputs, targets))
        self.tracker.loss(rows)   # before the model sees a row: rows not drawn by the loader are refused
        self.tracker.check_rows((inputs, targets), rows, "train_step's inputs")
        if self.compiled is None:
            losses = self.criterion.per_sample(call_model(self.model, inputs), targets)
            self.tracker.backward(losses.shape[0])   # what the engine clips, as loss.backward() counts it
            if losses.numel():
                with self.tracker.engine_backward():
                    self.criterion.engine.backward(losses, row_weights=self.tracker.weights(losses.shape[0]))
        else:
            flat = flat_rows(inputs, targets, rows)
            self.tracker.backward(rows)
            with self.tracker.engine_backward():
                losses = self._compiled_losses(flat, rows) if rows else torch.zeros(0)
        if not rows:   # an empty draw: nothing to clip, the step releases noise alone
            self.criterion.engine.policy.empty_part()
        self.optimizer.step()
        self.tracker.losses_read = True   # returned to the loop: the statement names it
        return losses.detach().mean() if rows else torch.tensor(float("nan"))

    def _compiled_losses(self, flat: dict[str, Tensor], rows: int) -> Tensor:
        size, losses = self.piece_rows, []
        weights = self.tracker.weights(rows)
        for start in range(0, rows, size):
            piece = {key: value[start:start + size] for key, value in flat.items()}
            samples = min(size, rows - start)
            if samples < size:
                piece = {key: torch.cat([value, value[:1].expand(size - samples, *value.shape[1:])])
                         for key, value in piece.items()}
            losses.append(self.compiled(piece, samples, None if weights is None else weights[start:start + size]))
        return torch.cat(losses)



def flat_loss(criterion: PrivateCriterion) -> Callable[[nn.Module, dict[str, Tensor]], Tensor]:
    """The per-sample losses of :func:`flat_rows`'s rows: the function the compiled graph traces."""
    def losses(model: nn.Module, flat: dict[str, Tensor]) -> Tensor:
        inputs, targets = unflat_rows(flat)
        return criterion.per_sample(call_model(model, inputs), targets)
    return losses


# The graph takes a dict of tensors, the batch in dim 0 of each; the keys say where each came from
# (constants to the trace), so the call is rebuilt inside the graph.

def flat_rows(inputs: Any, targets: Any, rows: int) -> dict[str, Tensor]:
    """``inputs`` (a tensor, a tuple or list of tensors, or a mapping of names to tensors) and
    ``targets`` (a tensor) as one dict of tensors with ``rows`` rows each; anything else is refused."""
    flat: dict[str, Tensor] = {}
    if isinstance(inputs, Tensor):
        flat["inputs"] = inputs
    elif isinstance(inputs, Mapping) and all(isinstance(k, str) for k in inputs):
        flat.update({f"inputs:{key}": value for key, value in inputs.items()})
    elif isinstance(inputs, (tuple, list)):
        flat.update({f"inputs/{i}": value for i, value in enumerate(inputs)})
    else:
        flat["inputs"] = inputs
    flat["targets"] = targets
    for key, value in flat.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != rows:
            raise DpclipError(f"make_private(compile=True) takes tensors with one row per example, and the "
                              f"batch's {key} is {_described(value)}",
                              "return tensors (or a tuple or dict of them) from the dataset, or compile=False")
    return flat


def unflat_rows(flat: dict[str, Tensor]) -> tuple[Any, Tensor]:
    if "inputs" in flat:
        inputs: Any = flat["inputs"]
    elif any(key.startswith("inputs:") for key in flat):
        inputs = {key[len("inputs:"):]: value for key, value in flat.items() if key.startswith("inputs:")}
    else:
        inputs = tuple(value for key, value in flat.items() if key.startswith("inputs/"))
    return inputs, flat["targets"]


def _described(value: Any) -> str:
    # no shape: a Poisson draw's size is private (the refusal is not covered by ε)
    if isinstance(value, Tensor):
        return "a tensor without the batch in dim 0"
    return f"a {type(value).__name__}"
