"""``DPTrainer(per_sample_loss=fn)`` checked, as make_private's criterion is, to give each example
the loss it has alone (dpclip.integrations.parts.PrivateCriterion._check_alone).

``fn(model, inputs)`` runs the model's forward itself, so the check cannot call it on one example's
outputs directly: the model's top-level outputs of the batch are recorded while ``fn`` runs, and on
the steps the certificate checks, ``fn`` runs again on each checked row's inputs alone with the
model's forward answering that row of the recorded outputs (no forward runs again, no random
number is drawn from the streams the run goes on with). A loss that differs alone from in its
batch mixes samples (a loss normalised or weighted by the batch, even through a detached value):
one example would move other examples' clipped gradients, so it is refused before the step's noise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from dpclip.engine.certificate import RTOL
from dpclip.errors import DpclipError
from dpclip.integrations.parts import rows_of
from dpclip.torch_compat import forward_hooks_silenced

HINT = ("compute each example's loss from its own inputs and the model's outputs for it only (reduction='none'); "
        "a weight or baseline computed from the batch belongs in the dataset, as a column of each example")


@contextmanager
def _forward_replaced(model: nn.Module, forward: Callable) -> Iterator[None]:
    """``model.forward`` is ``forward`` inside (an instance attribute: accelerate's own wrapper, if
    any, is put back after)."""
    own = model.__dict__.get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


@contextmanager
def outputs_recorded(model: nn.Module) -> Iterator[list[Any]]:
    """Inside, each call of ``model`` appends what it returns to the list yielded (by a forward hook,
    registered after the engine's: the engine's own probe forwards run with hooks silenced)."""
    outputs: list[Any] = []
    handle = model.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        yield outputs
    finally:
        handle.remove()


def _row(output: Any, r: int, b: int) -> Any:
    """Row ``r`` of ``output`` (a model output: a ``ModelOutput`` or other mapping, a tuple, a tensor),
    kept as a batch of one."""
    if isinstance(output, Mapping):
        rows = {key: _row(value, r, b) for key, value in output.items()}
        try:
            return type(output)(**rows)
        except TypeError:
            return rows
    if isinstance(output, (tuple, list)):
        return type(output)(_row(value, r, b) for value in output) if type(output) in (tuple, list) \
            else rows_of(output, r, b)
    return rows_of(output, r, b)


def _rng_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _alone(model: nn.Module, per_sample_loss: Callable, inputs: Mapping[str, Any], outputs: list[Any],
           r: int, b: int) -> float:
    """Row ``r``'s loss by ``per_sample_loss`` on its inputs alone, the model answering its row of ``outputs``."""
    calls = iter(outputs)

    def row_output(*args: Any, **kwargs: Any) -> Any:
        try:
            return _row(next(calls), r, b)
        except StopIteration:
            raise DpclipError("per_sample_loss calls the model more times on one example than on the batch",
                              HINT) from None
    with _forward_replaced(model, row_output):
        try:
            alone = per_sample_loss(model, rows_of(dict(inputs), r, b))
        except DpclipError:
            raise
        except Exception as exc:   # noqa: BLE001  (the user's loss, on one example)
            raise DpclipError(f"per_sample_loss fails on one example alone ({type(exc).__name__}: {exc}), so its "
                              "losses cannot be checked to be each example's own", HINT) from exc
    return float(alone.reshape(-1)[0])


def check_losses_alone(model: nn.Module, per_sample_loss: Callable, inputs: Mapping[str, Any], losses: Tensor,
                       outputs: list[Any], rows: list[int]) -> None:
    """Each of ``rows`` has alone the loss ``losses`` gives it in the batch; else refused."""
    b = losses.shape[0]
    if b < 2 or not outputs:
        return
    rtol = RTOL.get(losses.dtype, 2.0 ** -5)
    floor = 1e-3 * float(losses.detach().abs().max())
    with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices()), forward_hooks_silenced(model):
        for r in rows:
            a, in_batch = _alone(model, per_sample_loss, inputs, outputs, r, b), float(losses[r])
            if not abs(a - in_batch) <= rtol * max(abs(a), abs(in_batch), floor, 1e-30) and \
                    not (a != a and in_batch != in_batch):
                raise DpclipError("per_sample_loss gives an example another loss alone than in its batch: the "
                                  "losses mix examples (a loss normalised or weighted by the batch, even detached), "
                                  "so one example would move other examples' clipped gradients; nothing of this "
                                  "step is released", HINT)
