"""Per-sample gradients of a module called on a ``PackedSequence`` (``nn.LSTM`` / ``nn.GRU`` /
``nn.RNN`` on variable-length sequences, as Opacus' DPLSTM takes them).

A packed batch keeps its rows time-major: step ``t`` holds ``batch_sizes[t]`` rows, one per
sequence still running, in the order of ``sorted_indices`` (longest first). Sample ``i`` sits at
sorted position ``j = unsorted_indices[i]`` and owns row ``offset[t] + j`` of every step
``t`` with ``batch_sizes[t] > j`` (``offset[t]`` = the rows of the steps before). The forward
runs once, as packed; in the backward each sample's rows are packed alone (one sequence,
``batch_sizes`` all 1) and its gradient is that recomputation's vector-Jacobian product with the
output gradients of the same rows (and of its column of the final states ``h_n``, ``c_n``):

    g_i = (∂ f(θ; x_i) / ∂θ)ᵀ b_i          (a loop over samples: the rows are ragged)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from dpclip.engine.factors import Dense
from dpclip.engine.parametrized import functional_call
from dpclip.engine.precision import autocast_again, autocast_state
from dpclip.errors import EngineError
from dpclip.torch_compat import tree_flatten, tree_unflatten


def sample_rows(packed: PackedSequence) -> list[Tensor]:
    """Per sample, in the batch's original order, the indices of its rows in ``packed.data``."""
    sizes = packed.batch_sizes.tolist()
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    count = sizes[0] if sizes else 0
    position = (range(count) if packed.unsorted_indices is None else packed.unsorted_indices.tolist())
    device = packed.data.device
    return [torch.tensor([offsets[t] + j for t, size in enumerate(sizes) if size > j], device=device,
                         dtype=torch.long) for j in position]


def _one(packed: PackedSequence, rows: Tensor) -> PackedSequence:
    data = packed.data.index_select(0, rows)
    return PackedSequence(data, torch.ones(len(rows), dtype=torch.long))


def packed_call(module: nn.Module, capture, args: tuple, kwargs: dict, guard: Callable):
    """The torch.func rule's call when the module's input is a ``PackedSequence`` (its first
    argument; an optional state ``hx`` may follow, batch in axis 1 as RNNs take it)."""
    packed, batch = args[0], capture.batch_size
    rows = sample_rows(packed)
    if len(rows) != batch:
        raise EngineError(f"module {capture.label} got a PackedSequence of {len(rows)} sequences, but the "
                          f"batch has {batch} samples", "pack one sequence per sample")
    detached = {name: p.detach() for name, p in capture.params}
    with capture.bypass():
        out = functional_call(module, detached, args, kwargs)
    leaves, spec = tree_flatten(out)
    # the outputs' float tensors: the packed rows (sample i: rows[i]) and the final states (axis 1)
    index = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]
    data_leaf = next((i for i in index if leaves[i].dim() == 2 and leaves[i].shape[0] == packed.data.shape[0]), None)
    states = [i for i in index if i != data_leaf]
    if data_leaf is None or any(leaves[i].dim() != 3 or leaves[i].shape[1] != batch for i in states):
        raise EngineError(f"module {capture.label}: its outputs on a PackedSequence are not a packed "
                          "sequence and final states [layers, B, H]", "call an nn.LSTM, nn.GRU or nn.RNN on it")
    index = [data_leaf] + states
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    hx_leaves, hx_spec = tree_flatten(hx)
    autocast = autocast_state(packed.data.device.type)   # re-entered to recompute what ran

    def on_grads(grads: tuple[Tensor, ...], n: int) -> dict[str, Dense]:
        per: dict[str, list[Tensor]] = {name: [] for name in detached}
        with torch.enable_grad(), guard(capture.label):
            for i in range(n):
                p = {name: t.detach().requires_grad_() for name, t in detached.items()}
                h_i = tree_unflatten([t.detach().narrow(1, i, 1) if isinstance(t, Tensor) else t
                                      for t in hx_leaves], hx_spec)
                with capture.plain(), autocast_again(autocast):
                    got = tree_flatten(functional_call(module, p, (_one(packed, rows[i]), h_i), {}))[0]
                outs = [got[k] for k in index]
                cotangents = [grads[0].index_select(0, rows[i])] + [g.narrow(1, i, 1) for g in grads[1:]]
                pairs = [(o, g) for o, g in zip(outs, cotangents) if o.requires_grad]
                g = torch.autograd.grad([o for o, _ in pairs], list(p.values()), [c for _, c in pairs],
                                        allow_unused=True)
                for (name, t), gi in zip(p.items(), g):
                    per[name].append(torch.zeros_like(t) if gi is None else gi)
        return {name: Dense(torch.stack(r)) for name, r in per.items()}

    tapped = capture.tap([leaves[i] for i in index], on_grads)
    for j, i in enumerate(index):
        leaves[i] = tapped[j]
    return tree_unflatten(leaves, spec)
