"""The certificate's replays: a recorded forward, its inputs cut or changed, the model run again by
plain autograd with nothing of the step disturbed (RNG streams, buffers, hooks, parameters' hooks).

A replay runs the layers' own forwards (the book-keeping passes through), with the model's and
the user's forward hooks silenced, the RNG streams set to the state the real forward started
from and restored after, the model's state put back (state.py), the real forward's autocast
state, and the trainable parameters swapped for detached leaves (:func:`torch.func.functional_call`), so that hooks on the
parameters never see a per-sample gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from dpclip.engine.batch_axis.layout import tensor_leaves
from dpclip.engine.precision import AutocastState, autocast_restore, autocast_snapshot
from dpclip.torch_compat import (forward_hooks_silenced, functional_call_restoring, parametrizations_uncached,
                                 reentrant_checkpoints_inline, tensor_version, tree_flatten, tree_unflatten)


class NotReproducible(Exception):
    """The model's own forward, replayed on the batch from the same RNG state, does not give the
    book-kept forward's outputs: the engine checks a dry micro-batch in eval mode instead."""


@dataclass(eq=False)
class Forward:
    """One forward of the model recorded for a check."""

    args: tuple
    kwargs: dict
    batch: int
    rng: tuple[Tensor, dict]                  # the CPU state and each CUDA device's, at entry
    autocast: AutocastState
    outputs: list[Tensor] = field(default_factory=list)   # the returned tensors' values at the end
    random: bool = False                       # whether the forward drew random numbers
    draws: list[Tensor] | None = None          # its pure random draws, in order (None: not recordable; draws.py)
    draw_calls: list = field(default_factory=list)   # each draw's operation and arguments (draws.py)
    edges: list = field(default_factory=list)     # their autograd edges then (before any in-place change)
    handles: list = field(default_factory=list)   # hooks that read the cotangents at those edges
    buffers: dict | None = None   # the model's state at entry, by name (state.snapshot: a forward may update it)
    replayed_rng: tuple | None = None   # the RNG state a replay of the whole batch left (batch.py)
    given: tuple | None = None   # the inputs as handed over and their versions, until the forward ends
    written: bool = False        # it changed its inputs in place: args, kwargs are the rows before it ran
    loss_parts: object = None    # the losses' cotangents on every row, by halves (alone.loss_partitions; first forward)


def versions(tree) -> list[int | None]:
    """The version counters of the tensors of ``tree`` (None: an inference tensor keeps none)."""
    out = []
    for t in tensor_leaves(tree):
        try:
            out.append(tensor_version(t))
        except RuntimeError:
            out.append(None)
    return out


def copied(tree):
    """``tree`` with each tensor a detached copy (one copy of a tensor given twice)."""
    leaves, spec = tree_flatten(tree)
    copies: dict[int, Tensor] = {}
    return tree_unflatten([copies.setdefault(id(t), t.detach().clone()) if isinstance(t, Tensor) else t
                           for t in leaves], spec)


def keep_given_or_copies(forward: Forward) -> None:
    """As a checked forward ends: its inputs as given when it left them as they were, else the
    copies taken before it ran (``x.mul_(2)`` in the forward: the given rows are changed, and a
    replay must see the rows the real forward saw). The check's replays then run on copies too."""
    if forward.given is None:
        return
    (args, kwargs), before = forward.given
    forward.given = None
    if None not in before and versions((args, kwargs)) == before:
        forward.args, forward.kwargs = args, kwargs
    else:
        forward.written = True


def release(forward: Forward) -> None:
    """Remove a recorded forward's hooks (its check is done, or it was never needed)."""
    for h in forward.handles:
        h.remove()
    forward.handles.clear()


def rng_state(devices: list[int]) -> tuple[Tensor, dict]:
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


def set_rng(state: tuple[Tensor, dict]) -> None:
    """Torch's CPU generator and each CUDA device's to ``state`` (:func:`rng_state`'s form)."""
    torch.set_rng_state(state[0])
    for d, device_state in state[1].items():
        torch.cuda.set_rng_state(device_state, d)


