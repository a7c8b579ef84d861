"""The check behind tests/engine/layers/test_properties.py: one layer, one drawn run, the
engine's ``debug_clipped()`` against a float64 per-example autograd loop.

A :class:`Case` is a layer (float64, any parameters) and how to feed it: ``make(n, gen)``
gives n samples as a dict of tensors with the batch in dim 0 (ints or float64), ``run(layer,
batch)`` the layer's output with the batch in dim 0 (a sequence-first layer is transposed
inside ``run``, so the reference can still slice samples from dim 0). The layer sits in

    probe(batch) = head(tanh(run(layer, batch)).flatten(1))      head: nn.Linear(·, 3)

with a cross-entropy loss per sample, so that every grouping (all-layer, layer, param) has
one group or more, and the layer's output gradient is a non-trivial function of its output.

Tolerances (``TOLERANCE``), relative to each quantity's natural scale: a parameter's clipped
sum is compared as ‖Δ_p‖ ≤ tol·Σ_i c_ik‖g_ip‖ (the size of the terms its rounding is
proportional to), a per-sample group norm as |n_e − n_r| ≤ tol·n_r; both scales floored at
``FLOOR`` of the run's largest one, because gradients that are zero in exact arithmetic (the
key bias of attention, the weight of a LayerNorm over one feature) come out as rounding noise
of a different sign on each side.

- float64 model: engine and reference both round at u = 2^-53 ≈ 1.1e-16; sums of at most
  N ≲ 2^10 products (the sizes below) lose at most γ_N = N·u/(1 − N·u) ≈ 1.1e-13 each, through
  a few (≤ 8) chained operations whose conditioning here is O(1) (tanh, softmax, cross-entropy,
  normalisation of inputs with variance ≈ 1): 1e-9 leaves three orders of margin.
- float32 model (the reference is the same weights and inputs widened to float64): the engine's
  forward and backward round at u = 2^-24 ≈ 6.0e-8; the same argument gives
  8·γ_N ≈ 8·2^10·2^-24 = 2^-11 ≈ 4.9e-4 in the worst case, and 2^-11 is the tolerance. The
  largest error seen over the thorough profile was 7e-6 (float64: 3e-12): rounding errors add
  like a random walk, ≈ sqrt(N)·u. Every logic error issue 25 lists is 1e-1 or more.

The reference keeps the model's function exactly: ``nn.RMSNorm(eps=None)`` means the dtype's
own eps, so the float64 copy is given the float32 model's eps (2^-23, not 2^-52).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpclip.engine import DPEngine, build_groups
from dpclip.engine.layers import seeded
from tests.engine.conftest import group_norms, per_example_grads

GROUPINGS = ("all-layer", "layer", "param")
METHODS = ("ghost", "instantiate", "auto")
DTYPES = (torch.float64, torch.float32)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2.0 ** -11}
FLOOR = 1e-2
CLASSES = 3


@dataclass
class Case:
    layer: nn.Module
    make: Callable[[int, torch.Generator], dict[str, Tensor]]
    run: Callable[[nn.Module, dict[str, Tensor]], Tensor]
    length: int          # T: the sequence / spatial length a batch size can coincide with


@dataclass
class Run:
    """The drawn settings of one run: micro-batches of ``batch`` samples each."""

    batch: int
    micro_batches: int
    grouping: str
    method: str
    dtype: torch.dtype
    seed: int


class Probe(nn.Module):
    def __init__(self, layer: nn.Module, run: Callable, width: int):
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(width, CLASSES)
        self._run = run

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.head(torch.tanh(self._run(self.layer, batch)).flatten(1))


def probe_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch), batch["y"], reduction="none")


def _cast(batch: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def thresholds_between(norms: Tensor) -> list[float]:
    """C_k in the widest gap (by ratio) between two of group k's distinct reference norms:
    some samples clipped, some not, none so near C_k that rounding could move it across.
    One distinct positive norm: half of it (clipped); none: 1."""
    out = []
    for col in norms.t():
        values = torch.unique(col[col > 0])
        if len(values) == 0:
            out.append(1.0)
        elif len(values) == 1:
            out.append(0.5 * float(values[0]))
        else:
            j = int((values[1:] / values[:-1]).argmax())
            out.append(math.sqrt(float(values[j]) * float(values[j + 1])))
    return out


def check_case(case: Case, run: Run) -> None:
    """The engine's clipped sums, per-sample group norms and norm paths for ``run`` equal
    (within TOLERANCE) those of autograd on each example alone, clipped by hand."""
    n = run.batch * run.micro_batches
    gen = torch.Generator().manual_seed(run.seed)
    batch = case.make(n, gen)
    batch["y"] = torch.randint(0, CLASSES, (n,), generator=gen)
    with torch.no_grad():
        width = case.run(case.layer.double(), {k: v[:1] for k, v in batch.items()}).flatten(1).shape[1]
    model = seeded(Probe(case.layer, case.run, width), run.seed).to(run.dtype)
    batch = _cast(batch, run.dtype)
    reference = copy.deepcopy(model).double()
    for module in reference.modules():   # eps=None means the dtype's eps: keep the model's
        if isinstance(module, nn.RMSNorm) and module.eps is None:
            module.eps = torch.finfo(run.dtype).eps
    per_sample = per_example_grads(reference, probe_loss, _cast(batch, torch.float64))
    groups = build_groups(reference, run.grouping)
    ref_norms = group_norms(per_sample, groups)                                   # [n, K]
    thresholds = thresholds_between(ref_norms)

    # strict: a registered rule must be used, never the torch.func fallback in its place
    fallback = isinstance(case.layer, (nn.RNNBase, CustomLayer))
    clipping = {"grouping": run.grouping, "norm_method": run.method, "strict": not fallback,
                "threshold": {"kind": "fixed", "value": thresholds}}
    engine = DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=n + 1)
    try:
        for j in range(run.micro_batches):
            chunk = {k: v[j * run.batch:(j + 1) * run.batch] for k, v in batch.items()}
            engine.backward(probe_loss(model, chunk))
        debug = engine.debug_clipped()
    finally:
        engine.detach()

    tol = TOLERANCE[run.dtype]
    assert debug.group_names == groups.names
    got_norms = debug.norms.double()
    assert got_norms.shape == ref_norms.shape, (got_norms.shape, ref_norms.shape)
    norm_scale = ref_norms.clamp_min(FLOOR * float(ref_norms.max()))
    norm_err = float(((got_norms - ref_norms).abs() / norm_scale.clamp_min(1e-300)).max())
    assert norm_err <= tol, f"per-sample group norms off by {norm_err:.3g} (tolerance {tol:.3g}):\n" \
                            f"engine {got_norms}\nreference {ref_norms}"

    factors = (torch.tensor(thresholds, dtype=torch.float64) / ref_norms).clamp(max=1.0).nan_to_num(1.0)
    errors, scales = {}, {}
    for k, members in enumerate(groups.members):
        for j in members:
            name = groups.params[j].name
            want = sum(float(factors[i, k]) * g[name] for i, g in enumerate(per_sample))
            scales[name] = sum(float(factors[i, k]) * float(g[name].norm()) for i, g in enumerate(per_sample))
            errors[name] = float((debug.sums[name].double() - want).norm())
    floor = FLOOR * max(scales.values())
    relative = {name: e / max(scales[name], floor, 1e-300) for name, e in errors.items()}
    worst = max(relative, key=relative.get)
    assert relative[worst] <= tol, f"clipped sum of {worst} off by {relative[worst]:.3g} " \
                                   f"(tolerance {tol:.3g}); all: {relative}"

    assert set(debug.paths) == set(errors), (sorted(debug.paths), sorted(errors))
    for name, path in debug.paths.items():
        if run.method == "instantiate":
            assert "ghost" not in path, (name, path)
        if run.method == "ghost":
            assert "instantiated norm" not in path and "streamed" not in path, (name, path)


class CustomLayer(nn.Module):
    """A layer without a rule (torch.func fallback): its own nn.Parameters, used twice."""

    def __init__(self, d: int, p: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, p))
        self.scale = nn.Parameter(torch.randn(p))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.weight) * self.scale + self.scale.pow(2)
