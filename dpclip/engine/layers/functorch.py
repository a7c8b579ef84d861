"""Per-sample gradients of any module with torch.func: the rule used when no other matches.

For a module without a layer rule (an LSTM, a custom module with its own
``nn.Parameter``, a custom RMSNorm), the forward runs with its parameters detached and
the output gradients are tapped (:meth:`Capture.tap`). In the backward, this rule
recomputes the module once per sample and pulls the sample's output gradient back to
the parameters:

    g_i = (∂ f(θ; x_i) / ∂θ)ᵀ b_i          (a vector-Jacobian product per sample)

with ``torch.func.vmap(vjp(functional_call(...)))``, or a plain loop over samples when
the module's operations have no batching rule (``nn.LSTM``). The result is exact; the
cost is one extra forward and backward of that module per step.

Which axis is the batch: the one the engine established for each input and output tensor
of the call by probing the model (:mod:`dpclip.engine.batch_axis`): an LSTM's hidden states
[layers, B, H] have it in axis 1, whatever the sizes; an input shared by every sample is
passed whole to each sample's recomputation; an output shared by every sample (BART's
positional embedding, [1, T, d]) is expanded over the batch, which the probe has proven
its consumers broadcast anyway, so that its output gradient stays per-sample.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Iterator, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from dpclip.engine.batch_axis import BATCH_HINT, Layout, call_leaves, expand_shared
from dpclip.engine.factors import Dense
from dpclip.engine.layers import Capture, LayerRule
from dpclip.engine.layers.packed import packed_call
from dpclip.engine.parametrized import functional_call
from dpclip.engine.precision import autocast_again, autocast_state
from dpclip.errors import EngineError
from dpclip.torch_compat import TorchDispatchMode, tree_flatten, tree_unflatten


class Axis(NamedTuple):
    """Where one sample's part of a tensor is: ``rows`` consecutive entries of axis ``dim``
    from ``i·rows`` on (1: the batch axis; c ≥ 2: the batch merged with c positions, batch
    outer, as MoE routers and experts get [B·T, d]); ``rows`` 0: the sample's tensor has no
    such axis (a shared output expanded over the batch). ``folded``: a shared output expanded
    over B·c rows (Swin's bias over its windows), whose sample is recomputed once: the output
    gradients of its c rows are summed first, then read with ``rows = folded``."""

    dim: int
    rows: int = 1
    folded: int | None = None
    outer: int = 1      # the ``rows`` lie in ``outer`` blocks of B·rows/outer ([E, B, T]: Llama 4's experts)


def _axis(lay: Layout, t: Tensor, batch: int, label: str, what: str) -> Axis | None:
    """The per-sample axis of one tensor of the call (None: shared by every sample)."""
    if lay.error is not None:
        raise EngineError(f"module {label}: the batch axis of its {what} of shape "
                          f"{tuple(t.shape)} cannot be used by the per-sample fallback: {lay.error}",
                          lay.hint)
    if lay.dim is None:
        return None
    if not lay.merged:
        return Axis(lay.dim)
    return Axis(lay.dim, t.shape[lay.dim] // batch, outer=lay.outer)


def _batch_outer(t: Tensor, axis: Axis | None, batch: int) -> tuple[Tensor, Axis | None]:
    """``t`` with the rows of its ``axis`` reordered [outer, B, r] -> [B, outer, r]: each
    sample's rows consecutive, in the order the module reads them when called on it alone."""
    if axis is None or axis.outer == 1:
        return t, axis
    d = axis.dim
    return (t.unflatten(d, (axis.outer, batch, axis.rows // axis.outer)).transpose(d, d + 1).flatten(d, d + 2),
            Axis(d, axis.rows))


class _RandomOpGuard(TorchDispatchMode):
    """Refuses random draws while recomputing a forward that drew none: a dropout mask cannot be
    replayed per sample. An op that only may draw (``aten::gru``, dropout with p = 0, both tagged
    ``nondeterministic_seeded``) passes when the generators did not move."""

    def __init__(self, label: str, devices: list[int] | None = None):
        super().__init__()
        if devices is None:   # every CUDA device this process has used
            devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        self.label, self.devices = label, devices

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **(kwargs or {}))
        before = Draws.states(self.devices)
        out = func(*args, **(kwargs or {}))
        if not all(torch.equal(a, b) for a, b in zip(before, Draws.states(self.devices))):
            raise _randomness_error(self.label)
        return out


def _randomness_error(label: str) -> EngineError:
    return EngineError(
        f"module {label} uses random operations (dropout?) in its forward; the torch.func "
        "fallback recomputes it per sample and cannot replay the same randomness",
        "set its dropout to 0 or put it in eval mode, or move its parameters into a "
        "supported layer")


class Draws:
    """The random draws of one forward call, replayed in each sample's recomputation.

    peft's LoHa and LoKr draw ``torch.rand(1)`` for their module dropout at every training
    forward: one number for the whole batch, so a sample recomputed alone from the same
    generator state draws the same number. The generators' states are kept before and after
    the forward; each recomputation starts from the first and must end at the second, which it
    does only when it drew as many numbers: a draw whose size follows the batch (a dropout mask
    over [B, ...]) ends elsewhere and is refused."""

    def __init__(self, devices: list[int], start: list[Tensor]):
        self.devices, self.start, self.end = devices, start, None

    @staticmethod
    def states(devices: list[int]) -> list[Tensor]:
        return [torch.random.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in devices]

    @classmethod
    def before(cls, params) -> "Draws":
        devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        return cls(devices, cls.states(devices))

    def after(self) -> "Draws | None":
        """Self when the forward drew random numbers, else None."""
        self.end = self.states(self.devices)
        return None if all(torch.equal(a, b) for a, b in zip(self.start, self.end)) else self

    @contextmanager
    def replayed(self, label: str) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.random.set_rng_state(self.start[0])
            for d, state in zip(self.devices, self.start[1:]):
                torch.cuda.set_rng_state(state, d)
            yield
            if not all(torch.equal(a, b) for a, b in zip(self.states(self.devices), self.end)):
                raise _randomness_error(label)


class FunctorchRule(LayerRule):
    """The rule for modules no other rule matches (not in the registry: the book-keeping
    falls back to it). Exact for any module that keeps samples apart; one extra forward
    and backward of the module per step."""

    name = "functorch"
    exact_by_construction = False   # strict mode refuses it (except custom RMSNorms)
    expands_shared_outputs = True   # a shared output is expanded over the batch (probed)

    def check(self, module: nn.Module, label: str) -> None:
        if isinstance(module, nn.RNNBase) and module.dropout > 0 and module.training:
            raise EngineError(f"module {label} uses dropout between layers; the per-sample "
                              "fallback cannot replay it", "set dropout=0 on the RNN")

    def call(self, module: nn.Module, capture: Capture, args: tuple, kwargs: dict):
        layout, batch = capture.layout, capture.batch_size
        _refuse_generation_cache(capture.label, args, kwargs)
        if args and isinstance(args[0], PackedSequence):   # its rows are ragged, time-major
            return packed_call(module, capture, args, kwargs, _RandomOpGuard)
        in_dims = [_axis(capture.layout_of(t), t, batch, capture.label, "input")
                   for t in call_leaves(args, kwargs)]
        detached = {name: p.detach() for name, p in capture.params}
        draws = Draws.before(detached.values())
        with capture.bypass():  # the module's own parameters are constants here: no weight grads
            out = functional_call(module, detached, args, kwargs)
        draws = draws.after()
        leaves, spec = tree_flatten(out)
        tensors = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        outs = layout.outputs
        if outs is not None and len(outs) != len(tensors):
            raise EngineError(f"module {capture.label} returned {len(tensors)} tensors, the probe "
                              f"forwards saw {len(outs)}", BATCH_HINT)
        index, out_dims, shared = [], [], set()
        for q, i in enumerate(tensors):
            t = leaves[i]
            if not t.is_floating_point():
                continue
            axis = _axis(Layout(t.dim(), 0) if outs is None else outs[q], t, batch, capture.label, "output")
            if axis is None:   # shared: expanded over the batch (its consumers broadcast it)
                lead1 = t.dim() >= 1 and t.shape[0] == 1
                c = 1 if outs is None else outs[q].expand_rows   # over B·c rows: sample i's are i·c ...
                leaves[i] = expand_shared(t, lead1, batch * c)
                axis = Axis(0, c, folded=int(lead1)) if c > 1 else Axis(0, int(lead1))
                shared.add(i)
            out_dims.append(axis)
            index.append(i)
        if not index:
            return tree_unflatten(leaves, spec)

        # The per-sample recomputation runs in the backward, outside this autocast region:
        # it re-enters it, so that it differentiates the forward that ran.
        autocast = autocast_state(leaves[index[0]].device.type)

        def on_grads(grads: tuple[Tensor, ...], batch: int) -> dict[str, Dense]:
            return per_sample_grads(capture, args, kwargs, index, grads, batch, autocast,
                                    in_dims, out_dims, draws)

        tapped = capture.tap([leaves[i] for i in index], on_grads)
        for j, i in enumerate(index):
            leaves[i] = tapped[j]
            if i in shared:
                capture.note_expanded(tapped[j])
        return tree_unflatten(leaves, spec)


FUNCTORCH_RULE = FunctorchRule()


def _refuse_generation_cache(label: str, args: tuple, kwargs: dict) -> None:
    """A transformers generation cache passed to the module: its forward appends to it, and the
    per-sample recomputation would append again (to a cache of the whole batch)."""
    for leaf in tree_flatten((args, kwargs))[0]:
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(leaf).__mro__):
            raise EngineError(
                f"module {label} was called with a generation cache ({type(leaf).__name__}); the torch.func "
                "fallback recomputes the module per sample and cannot replay the cache's updates",
                "call the model with use_cache=False when training (or set model.config.use_cache = False); "
                "dpclip train and DPTrainer do")


def is_rmsnorm_like(module: nn.Module) -> bool:
    """Custom RMSNorm classes (Llama, T5, Gemma, ...): handled exactly by the torch.func
    rule; they count as supported (strict mode accepts them) since the weight is small."""
    return (type(module).__name__.endswith("RMSNorm")
            and isinstance(getattr(module, "weight", None), nn.Parameter))


def per_sample_grads(capture: Capture, args: tuple, kwargs: dict, out_index: list[int],
                     grads: tuple[Tensor, ...], batch: int, autocast=None,
                     in_dims: list[Axis | None] | None = None,
                     out_dims: list[Axis] | None = None, draws: "Draws | None" = None) -> dict[str, Dense]:
    """Per-sample gradients ``{param name: Dense([B, *shape])}`` of one call of
    ``capture.module``; ``out_index`` picks the tapped leaves of its output; ``autocast``:
    the forward's :func:`~dpclip.engine.precision.autocast_state`, re-entered to recompute.
    ``in_dims``: the :class:`Axis` of each tensor input (None: shared); ``out_dims``: that of
    each tapped output; by default the batch is in dim 0 of everything. ``draws``: the random
    draws of the forward, replayed in each sample's recomputation (:class:`Draws`)."""
    module = capture.module
    leaves, spec = tree_flatten((args, kwargs))
    tensor_pos = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
    tensors = [leaves[i].detach() for i in tensor_pos]
    in_dims = [Axis(0)] * len(tensors) if in_dims is None else in_dims
    out_dims = [Axis(0)] * len(out_index) if out_dims is None else out_dims
    tensors, in_dims = map(list, zip(*(_batch_outer(t, a, batch) for t, a in zip(tensors, in_dims)))) \
        if tensors else ([], [])
    if grads:
        grads, out_dims = zip(*(_batch_outer(g, a, batch) for g, a in zip(grads, out_dims)))
        grads, out_dims = tuple(grads), list(out_dims)
    if any(a.folded is not None for a in out_dims):   # each sample's c rows summed: one recomputation
        grads = tuple(g.unflatten(a.dim, (batch, a.rows)).sum(a.dim + 1) if a.folded is not None else g
                      for g, a in zip(grads, out_dims))
        out_dims = [Axis(a.dim, a.folded) if a.folded is not None else a for a in out_dims]
    for g, (d, rows, *_) in zip(grads, out_dims):
        if g.dim() <= d or g.shape[d] != batch * max(rows, 1):
            raise EngineError(f"module {capture.label}: an output gradient of shape "
                              f"{tuple(g.shape)} has no batch axis {d} of size {batch}", BATCH_HINT)
    params = {name: p.detach() for name, p in capture.params}

    def run(p, sample_tensors):
        full = list(leaves)
        for pos, t in zip(tensor_pos, sample_tensors):
            full[pos] = t
        call_args, call_kwargs = tree_unflatten(full, spec)
        with capture.plain(), autocast_again(autocast):
            out = functional_call(module, p, call_args, call_kwargs)
        out_leaves = tree_flatten(out)[0]
        return [out_leaves[i] for i in out_index]

    # Whether vmap works, learnt per kind of call: one module may be called in several
    # ways (an RNN cell's first step gets hx=None and builds a zero state, which vmap
    # cannot write into; its later steps get a state). The loop is exact whatever failed.
    kind = tuple((None, type(t).__name__) if not isinstance(t, Tensor) else (t.dim(), t.dtype)
                 for t in leaves) + tuple(in_dims) + tuple(out_dims)
    vmap_ok = capture.memo.setdefault("vmap_ok", {})
    result = None
    if vmap_ok.get(kind) is not False and draws is None:
        try:
            result = _vmapped(run, params, tensors, in_dims, grads, out_dims, batch)
            vmap_ok[kind] = True
        except EngineError:
            raise
        except Exception:  # no batching rule for some op (nn.LSTM), or one vmap takes as random (aten::gru)
            vmap_ok[kind] = False   # the loop refuses what truly draws
    if result is None:
        result = _looped(run, params, tensors, in_dims, grads, out_dims, batch, capture.label, draws)
    return {name: Dense(g) for name, g in result.items()}


def _split(t: Tensor, axis: Axis | None, batch: int) -> Tensor:
    """``t`` with the batch in an axis of its own where it is merged with positions."""
    return t.unflatten(axis.dim, (batch, axis.rows)) if axis is not None and axis.rows > 1 else t


def _vmapped(run, params, tensors, in_dims, grads, out_dims, batch) -> dict[str, Tensor]:
    def one(sample_tensors, sample_grads):
        restored = [t.unsqueeze(a.dim) if a is not None and a.rows == 1 else t
                    for t, a in zip(sample_tensors, in_dims)]

        def f(p):
            return tuple(o.squeeze(a.dim) if a.rows == 1 else o for o, a in zip(run(p, restored), out_dims))

        _, vjp_fn = torch.func.vjp(f, params)
        return vjp_fn(tuple(sample_grads))[0]

    with warnings.catch_warnings():   # ops vmap runs one sample at a time (MoE's grouped_mm): exact, slower
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        return torch.func.vmap(one, in_dims=(tuple(None if a is None else a.dim for a in in_dims),
                                             tuple(a.dim for a in out_dims)), randomness="error")(
            tuple(_split(t, a, batch) for t, a in zip(tensors, in_dims)),
            tuple(_split(g, a, batch) for g, a in zip(grads, out_dims)))


def _looped(run, params, tensors, in_dims, grads, out_dims, batch, label, draws=None) -> dict[str, Tensor]:
    rows: dict[str, list[Tensor]] = {name: [] for name in params}
    devices = sorted({t.device.index or 0 for t in params.values() if t.device.type == "cuda"})
    with torch.enable_grad(), _RandomOpGuard(label, devices) if draws is None else nullcontext():
        for i in range(batch):
            p = {name: t.detach().requires_grad_() for name, t in params.items()}
            sample = [t.narrow(a.dim, i * a.rows, a.rows) if a is not None else t for t, a in zip(tensors, in_dims)]
            if draws is None:
                outs = run(p, sample)
            else:
                with draws.replayed(label):
                    outs = run(p, sample)
            pairs = [(o, g.narrow(a.dim, i * a.rows, a.rows) if a.rows else g.select(a.dim, i))
                     for o, g, a in zip(outs, grads, out_dims) if o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], list(p.values()),
                                      [g for _, g in pairs], allow_unused=True) if pairs else [None] * len(p)
            for (name, t), g in zip(p.items(), got):
                rows[name].append(torch.zeros_like(t) if g is None else g)
    return {name: torch.stack(r) for name, r in rows.items()}