def same_rng(a: tuple[Tensor, dict], b: tuple[Tensor, dict]) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(a[1][d], b[1][d]) for d in a[1])


def select(args: tuple, kwargs: dict, batch: int, rows: Tensor | None, first_only: bool,
           replace: tuple[int, int] | None = None):
    """The inputs with the batch rows ``rows`` (None: all), or with row j replaced by row s
    (``replace``); the batch is dim 0 of each input tensor of leading size B, or of the first
    tensor only (``first_only``)."""
    leaves, spec = tree_flatten((args, kwargs))
    out, seen = [], False
    for t in leaves:
        if isinstance(t, Tensor):
            t = t.detach()
            if not (first_only and seen) and t.dim() >= 1 and t.shape[0] == batch:
                if rows is not None:
                    t = t[rows.to(t.device)]
                if replace is not None:
                    j, s = replace
                    t = t.clone()
                    t[j] = t[s]
            seen = True
        out.append(t)
    return tree_unflatten(out, spec)


class Cotangents:
    """Hooks on the returned tensors, registered when the forward ends. While ``reading``, each
    records its tensor's gradient and passes zero on, so that a returned tensor upstream of
    another gets its direct part only; otherwise they let the gradient through untouched (the
    engine's own backward). Registered before any in-place change of an output, they see the
    gradient of the value the forward returned."""

    def __init__(self, silence: Callable[[bool], None] = lambda on: None):
        self.reading = False
        self.silence = silence       # the book-kept operations deliver nothing while reading
        self.got: dict[tuple[int, int], Tensor] = {}

    def attach(self, forward: Forward, returned: list[Tensor]) -> None:
        forward.outputs = [t.detach().clone() for t in returned]
        forward.edges = [torch.autograd.graph.get_gradient_edge(t) for t in returned]
        forward.handles = [t.register_hook(self._hook((id(forward), j))) for j, t in enumerate(returned)]

    def _hook(self, key: tuple[int, int]):
        def read(grad):
            if not self.reading:
                return None
            self.got[key] = grad.detach().clone()
            return torch.zeros_like(grad)
        read.dpclip_certificate = True   # not the user's hook (refusals.refuse_new_trainable)
        return read

    def of(self, loss: Tensor, forwards: list[Forward]) -> list[list[Tensor | None]]:
        """∂loss/∂o (its direct part) for each forward's returned tensors o."""
        self.got, self.reading = {}, True
        self.silence(True)
        try:
            torch.autograd.grad(loss, [e for f in forwards for e in f.edges], retain_graph=True,
                                allow_unused=True)
        finally:
            self.reading = False
            self.silence(False)
        return [[self.got.get((id(f), j)) for j in range(len(f.edges))] for f in forwards]


def batch_axis(full: Tensor, alone: Tensor, batch: int) -> int | None | str:
    """The axis of ``full`` (a batch of ``batch``) that holds the batch, read off the same tensor
    computed on one sample alone: an int, None (no axis moved: shared by all samples), or
    "mixed" (no single axis went from B to 1)."""
    if batch == 1:
        return 0 if full.dim() and full.shape[0] == 1 else None
    if full.shape == alone.shape:
        return None
    if full.dim() != alone.dim():
        return "mixed"
    moved = [k for k in range(full.dim()) if full.shape[k] != alone.shape[k]]
    if len(moved) == 1 and full.shape[moved[0]] == batch and alone.shape[moved[0]] == 1:
        return moved[0]
    return "mixed"


