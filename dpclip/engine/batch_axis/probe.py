"""The probe forwards: per module call, the shapes it saw; two probes give the layouts.

The model's forward runs with the book-keeping off and the RNG state forked and restored,
on the first two samples of the batch and on three (row 0 repeated where B < 3; one and two
samples where B = 1; the model's tensor inputs of leading size B are resized, or, should
that fail, the first one alone). Each call of each book-kept module (in call order) records
the shapes of the tensors it receives and returns. Per tensor, comparing the probes
(p -> p' samples):

- one axis whose size went p -> p': the batch axis;
- one axis whose size went c·p -> c·p' (c ≥ 2): the batch merged with c positions, read as
  [o, p, c/o] for one divisor o of c: batch outer (o = 1, [p, c]: OPT's tokens), batch inner
  (o = c: c views concatenated on the batch) or between (Llama 4's experts, [E, p, T]);
  accepted when exactly one o makes the two probes' rows of their common samples agree
  (compared by a random projection of each row); unflattened to [B, c, ...] by position-wise
  rules;
- no axis moved: shared by every sample (:attr:`Layout.dim` None);
- anything else (several axes moving, an axis moving out of proportion, a change of rank):
  an error, raised when a rule needs that tensor.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from dpclip.engine.batch_axis.layout import EQUAL_ROWS_HINT, CallLayout, Layout, call_leaves, tensor_leaves
from dpclip.torch_compat import parametrizations_uncached, tree_flatten, tree_unflatten


@dataclass
class _Seen:
    shape: tuple[int, ...]
    sums: dict[int, Tensor]   # per-row fingerprints along the axes asked for


#: the error of a layout whose merged axis needs the rows fingerprinted (a further probe pair)
NEEDS_ROWS = ("an axis holds the batch merged with positions, in an order the probes did not "
              "check")


def _fingerprint(t: Tensor, k: int) -> Tensor:
    """One number per row of axis ``k``: a fixed random projection of the row (plain sums
    vanish on normalised rows)."""
    flat = t.detach().movedim(k, 0).reshape(t.shape[k], -1).to(torch.float64)
    weights = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(20250),
                          dtype=torch.float64).to(flat.device)
    return (flat @ weights).cpu()


def _seen(t: Tensor, axes=()) -> _Seen:
    sums = {}
    for k in axes:
        if k < t.dim():
            try:
                with torch.no_grad():
                    sums[k] = _fingerprint(t, k)
            except (RuntimeError, TypeError):  # a dtype with no float64 view: not comparable
                pass
    return _Seen(tuple(t.shape), sums)


class Probe:
    """One probing forward: per (unit, call ordinal), what each call received and returned.

    ``rows``: (key, input index) or (key, "out", output index) -> the axes whose rows are
    fingerprinted (merged axes).
    In a consumer probe (``check``), ``expand`` (key -> function of (args, kwargs, orig)
    returning the output) runs the calls whose outputs are followed."""

    def __init__(self, batch: int, expand: dict | None = None, check=None, rows: dict | None = None):
        self.batch = batch
        self.expand = expand or {}
        self.check = check
        self.rows = rows or {}
        self.ordinals: dict[int, int] = {}
        self.calls: dict[tuple[int, int], tuple[list[_Seen], list[_Seen]]] = {}
        self.stack: list[int] = []                # id() of the modules whose calls are in progress
        self.reads: dict[int, set[int]] = {}      # id(parameter) -> modules in progress when an op read it

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Records which modules' calls were in progress when an op read each parameter: a
        module that reads a child's weight without calling the child (Mamba's mixer passes
        ``self.conv1d.weight`` to ``F.conv1d``) is seen reading it (:attr:`reads`)."""
        def enter(module, args):
            self.stack.append(id(module))

        def leave(module, args, out):
            self.stack.pop()
        handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]
        try:
            with _ParameterReads(self):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def call(self, unit, orig: Callable, args: tuple, kwargs: dict):
        n = self.ordinals.get(id(unit), 0)
        self.ordinals[id(unit)] = n + 1
        key = (id(unit), n)
        if self.check is not None:   # consumer probe: the checks, not the shapes, are wanted
            expander = self.expand.get(key)
            return orig(*args, **kwargs) if expander is None else expander(args, kwargs, orig)
        ins = [_seen(t, self.rows.get((key, i), ())) for i, t in enumerate(call_leaves(args, kwargs))]
        out = orig(*args, **kwargs)
        self.calls[key] = (ins, [_seen(t, self.rows.get((key, "out", i), ()))
                                 for i, t in enumerate(tensor_leaves(out))])
        return out


