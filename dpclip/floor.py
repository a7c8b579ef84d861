"""The floor: the fewest extra flops an exact per-sample norm and clipped sum add to a step.

Per parameter, the cheaper of two exact ways (Bu et al. 2023, "Differentially private
optimization on large model at small cost", Table 2; docs/performance.md, "The floor"):
ghost norms from two T x T Grams (symmetric: the T(T+1)/2 entries on and above each
diagonal), or the per-sample gradient instantiated, which replaces the weight gradient and
adds 4·B·m·n for its norm and the clipped sum. One flop is one addition or one
multiplication. The noise (one Gaussian per parameter) is not a flop count: what it costs
is measured where the floor is compared with a step (``dpclip bench``,
benchmarks/floor_gap.py).

:func:`walk` records each parameter's calls (Linear, transformers' Conv1D, Conv2d without
groups, Embedding, LayerNorm, GroupNorm); :func:`step_floor` adds the non-private step's
flops as torch's ``FlopCounterMode`` counts them (matmuls, convolutions, attention) and
gives the floor ratio of a model on a batch. benchmarks/floor.py builds the GPT-2 tables and
the memory-aware floor on these counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

MODELLED = ("Linear", "Conv1D", "Conv2d", "Embedding", "LayerNorm", "GroupNorm")


# ------------------------------------------------------------------ counts of one use


def gram_flops(batch: int, seq: int, width: int, gram: str) -> int:
    """Flops of B Grams X Xᵀ of X: T x width (symmetric: the T(T+1)/2 upper entries)."""
    return batch * seq * (seq + 1) * width if gram == "symmetric" else 2 * batch * seq * seq * width


def gram_dot_flops(batch: int, seq: int, gram: str) -> int:
    """Flops of B inner products <A, C> of two T x T Grams (symmetric: upper entries)."""
    return batch * seq * (seq + 1) if gram == "symmetric" else 2 * batch * seq * seq


def dense_ghost(batch: int, seq: int, m: int, n: int, gram: str) -> int:
    """Ghost norm of a dense use, plus scaling its thinner factor by c_i."""
    return (gram_flops(batch, seq, m, gram) + gram_flops(batch, seq, n, gram)
            + gram_dot_flops(batch, seq, gram) + batch * seq * min(m, n))


def dense_instantiate(batch: int, m: int, n: int) -> int:
    """||G_i||² and Σ_i c_i G_i; forming G_i replaces the weight gradient."""
    return 4 * batch * m * n


def ids_ghost(batch: int, seq: int, width: int, gram: str) -> int:
    """Ghost norm of an embedding use (id-equality Gram: no flops), plus scaling."""
    masked_sum = batch * seq * (seq + 1) // 2 if gram == "symmetric" else batch * seq * seq
    return gram_flops(batch, seq, width, gram) + masked_sum + batch * seq * width


def ids_instantiate(batch: int, seq: int, vocab: int, width: int) -> int:
    """Norm and clipped sum of G_i's at most min(T, V) non-zero rows."""
    return 4 * batch * min(seq, vocab) * width


# ------------------------------------------------------------------ a model's layers


@dataclass
class Call:
    """One call of a parameterized op: ``kind`` dense (a p x d weight: m, n), ids (an
    embedding V x d: m = V, n = d) or vector (n entries); ``seq`` tokens per sample."""

    kind: str
    m: int
    n: int
    seq: int
    input_grad: bool = True
    out: int = 0  # width of a dense call's output gradient (m for nn.Linear, n for Conv1D)
    source: int = field(default=0, compare=False)  # which input tensor a dense call read (0: unknown)


@dataclass
class Param:
    name: str
    module: str
    numel: int
    calls: list[Call] = field(default_factory=list)