def close(a: Tensor, b: Tensor, rtol: float) -> bool:
    """Equal within ``rtol`` of ``a``'s largest entry (the same entries non-finite)."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.detach(), b.detach().to(a.dtype)
    finite = torch.isfinite(a)
    if not bool(finite.all()):
        if not torch.equal(finite, torch.isfinite(b)):
            return False
        a, b = a[finite], b[finite]
    if a.numel() == 0:
        return True
    return bool((a - b).abs().max() <= rtol * a.abs().max().clamp_min(1e-30))


@contextmanager
def replaying(model: nn.Module, plain: Callable, devices: list[int], gradless: list | None = None) -> Iterator[None]:
    """Replays run the layers' own forwards, with gradients, without the model's forward hooks
    (the user's and the engine's own); the RNG streams are put back afterwards. Reentrant
    ``torch.utils.checkpoint`` blocks run as plain calls (:func:`dpclip.torch_compat.reentrant_checkpoints_inline`):
    such a block passes gradients to its parameters only by a ``.backward()`` on the module's own
    parameters (``torch.autograd.grad`` refuses it), and a replay differentiates detached leaves.
    The plain call draws the same random numbers (the block's forward runs once either way).
    ``gradless``, if given, gets an entry for each such block called on inputs none of which needs
    a gradient: in training torch never runs its backward, so its parameters get no gradient there.
    A parametrized weight is computed from the replay's own leaves, never read from a user's
    ``parametrize.cached()`` block (:func:`dpclip.torch_compat.parametrizations_uncached`)."""
    def seen(args: tuple) -> None:
        if gradless is not None and not any(t.requires_grad for t in tensor_leaves(args)):
            gradless.append(True)
    with plain(), torch.random.fork_rng(devices=devices), forward_hooks_silenced(model), torch.enable_grad(), \
            reentrant_checkpoints_inline(seen), parametrizations_uncached():
        yield


class Replayer:
    """Runs a recorded forward again on ``model`` with its trainable parameters (by name) swapped
    for detached leaves: the gradients it gives are the replay's own. ``dtype`` float64: the
    parameters, buffers and floating inputs in float64 (the reference a float32 check falls back
    on, :meth:`dpclip.engine.certificate.Certificate.check`)."""

    def __init__(self, model: nn.Module, names: list[str], params: list[Tensor], dtype: torch.dtype | None = None):
        self.model, self.names, self.params, self.dtype = model, names, params, dtype

    def leaves(self) -> list[Tensor]:
        if self.dtype is None:
            return [p.detach().requires_grad_(True) for p in self.params]
        return [p.detach().to(self.dtype).requires_grad_(True) for p in self.params]

    def _widened(self, tree):
        leaves, spec = tree_flatten(tree)
        return tree_unflatten([t.to(self.dtype) if isinstance(t, Tensor) and t.is_floating_point() else t
                               for t in leaves], spec)

    def _swapped(self, leaves: list[Tensor]) -> dict[str, Tensor]:
        swapped = dict(zip(self.names, leaves))
        if self.dtype is not None:
            swapped.update({n: b.to(self.dtype) if b.is_floating_point() else b
                            for n, b in self.model.named_buffers() if b is not None})
        return swapped

    def run(self, forward: Forward, inputs, leaves: list[Tensor]) -> list[Tensor]:
        if forward.written:   # a forward that changes its inputs in place would change the recorded rows
            inputs = copied(inputs)
        args, kwargs = inputs if self.dtype is None else self._widened(inputs)
        set_rng(forward.rng)
        saved = autocast_snapshot(forward.autocast.keys())
        autocast_restore(forward.autocast)
        try:
            out = functional_call_restoring(self.model, self._swapped(leaves), args, kwargs, strict=False)
        finally:
            autocast_restore(saved)
        return tensor_leaves(out)

    def within(self, leaves: list[Tensor]) -> Callable[[Callable], object]:
        """Runs a function (a backward through this replay) with the parameters swapped for
        ``leaves`` again: a Function that recomputes its forward in its backward and runs a
        backward of its own (Reformer's reversible layers) reads the module's parameters then."""
        holder = _Holder(self.model)
        swapped = {f"model.{n}": t for n, t in self._swapped(leaves).items()}
        return lambda fn: functional_call_restoring(holder, swapped, (fn,), strict=False)


class _Holder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable):
        return fn()


def _grads(outputs, leaves: list[Tensor], cotangents, **kw) -> tuple:
    """``torch.autograd.grad`` of ``outputs`` and what a Function's own backward inside it
    accumulated into the leaves' ``.grad`` (a reversible layer's), the leaves left clean."""
    for p in leaves:
        p.grad = None
    try:
        grads = torch.autograd.grad(outputs, leaves, cotangents, retain_graph=True, allow_unused=True, **kw)
        return grads, [p.grad for p in leaves]
    finally:
        for p in leaves:
            p.grad = None


def vjp(outputs: list[Tensor], cotangents: list[Tensor | None], leaves: list[Tensor],
        within: Callable = lambda fn: fn()) -> list[Tensor]:
    """Σ_o J_o(θ)ᵀ cot_o over the outputs with a cotangent, per parameter leaf (zeros where unused):
    what flows to them and what a Function's own backward gave them (``within``: the replay's
    parameter swap, :meth:`Replayer.within`)."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if c is not None and o.requires_grad]
    if not pairs:
        return [torch.zeros_like(p) for p in leaves]
    grads, nested = within(lambda: _grads([o for o, _ in pairs], leaves, [c.to(o.dtype) for o, c in pairs]))
    out = []
    for p, g, n in zip(leaves, grads, nested):
        parts = [t for t in (None if g is None else g.detach(), n) if t is not None]
        out.append(sum(parts[1:], parts[0]) if parts else torch.zeros_like(p))
    return out