class _ParameterReads(TorchFunctionMode):
    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, nn.Parameter):
                self.probe.reads.setdefault(id(a), set()).update(self.probe.stack)
        return func(*args, **kwargs)


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal up to rounding, relative to the fingerprints' own scale: a freshly initialised layer's
    outputs can be 10⁻⁶ in size, where an absolute floor would call every row equal to every other."""
    if a.shape != b.shape:
        return False
    scale = max(float(a.abs().max()), float(b.abs().max())) if a.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * scale))


def _same_samples(a: Tensor, b: Tensor, batch: int, new: int, c: int, outer: int) -> bool:
    """Whether per-row fingerprints ``a`` (``batch`` samples) and ``b`` (``new`` samples, the
    same first ones) agree on their common samples, read as [outer, B, c / outer] rows."""
    va = a.view(outer, batch, -1).transpose(0, 1).reshape(batch, c)
    vb = b.view(outer, new, -1).transpose(0, 1).reshape(new, c)
    m = min(batch, new)
    return _close(va[:m].contiguous(), vb[:m].contiguous())


def _layout(x: _Seen, y: _Seen, batch: int, new: int) -> Layout:
    n = len(x.shape)
    if len(y.shape) != n:
        return Layout(n, error=f"its rank changes with the batch size ({x.shape} with {batch} "
                               f"samples, {y.shape} with {new})")
    moved = [k for k in range(n) if x.shape[k] != y.shape[k]]
    if not moved:
        return Layout(n, lead1=n >= 1 and x.shape[0] == 1)
    if len(moved) > 1:
        return Layout(n, error=f"axes {moved} all change with the batch size ({x.shape} with "
                               f"{batch} samples, {y.shape} with {new}): it mixes samples")
    k = moved[0]
    if x.shape[k] == batch and y.shape[k] == new:
        return Layout(n, k)
    c = x.shape[k] // batch
    if x.shape[k] % batch == 0 and c >= 2 and y.shape[k] == c * new:
        a, b = x.sums.get(k), y.sums.get(k)
        if a is None or b is None:
            return Layout(n, k, merged=True, error=NEEDS_ROWS)
        fits = [o for o in range(1, c + 1) if c % o == 0 and _same_samples(a, b, batch, new, c, o)]
        if len(fits) == 1:
            return Layout(n, k, merged=True, outer=fits[0])
        if fits:   # rows that read alike in several orders (a top-1 router's weights, all 1)
            return Layout(n, error=f"axis {k} holds the batch merged with {c} positions, and its rows are "
                                   f"equal read in {len(fits)} orders ([o, B, {c}/o] for o in {fits[:4]}), so "
                                   "the probe cannot tell which rows are whose", hint=EQUAL_ROWS_HINT)
        return Layout(n, error=f"axis {k} holds the batch merged with {c} positions, but in no order the "
                               "probe can tell: neither batch-outer ([B, T] flattened), batch-inner ([c, B]: "
                               "views concatenated on the batch) nor between ([E, B, T])")
    return Layout(n, error=f"axis {k} changes with the batch size out of proportion "
                           f"({x.shape[k]} with {batch} samples, {y.shape[k]} with {new})")


def compare(a: Probe, b: Probe) -> dict[tuple[int, int], CallLayout]:
    """Layouts of the calls both probes made alike (same number of tensors in and out)."""
    out = {}
    for key, (ins, outs) in a.calls.items():
        got = b.calls.get(key)
        if got is None or len(got[0]) != len(ins) or len(got[1]) != len(outs):
            continue
        out[key] = CallLayout(
            tuple(_layout(x, y, a.batch, b.batch) for x, y in zip(ins, got[0])),
            tuple(_layout(x, y, a.batch, b.batch) for x, y in zip(outs, got[1])))
    return out


def resized(args: tuple, kwargs: dict, batch: int, new: int, first_only: bool):
    """The model's inputs with the batch resized to ``new`` rows (detached copies: a forward that
    changes its inputs in place, ``x.mul_(2)``, must not change the rows of the forward probed)."""
    leaves, spec = tree_flatten((args, kwargs))
    seen_first = False
    out = []
    for t in leaves:
        if isinstance(t, Tensor):
            t = t.detach()
            if (not (first_only and seen_first)) and t.dim() >= 1 and t.shape[0] == batch:
                t = t[:new].clone() if new <= batch else torch.cat([t, t[:new - batch]])
            else:
                t = t.clone()
            seen_first = True
        out.append(t)
    return tree_unflatten(out, spec)


@contextmanager
def forked_rng(devices: list) -> Iterator[None]:
    """The probes draw nothing from the caller's RNG streams (dropout in the model)."""
    with torch.random.fork_rng(devices=devices):
        yield


@contextmanager
def untouched_buffers(model: torch.nn.Module) -> Iterator[None]:
    """The probes leave the model's buffers as they found them: a probe forward is not a
    training forward, and must not advance what one advances (spectral_norm's power
    iteration, a step counter), nor leave its sample rows in a buffer.

    A buffer the probes left as it was is not written back: a probe can run in the middle of
    a training forward (a call the first probes never saw), and a write, even of the same
    values, bumps the buffer's version and so spoils every tensor that forward saved for its
    backward that is a view of it (BERT's ``token_type_ids``, expanded over the batch).

    Nor do they read or leave a parametrized weight in ``parametrize.cached()``'s cache: inside a
    user's cached() block the training forward would read the probe's W, and its backward run into
    the probe's graph, which keeps nothing (:func:`nothing_saved`)."""
    saved = [(module, name, b, b.detach().clone()) for module in model.modules()
             for name, b in module.named_buffers(recurse=False)]
    try:
        with parametrizations_uncached():
            yield
    finally:
        with torch.no_grad():
            for module, name, b, value in saved:
                setattr(module, name, b)      # a forward may have assigned a new tensor
                if not torch.equal(b, value):
                    b.copy_(value)


def _not_kept(tensor: Tensor) -> None:
    return None


def _never_unpacked(_) -> Tensor:
    raise RuntimeError("a batch-axis probe's forward has no backward")


def nothing_saved():
    """Autograd keeps no tensor for a probe's backward, which never runs. The probe still
    runs with gradients on (a module may take another path without them: PyTorch's fused
    attention in eval mode), but without the activations a backward would need: the
    probe of three samples at B 2 held 1.5 times the step's own (GPT-2 small at T 1024:
    the first step's peak 1.24x non-private's, 1.08x with this)."""
    return torch.autograd.graph.saved_tensors_hooks(_not_kept, _never_unpacked)
