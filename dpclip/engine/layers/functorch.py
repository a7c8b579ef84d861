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

Which dimension is the batch: dim 0 of every input and output tensor whose dim 0 equals
the number of samples (other tensors are shared by all samples), except for
``nn.RNNBase`` modules, whose convention is known (``batch_first`` for the sequence,
dim 1 for hidden states).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode

from dpclip.engine.factors import Dense
from dpclip.engine.layers import Capture, LayerRule
from dpclip.engine.precision import autocast_again, autocast_state
from dpclip.errors import EngineError


def _input_dims(module: nn.Module, tensors: list[Tensor], batch: int) -> list[int | None]:
    if isinstance(module, nn.RNNBase):
        if tensors and tensors[0].dim() != 3:
            raise EngineError(f"{type(module).__name__} got an unbatched input",
                              "pass a batched [B, T, d] input (batch_first=True)")
        first = 0 if module.batch_first else 1
        return [first] + [1] * (len(tensors) - 1)
    return [0 if t.dim() > 0 and t.shape[0] == batch else None for t in tensors]


def _output_dims(module: nn.Module, positions: list[int], grads, batch: int, label: str) -> list[int]:
    if isinstance(module, nn.RNNBase):
        dims = [(0 if module.batch_first else 1) if pos == 0 else 1 for pos in positions]
    else:
        dims = [0] * len(positions)
    for g, d in zip(grads, dims):
        if g.dim() <= d or g.shape[d] != batch:
            raise EngineError(
                f"module {label} returned a tensor of shape {tuple(g.shape)} with no batch "
                f"dimension of size {batch}; its per-sample gradients cannot be separated",
                "return per-sample outputs with the batch in dim 0")
    return dims


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

    def check(self, module: nn.Module, label: str) -> None:
        if isinstance(module, nn.RNNBase) and module.dropout > 0 and module.training:
            raise EngineError(f"module {label} uses dropout between layers; the per-sample "
                              "fallback cannot replay it", "set dropout=0 on the RNN")

    def call(self, module: nn.Module, capture: Capture, args: tuple, kwargs: dict):
        detached = {name: p.detach() for name, p in capture.params}
        with capture.bypass():  # the module's own parameters are constants here: no weight grads
            out = torch.func.functional_call(module, detached, args, kwargs)
        leaves, spec = tree_flatten(out)
        index = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]
        if not index:
            return out

        # The per-sample recomputation runs in the backward, outside this autocast region:
        # it re-enters it, so that it differentiates the forward that ran.
        autocast = autocast_state(leaves[index[0]].device.type)

        def on_grads(grads: tuple[Tensor, ...], batch: int) -> dict[str, Dense]:
            return per_sample_grads(capture, args, kwargs, index, grads, batch, autocast)

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
                     grads: tuple[Tensor, ...], batch: int, autocast=None) -> dict[str, Dense]:
    """Per-sample gradients ``{param name: Dense([B, *shape])}`` of one call of
    ``capture.module``; ``out_index`` picks the tapped leaves of its output; ``autocast``:
    the forward's :func:`~dpclip.engine.precision.autocast_state`, re-entered to recompute."""
    module = capture.module
    leaves, spec = tree_flatten((args, kwargs))
    tensor_pos = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
    tensors = [leaves[i].detach() for i in tensor_pos]
    in_dims = _input_dims(module, tensors, batch)
    out_dims = _output_dims(module, out_index, grads, batch, capture.label)
    params = {name: p.detach() for name, p in capture.params}

    def run(p, sample_tensors):
        full = list(leaves)
        for pos, t in zip(tensor_pos, sample_tensors):
            full[pos] = t
        call_args, call_kwargs = tree_unflatten(full, spec)
        with capture.plain(), autocast_again(autocast):
            out = torch.func.functional_call(module, p, call_args, call_kwargs)
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
            return tuple(o.squeeze(d) for o, d in zip(run(p, restored), out_dims))

        _, vjp_fn = torch.func.vjp(f, params)
        return vjp_fn(tuple(sample_grads))[0]

    return torch.func.vmap(one, in_dims=(tuple(in_dims), tuple(out_dims)), randomness="error")(
        tuple(tensors), tuple(grads))


def _looped(run, params, tensors, in_dims, grads, out_dims, batch, label) -> dict[str, Tensor]:
    rows: dict[str, list[Tensor]] = {name: [] for name in params}
    with torch.enable_grad(), _RandomOpGuard(label):
        for i in range(batch):
            p = {name: t.detach().requires_grad_() for name, t in params.items()}
            sample = [t.narrow(d, i, 1) if d is not None else t for t, d in zip(tensors, in_dims)]
            outs = run(p, sample)
            pairs = [(o, g.narrow(d, i, 1)) for o, g, d in zip(outs, grads, out_dims) if o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], list(p.values()),
                                      [g for _, g in pairs], allow_unused=True) if pairs else [None] * len(p)
            for (name, t), g in zip(p.items(), got):
                rows[name].append(torch.zeros_like(t) if g is None else g)
    return {name: torch.stack(r) for name, r in rows.items()}