def vjp_rows(outputs: list[Tensor], cotangents: dict[int, list[Tensor | None]],
             leaves: list[Tensor], within: Callable = lambda fn: fn()) -> dict[int, list[Tensor]]:
    """:func:`vjp` for several rows' cotangents on the same outputs: one backward batched over the
    rows (``is_grads_batched``, torch's vmap of the backward) where torch can, one per row where
    not (an operation without a batching rule, or a Function running a backward of its own)."""
    rows = list(cotangents)
    used = [k for k, o in enumerate(outputs) if o.requires_grad and any(cotangents[r][k] is not None for r in rows)]
    if len(rows) > 1 and used:
        stacked = [torch.stack([torch.zeros_like(outputs[k]) if cotangents[r][k] is None
                                else cotangents[r][k].to(outputs[k].dtype) for r in rows]) for k in used]
        try:
            grads, nested = within(lambda: _grads([outputs[k] for k in used], leaves, stacked, is_grads_batched=True))
        except RuntimeError:
            pass
        else:
            if all(n is None for n in nested):
                return {r: [torch.zeros_like(p) if g is None else g[i].detach() for p, g in zip(leaves, grads)]
                        for i, r in enumerate(rows)}
    return {r: vjp(outputs, cotangents[r], leaves, within) for r in rows}


def equal_values(a: Tensor, b: Tensor) -> bool:
    """Same shape and values, a missing value (NaN) equal to itself: a buffer after a replay against
    the real forward's (state.py), a loop's rows against the draw's (integrations/rows.py)."""
    if a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    return bool(a.is_floating_point() or a.is_complex()) and torch.equal(a.isnan(), b.isnan()) and \
        torch.equal(a.nan_to_num(), b.nan_to_num())


@contextmanager
def module_stack(model: nn.Module) -> Iterator[list[nn.Module]]:
    """The modules whose forward is in progress, innermost last (left as it was when a forward
    raised: its last entry is where)."""
    stack: list[nn.Module] = []

    def enter(m, args):
        stack.append(m)

    def leave(m, args, out):
        stack.pop()
    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    try:
        with forward_hooks_silenced(model, keep=handles):
            yield stack
    finally:
        for h in handles:
            h.remove()


@contextmanager
def module_outputs(model: nn.Module) -> Iterator[list]:
    """Each module call's (module, output tensors), in the order the calls finish."""
    calls: list = []

    def record(m, args, out):
        calls.append((m, [t.detach() for t in tensor_leaves(out)]))
    handles = [m.register_forward_hook(record) for m in model.modules()]
    try:
        with forward_hooks_silenced(model, keep=handles):
            yield calls
    finally:
        for h in handles:
            h.remove()
