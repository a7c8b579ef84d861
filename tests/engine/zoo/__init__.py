"""The model zoo of issue 25: the measuring stick the engine's clip is judged by.

A :class:`Case` builds a tiny random-weight model (float32, dropout 0), a batch of B
samples of sequence length T, and the per-sample loss (``reduction="none"``, each sample's
tokens averaged, padding masked out). Three families:

- ``hf``: tiny transformers architectures from random configs (:mod:`.hf`), plus LoRA,
  frozen, padded and long-sequence variants;
- ``layer``: the PyTorch / Opacus layer zoo (:mod:`.layers`);
- ``pattern``: the forward patterns issue 25 names (:mod:`.patterns`): sequence-first
  layers, shared [T, d] tables, in-place changes of a Linear's output, shared biases, ...

:mod:`.judge` runs a case through ``DPEngine`` and compares the clipped sum with a float64
per-sample loop; ``scripts/supported_models.py`` renders the verdicts into docs/supported-models.md
and ``tests/engine/test_hf_zoo.py`` asserts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

#: shape families: name -> (B, T). "generic" avoids every coincidence of sizes (B ≠ T, and
#: neither equals a head count or hidden size); the others are the coincidences that an
#: engine guessing the batch axis from a size gets wrong.
SHAPES: dict[str, tuple[int, int]] = {
    "generic": (3, 5),
    "B==T": (4, 4),
    "B==T+1": (5, 4),
    "B==1": (1, 5),
}
GROUPINGS = ("all-layer", "layer", "param")
METHODS = ("ghost", "instantiate", "auto")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Case:
    """One zoo entry.

    ``build()`` returns a fresh float32 model (same weights every call); ``batch(B, T, g)``
    the inputs, a dict of tensors whose dim 0 is the sample (sequence-first cases transpose
    inside ``loss``); ``loss(model, batch)`` the per-sample losses, shape [B].
    """

    name: str
    family: str                     # "hf" | "layer" | "pattern"
    what: str                       # one line for the docs table
    build: Callable[[], nn.Module]
    batch: Callable[[int, int, torch.Generator], dict[str, Tensor]]
    loss: Callable[[nn.Module, dict[str, Tensor]], Tensor]
    tags: tuple[str, ...] = field(default=())


CASES: dict[str, Case] = {}


def register(case: Case) -> Case:
    if case.name in CASES:
        raise ValueError(f"duplicate zoo case {case.name!r}")
    CASES[case.name] = case
    return case


def seeded(fn: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    """``fn`` run under a fixed torch seed, in float32 eval mode (dropout off either way)."""

    def build() -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return fn().float().eval()

    return build


# ------------------------------------------------------------------ shared losses


def token_mean(per_token: Tensor, mask: Tensor | None = None) -> Tensor:
    """[B, T] token losses -> [B]: each sample's (unmasked) tokens averaged."""
    if mask is None:
        return per_token.mean(1)
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum(1) / mask.sum(1).clamp_min(1)


def upcast(x: Tensor) -> Tensor:
    """An autocast (bf16/fp16) output read in float32; float32 and float64 as they are."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def readout(out: Tensor) -> Tensor:
    """A per-sample loss reading every output entry of ``out`` ([B, ...]) through fixed
    random weights (a function of the shape only), so that every parameter gets a gradient:
    mean(tanh(out)·W) + 0.1·mean(out²)."""
    flat = upcast(out.flatten(1))
    g = torch.Generator().manual_seed(1234 + flat.shape[1])
    w = torch.randn(flat.shape[1], generator=g).to(flat.dtype)
    return (torch.tanh(flat) * w).mean(1) + 0.1 * flat.pow(2).mean(1)


def ids(B: int, T: int, g: torch.Generator, vocab: int, low: int = 1) -> Tensor:
    return torch.randint(low, vocab, (B, T), generator=g)


def floats(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g)


def _load_all() -> None:
    from tests.engine.zoo import families, hf, layers, outside, patterns, recent  # noqa: F401  (they register their cases)


_load_all()

__all__ = ["CASES", "Case", "GROUPINGS", "METHODS", "PRECISIONS", "SHAPES", "floats", "ids",
           "readout", "register", "upcast", "seeded", "token_mean"]