def walk(model: nn.Module, inputs: dict, batch: int, run: Callable[[], object] | None = None) -> list[Param]:
    """Run ``model(**inputs)`` (meta tensors are enough; or ``run()``) with hooks on its
    :data:`MODELLED` modules, and return each parameter with its calls' shapes. A tensor
    shared by several modules (tied weights) is one Param with several calls. A Conv2d is
    a dense use over its output positions (m = out channels, n = in channels x kernel);
    a grouped one is left out."""
    by_tensor: dict[int, Param] = {}
    order: list[Param] = []
    held: list = []

    def param(module_name: str, attr: str, tensor: torch.Tensor) -> Param:
        if id(tensor) not in by_tensor:
            by_tensor[id(tensor)] = Param(f"{module_name}.{attr}", module_name, tensor.numel())
            order.append(by_tensor[id(tensor)])
        return by_tensor[id(tensor)]

    def hook_for(name: str, module: nn.Module):
        kind = type(module).__name__

        def hook(mod, args, out):
            x = args[0]
            if kind == "Embedding":
                # a broadcast input (GPT-2's position ids, [1, T]) still serves every sample
                seq = x.numel() // x.shape[0]
                param(name, "weight", mod.weight).calls.append(Call("ids", *mod.weight.shape, seq))
                return
            if kind == "Conv2d":
                if mod.groups != 1:
                    return
                out_c, n = mod.weight.shape[0], mod.weight[0].numel()
                seq = out[0].numel() // out_c if batch == out.shape[0] else out.numel() // out_c // batch
                param(name, "weight", mod.weight).calls.append(Call("dense", out_c, n, seq, x.requires_grad, out_c))
                if mod.bias is not None:
                    param(name, "bias", mod.bias).calls.append(Call("vector", 1, out_c, seq))
                return
            if kind == "GroupNorm":
                seq = x[0].numel() // x.shape[1] if x.shape[0] == batch else 1
                for attr in ("weight", "bias"):
                    if getattr(mod, attr, None) is not None:
                        param(name, attr, getattr(mod, attr)).calls.append(Call("vector", 1, x.shape[1], seq))
                return
            width = x.shape[-1]
            seq = x.numel() // width // batch
            if kind == "LayerNorm":
                for attr in ("weight", "bias"):
                    if getattr(mod, attr, None) is not None:
                        param(name, attr, getattr(mod, attr)).calls.append(Call("vector", 1, width, seq))
                return
            m, n = mod.weight.shape
            held.append(x)   # alive to the end of the walk: its id names it
            param(name, "weight", mod.weight).calls.append(
                Call("dense", m, n, seq, x.requires_grad, out.shape[-1], source=id(x)))
            if mod.bias is not None:
                param(name, "bias", mod.bias).calls.append(Call("vector", 1, mod.bias.numel(), seq))
        return hook

    handles = [module.register_forward_hook(hook_for(name, module))
               for name, module in model.named_modules()
               if type(module).__name__ in MODELLED]
    try:
        run() if run is not None else model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return order


# ------------------------------------------------------------------ one parameter


