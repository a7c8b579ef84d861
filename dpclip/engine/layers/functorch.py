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

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode

from dpclip.engine.batch_axis import BATCH_HINT, Layout, call_leaves, expand_shared
from dpclip.engine.factors import Dense
from dpclip.engine.layers import Capture, LayerRule
from dpclip.engine.parametrized import functional_call
from dpclip.engine.precision import autocast_again, autocast_state
from dpclip.errors import EngineError


def _usable(lay: Layout, t: Tensor, label: str, what: str) -> Layout:
    if lay.error is not None or lay.merged:
        why = lay.error or f"axis {lay.dim} holds the batch merged with other positions"
        raise EngineError(f"module {label}: the batch axis of its {what} of shape "
                          f"{tuple(t.shape)} cannot be used by the per-sample fallback: {why}",
                          BATCH_HINT)
    return lay


class _RandomOpGuard(TorchDispatchMode):
    """Refuses random ops while recomputing: a dropout mask cannot be replayed per sample."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise _randomness_error(self.label)
        return func(*args, **(kwargs or {}))


def _randomness_error(label: str) -> EngineError:
    return EngineError(
        f"module {label} uses random operations (dropout?) in its forward; the torch.func "
        "fallback recomputes it per sample and cannot replay the same randomness",
        "set its dropout to 0 or put it in eval mode, or move its parameters into a "
        "supported layer")


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
        in_dims = [_usable(capture.layout_of(t), t, capture.label, "input").dim
                   for t in call_leaves(args, kwargs)]
        detached = {name: p.detach() for name, p in capture.params}
        with capture.bypass():  # the module's own parameters are constants here: no weight grads
            out = functional_call(module, detached, args, kwargs)
        leaves, spec = tree_flatten(out)
        tensors = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        outs = layout.outputs
        if outs is not None and len(outs) != len(tensors):
            raise EngineError(f"module {capture.label} returned {len(tensors)} tensors, the probe "
                              f"forwards saw {len(outs)}", BATCH_HINT)
        index, out_dims = [], []    # out_dims: (batch axis, squeezed per sample)
        for q, i in enumerate(tensors):
            t = leaves[i]
            if not t.is_floating_point():
                continue
            lay = _usable(Layout(t.dim(), 0) if outs is None else outs[q], t, capture.label, "output")
            if lay.dim is None:   # shared: expanded over the batch (its consumers broadcast it)
                lead1 = t.dim() >= 1 and t.shape[0] == 1
                leaves[i] = expand_shared(t, lead1, batch)
                out_dims.append((0, lead1))
            else:
                out_dims.append((lay.dim, True))
            index.append(i)
        if not index:
            return tree_unflatten(leaves, spec)

        # The per-sample recomputation runs in the backward, outside this autocast region:
        # it re-enters it, so that it differentiates the forward that ran.
        autocast = autocast_state(leaves[index[0]].device.type)

        def on_grads(grads: tuple[Tensor, ...], batch: int) -> dict[str, Dense]:
            return per_sample_grads(capture, args, kwargs, index, grads, batch, autocast,
                                    in_dims, out_dims)

        tapped = capture.tap([leaves[i] for i in index], on_grads)
        for j, i in enumerate(index):
            leaves[i] = tapped[j]
        return tree_unflatten(leaves, spec)


FUNCTORCH_RULE = FunctorchRule()


def is_rmsnorm_like(module: nn.Module) -> bool:
    """Custom RMSNorm classes (Llama, T5, Gemma, ...): handled exactly by the torch.func
    rule; they count as supported (strict mode accepts them) since the weight is small."""
    return (type(module).__name__.endswith("RMSNorm")
            and isinstance(getattr(module, "weight", None), nn.Parameter))


def per_sample_grads(capture: Capture, args: tuple, kwargs: dict, out_index: list[int],
                     grads: tuple[Tensor, ...], batch: int, autocast=None,
                     in_dims: list[int | None] | None = None,
                     out_dims: list[tuple[int, bool]] | None = None) -> dict[str, Dense]:
    """Per-sample gradients ``{param name: Dense([B, *shape])}`` of one call of
    ``capture.module``; ``out_index`` picks the tapped leaves of its output; ``autocast``:
    the forward's :func:`~dpclip.engine.precision.autocast_state`, re-entered to recompute.
    ``in_dims``: the batch axis of each tensor input (None: shared); ``out_dims``: per tapped
    output, its batch axis and whether a sample's recomputed output keeps it (size 1); by
    default the batch is in dim 0 of everything."""
    module = capture.module
    leaves, spec = tree_flatten((args, kwargs))
    tensor_pos = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
    tensors = [leaves[i].detach() for i in tensor_pos]
    in_dims = [0] * len(tensors) if in_dims is None else in_dims
    out_dims = [(0, True)] * len(out_index) if out_dims is None else out_dims
    for g, (d, _) in zip(grads, out_dims):
        if g.dim() <= d or g.shape[d] != batch:
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
    if vmap_ok.get(kind) is not False:
        try:
            result = _vmapped(run, params, tensors, in_dims, grads, out_dims)
            vmap_ok[kind] = True
        except EngineError:
            raise
        except Exception as exc:  # no batching rule for some op (e.g. nn.LSTM)
            if "random" in str(exc).lower():
                raise _randomness_error(capture.label) from exc
            vmap_ok[kind] = False
    if result is None:
        result = _looped(run, params, tensors, in_dims, grads, out_dims, batch, capture.label)
    return {name: Dense(g) for name, g in result.items()}


def _vmapped(run, params, tensors, in_dims, grads, out_dims) -> dict[str, Tensor]:
    def one(sample_tensors, sample_grads):
        restored = [t.unsqueeze(d) if d is not None else t for t, d in zip(sample_tensors, in_dims)]

        def f(p):
            return tuple(o.squeeze(d) if keeps else o
                         for o, (d, keeps) in zip(run(p, restored), out_dims))

        _, vjp_fn = torch.func.vjp(f, params)
        return vjp_fn(tuple(sample_grads))[0]

    return torch.func.vmap(one, in_dims=(tuple(in_dims), tuple(d for d, _ in out_dims)),
                           randomness="error")(tuple(tensors), tuple(grads))


def _looped(run, params, tensors, in_dims, grads, out_dims, batch, label) -> dict[str, Tensor]:
    rows: dict[str, list[Tensor]] = {name: [] for name in params}
    with torch.enable_grad(), _RandomOpGuard(label):
        for i in range(batch):
            p = {name: t.detach().requires_grad_() for name, t in params.items()}
            sample = [t.narrow(d, i, 1) if d is not None else t for t, d in zip(tensors, in_dims)]
            outs = run(p, sample)
            pairs = [(o, g.narrow(d, i, 1) if keeps else g.select(d, i))
                     for o, g, (d, keeps) in zip(outs, grads, out_dims) if o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], list(p.values()),
                                      [g for _, g in pairs], allow_unused=True) if pairs else [None] * len(p)
            for (name, t), g in zip(p.items(), got):
                rows[name].append(torch.zeros_like(t) if g is None else g)
    return {name: torch.stack(r) for name, r in rows.items()}
