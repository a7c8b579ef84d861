"""Mixed precision: the forward under autocast, the engine's math in float32 (docs/engine.md).

Under ``torch.autocast`` the book-kept layers see bfloat16 / float16 activations and output
gradients. The engine keeps those factors in their own dtype while they wait in the stash
(half the memory), and widens them to float32 only where it computes with them: per-sample
norms, the clipped sums and instantiated per-sample gradients (:func:`widened`, used by
:mod:`dpclip.engine.factors` and the layer rules' small gradients). The noise is drawn and
added to those float32 sums; ``p.grad`` is the noisy sum in the parameters' dtype (a bf16 or
fp16 model's rounded once, after the noise: post-processing). Its own math never runs under autocast
(:func:`autocast_off`): CPU autocast would run ``linalg.vecdot`` and every matmul in
bfloat16 again.

float16 needs a loss scale (its smallest normal number is 6e-5; per-sample output gradients
underflow). ``engine.backward(losses, loss_scale=S)`` seeds the backward with S instead of 1
and divides the per-sample norms and the clipped sums by S before anything else sees them,
so the clip factors are those of the unscaled gradient. A sample whose gradient overflows
float16 has a non-finite norm and contributes zero (``StepReport.nonfinite``); the step is
never skipped. :class:`Precision` holds a recipe's choice (``training.precision``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from dpclip.errors import EngineError

#: ``training.precision`` names and the autocast dtype each runs the forward in.
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LOW_PRECISION = (torch.float16, torch.bfloat16)
#: the default static loss scale for float16 (why static: docs/engine.md, "Mixed precision")
DEFAULT_LOSS_SCALE = 2.0 ** 10


def widened(t: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``t`` in ``dtype`` if it is a half-precision float, else ``t`` itself.

    Every sum of products the engine forms from half-precision factors (Gram matrices,
    ``aᵀ diag(c) b``, ``Σ_t b_t``) would otherwise round its result to 8 (bfloat16) or 11
    (float16) significant bits; widened, only the factors carry autocast's rounding."""
    return t.to(dtype) if t.dtype in LOW_PRECISION and dtype not in LOW_PRECISION else t


def autocast_input(x: Tensor) -> Tensor:
    """``x`` as an autocast region's matmul or convolution will read it: cast to the autocast
    dtype when autocast is on for its device (under autograd, like autocast's own cast).

    A layer rule whose forward autocast runs in half precision (Linear, Conv, Conv1D)
    saves its input this way, so that its factors are the activations the forward really
    multiplied: the per-sample gradient is then that of the function autocast computed."""
    if (x.is_floating_point() and x.dtype != torch.float64
            and torch.is_autocast_enabled(x.device.type)):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


def autocast_state(device_type: str) -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the autocast region in force for ``device_type``, or None."""
    if torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def autocast_again(state: tuple[str, torch.dtype] | None) -> contextlib.AbstractContextManager:
    """Re-enter an :func:`autocast_state` (for recomputing a forward in the backward)."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(state[0], dtype=state[1])


@contextlib.contextmanager
def autocast_off(device_types: Iterable[str] = ("cpu",)) -> Iterator[None]:
    """Autocast disabled for ``device_types`` (and CPU) inside: the engine's own math must not
    be cast down when a caller runs ``engine.backward`` inside an autocast region."""
    with contextlib.ExitStack() as stack:
        for device_type in sorted(set(device_types) | {"cpu"}):
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


AutocastState = dict[str, tuple[bool, torch.dtype, bool]]


def autocast_snapshot(device_types: Iterable[str]) -> AutocastState:
    """Per device type (and CPU): autocast's enabled flag, dtype and cache flag."""
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
            for d in sorted(set(device_types) | {"cpu"}) if torch.amp.is_autocast_available(d)}


def autocast_restore(state: AutocastState) -> None:
    """Put back an :func:`autocast_snapshot`.

    The batch-axis probes run the model's forward again from inside that forward. A forward
    wrapped in one ``torch.autocast`` instance (``torch.autocast(...)(model.forward)``, as
    accelerate and so the Hugging Face Trainer wrap it) is then entered twice, and the
    instance keeps a single "previous state": the inner entry overwrites it, and the outer
    exit leaves autocast switched on after the forward. Restoring the state the forward
    started with undoes exactly that."""
    for device_type, (enabled, dtype, cache) in state.items():
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_cache_enabled(cache)


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """float32 matmuls and convolutions in full precision inside, whatever the caller chose.

    With TF32 allowed (``torch.backends.fp32_precision = "tf32"``, ``allow_tf32``, or a
    trainer's ``tf32=True``) CUDA rounds float32 matmul inputs to 10 bits: a per-sample norm
    would be off by up to about 2^-11 relative, and a clip factor with it, so a clipped
    gradient could exceed C. The flags are process-wide: they are restored on exit."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):          # torch >= 2.9
        saved = matmul.fp32_precision, conv.conv.fp32_precision
        matmul.fp32_precision = conv.conv.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision, conv.conv.fp32_precision = saved
    else:
        saved = matmul.allow_tf32, conv.allow_tf32
        matmul.allow_tf32 = conv.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32, conv.allow_tf32 = saved


@contextlib.contextmanager
def engine_math(device_types: Iterable[str] = ("cpu",)) -> Iterator[None]:
    """Where the engine computes norms and clipped sums: no autocast, no TF32."""
    with autocast_off(device_types), ieee_float32():
        yield


@dataclass(frozen=True)
class Precision:
    """How the forward of a step runs: ``fp32`` (as is), ``bf16`` or ``fp16`` (autocast).

    ``device_type`` is where the model lives ("cpu", "cuda"). float16 is CUDA only: CPU
    float16 kernels are slow and many are missing, and bfloat16 needs no loss scale.
    ``loss_scale`` (fp16 only) seeds the backward; a power of two keeps the unscaling exact.
    """

    name: str = "fp32"
    device_type: str = "cpu"
    loss_scale: float | None = None

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise EngineError(f"unknown precision {self.name!r}", "use one of: " + ", ".join(PRECISIONS))
        if self.name == "fp16" and self.device_type != "cuda":
            raise EngineError(f"precision fp16 needs a CUDA device; this model is on {self.device_type}",
                              "use bf16 (training.precision: bf16; CPU and CUDA, no loss scale) or fp32, or train "
                              "on a GPU (a recipe's training.device: cuda)")
        if self.loss_scale is not None:
            if self.name != "fp16":
                raise EngineError(f"loss_scale applies to fp16 only, not {self.name}",
                                  "remove loss_scale, or set precision: fp16")
            if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
                raise EngineError(f"loss_scale must be a positive finite number, got {self.loss_scale}",
                                  f"e.g. {DEFAULT_LOSS_SCALE:g} (a power of two)")

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype; None for fp32."""
        return PRECISIONS[self.name]

    @property
    def scale(self) -> float:
        """The loss scale ``engine.backward`` gets: 1 except for fp16."""
        if self.name != "fp16":
            return 1.0
        return DEFAULT_LOSS_SCALE if self.loss_scale is None else float(self.loss_scale)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward and the loss run in (nothing for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


__all__ = ["DEFAULT_LOSS_SCALE", "LOW_PRECISION", "PRECISIONS", "Precision", "autocast_again", "autocast_input",
           "autocast_off", "autocast_restore", "autocast_snapshot", "autocast_state", "engine_math",
           "ieee_float32", "widened"]