def param_costs(p: Param, batch: int, gram: str) -> dict:
    """Non-private forward and backward flops of ``p``'s calls, and the extra flops of each
    way to get its exact per-sample norm and clipped sum; ``floor`` is the cheapest."""
    dense = [c for c in p.calls if c.kind == "dense"]
    ids = [c for c in p.calls if c.kind == "ids"]
    vectors = [c for c in p.calls if c.kind == "vector"]
    fwd = bwd = 0
    for c in dense:
        fwd += 2 * batch * c.seq * c.m * c.n
        bwd += (4 if c.input_grad else 2) * batch * c.seq * c.m * c.n
    for c in ids:
        bwd += batch * c.seq * c.n
    for c in vectors:
        fwd += batch * c.seq * c.n
        bwd += 2 * batch * c.seq * c.n
    if vectors:
        options = {"per-sample sum": 4 * batch * vectors[0].n}
    elif dense and ids:  # tied: one parameter, one norm, a cross term
        t_h, t_e = sum(c.seq for c in dense), sum(c.seq for c in ids)
        m, n = dense[0].m, dense[0].n
        vocab, width = ids[0].m, ids[0].n
        rows = min(t_e, vocab)
        h_ghost = dense_ghost(batch, t_h, m, n, gram)
        options = {
            "instantiate": dense_instantiate(batch, m, n),
            "ghost": (h_ghost + ids_ghost(batch, t_e, width, gram)
                      + 2 * batch * t_h * t_e * width + 2 * batch * t_h * t_e),
            "mixed": (h_ghost + ids_instantiate(batch, t_e, vocab, width)
                      + 2 * batch * rows * t_h * width + 2 * batch * rows * width),
        }
    elif dense:  # calls of one weight concatenate along T
        seq, m, n = sum(c.seq for c in dense), dense[0].m, dense[0].n
        options = {"ghost": dense_ghost(batch, seq, m, n, gram),
                   "instantiate": dense_instantiate(batch, m, n)}
    else:
        seq, vocab, width = sum(c.seq for c in ids), ids[0].m, ids[0].n
        options = {"ghost": ids_ghost(batch, seq, width, gram),
                   "instantiate": ids_instantiate(batch, seq, vocab, width)}
    choice = min(options, key=options.get)
    return {"forward": fwd, "backward": bwd, "options": options, "choice": choice,
            "floor": options[choice]}


def shared_input_saving(params: list[Param], batch: int, gram: str = "symmetric") -> int:
    """Flops the floor need not count twice: weights whose single dense call reads the same
    input tensor as an earlier one (Llama's q, k, v; gate, up) need that input's Gram once
    (the engine's :class:`~dpclip.engine.grams.GramCache`). Each later sharer is counted
    at min(ghost without the input Gram, instantiate): a lower bound, whichever the first
    one picks."""
    seen: set[int] = set()
    saving = 0
    for p in params:
        if len(p.calls) != 1 or p.calls[0].kind != "dense" or not p.calls[0].source:
            continue
        call = p.calls[0]
        if call.source not in seen:
            seen.add(call.source)
            continue
        options = param_costs(p, batch, gram)["options"]
        width = call.n if call.out == call.m else call.m
        cheaper = min(options["ghost"] - gram_flops(batch, call.seq, width, gram), options["instantiate"])
        saving += min(options.values()) - min(cheaper, min(options.values()))
    return saving


def step_floor(model: nn.Module, step: Callable[[], None], forward: Callable[[], object], batch: int) -> dict:
    """The flop floor of one training step of ``model``: ``step`` runs the non-private
    forward and backward once under ``FlopCounterMode`` (its matmul, convolution and
    attention flops: the non-private count), ``forward`` runs the model once for
    :func:`walk`. Trainable parameters no rule here models (``unmodelled``) are taken at no
    extra cost, so the ratio stays a lower bound."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    nonprivate = counter.get_total_flops()
    with torch.no_grad():
        params = walk(model, {}, batch, run=forward)
    seen = {p.name for p in params}
    named = {id(t): f"{mod}.{attr}".lstrip(".") for mod, m in model.named_modules()
             for attr, t in m.named_parameters(recurse=False)}
    modelled_ids = set()
    for mod, m in model.named_modules():
        for attr, t in m.named_parameters(recurse=False):
            if f"{mod}.{attr}" in seen:
                modelled_ids.add(id(t))
    unmodelled = sorted({named[id(t)] for t in model.parameters()
                         if t.requires_grad and id(t) not in modelled_ids})
    extra = sum(param_costs(p, batch, "symmetric")["floor"] for p in params) - shared_input_saving(params, batch)
    return {"nonprivate_flops": nonprivate, "extra_flops": extra,
            "ratio": (nonprivate + extra) / nonprivate if nonprivate else None,
            "parameters": sum(t.numel() for t in model.parameters() if t.requires_grad),
            "unmodelled": unmodelled}
