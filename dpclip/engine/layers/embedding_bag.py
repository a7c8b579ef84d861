"""``nn.EmbeddingBag``: bag i is sample i; the one-hot factor is never formed (docs/layer-rules.md).

The bags are laid out as a padded [B, L] matrix of ids (a 2-D input as it is; a 1-D input
cut at its ``offsets``). With ``w_il`` the weight of entry l of bag i (0 for padding
slots and ``padding_idx``; the per-sample weight in mode sum, 1/(bag's non-padding count)
in mode mean), bag i's output is ``y_i = Σ_l w_il E[id_il]`` and its weight gradient

    G_i = Σ_l onehot(id_il)ᵀ (w_il b_i)              (b_i = dL/dy_i)

a Bilinear use with the ids as left factor, like :mod:`~dpclip.engine.layers.embedding`.
In mode max, channel c of y_i is ``E[r_ic, c]`` with ``r_ic`` the arg-max row torch's own
forward reports; the gradient of row r_ic in column c is ``b_ic``: the ids are ``r_i``
(one "position" per channel) and the right factor is ``diag(b_i)`` (empty bags give
nothing). Trainable per-sample weights (mode sum) get ``dL/dw_il = <E[id_il], b_i>``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpclip.engine.factors import Bilinear
from dpclip.engine.layers import (Capture, Example, LayerRule, example_tensor,
                                  register_layer_rule, seeded)
from dpclip.errors import EngineError

_MODES = {"sum": 0, "mean": 1, "max": 2}


def _arguments(input, offsets=None, per_sample_weights=None):
    """nn.EmbeddingBag.forward's signature."""
    return input, offsets, per_sample_weights


def _flat(m: nn.EmbeddingBag, label: str, ids: Tensor, offsets, weights):
    """(ids [N], bag starts [B], end of the last bag, per-sample weights [N] or None)."""
    if ids.is_nested:
        raise EngineError(f"module {label} got a nested-tensor input", "pass a 1-D input with "
                          "offsets, or a 2-D input of equal-length bags")
    if ids.dim() == 2:
        if offsets is not None:
            raise EngineError(f"module {label} got a 2-D input and offsets",
                              "a 2-D input is a batch of equal-length bags: pass offsets=None")
        starts = torch.arange(0, ids.numel(), ids.shape[1], device=ids.device)
        end = ids.numel()
        return ids.reshape(-1), starts, end, None if weights is None else weights.reshape(-1)
    if ids.dim() != 1 or offsets is None or offsets.dim() != 1:
        raise EngineError(f"module {label} got an input of shape {tuple(ids.shape)} with offsets "
                          f"{None if offsets is None else tuple(offsets.shape)}",
                          "pass a 1-D input with 1-D offsets, or a 2-D input")
    offsets = offsets.long()
    starts, end = (offsets[:-1], offsets[-1]) if m.include_last_offset else (offsets, ids.numel())
    if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets.diff() < 0).any())
                            or int(offsets[-1]) > ids.numel()):
        raise EngineError(f"module {label} got offsets that do not cut its input into bags",
                          "offsets must start at 0, never decrease and stay within the input")
    return ids, starts, int(end), weights


class _Bags:
    """The padded layout of one call: ids and validity [B, L], and how to gather [N] -> [B, L]."""

    def __init__(self, m: nn.EmbeddingBag, ids: Tensor, starts: Tensor, end: int):
        batch = starts.numel()
        ends = torch.cat([starts[1:], starts.new_tensor([end])]) if batch else starts
        lengths = (ends - starts).clamp(min=0)
        # at least one slot: a batch of empty bags has gradient zero, not an empty factor
        width = max(int(lengths.max()) if batch else 0, 1)
        pos = torch.arange(width, device=ids.device)
        self.index = (starts[:, None] + pos).clamp(max=max(ids.numel() - 1, 0))   # [B, L]
        self.valid = pos < lengths[:, None]                                        # [B, L]
        self.ids = (torch.where(self.valid, ids[self.index], 0) if ids.numel()
                    else torch.zeros_like(self.index))
        if m.padding_idx is not None:
            self.valid = self.valid & (self.ids != m.padding_idx)

    def gather(self, values: Tensor) -> Tensor:
        if not values.numel():  # every bag empty: nothing to gather (and nothing to index)
            return values.new_zeros(self.index.shape)
        return values[self.index] * self.valid.to(values.dtype)


@register_layer_rule(nn.EmbeddingBag)
class EmbeddingBagRule(LayerRule):
    name = "embedding_bag"

    def check(self, module: nn.Module, label: str) -> None:
        if module.scale_grad_by_freq:
            raise EngineError(f"module {label} scales gradients by token counts over the whole "
                              "batch, which mixes samples", "set scale_grad_by_freq=False")

    def ragged_inputs(self, m, leaves):
        """A 1-D input (and its per-sample weights) is the bags concatenated: the offsets,
        whose axis is established, say where each sample's bag starts."""
        if leaves and leaves[0].dim() == 1:
            # with include_last_offset the offsets hold B + 1 entries: no axis of size B
            offsets = {1} if m.include_last_offset else set()
            return frozenset({0} | offsets | ({2} if len(leaves) > 2 else set()))
        return frozenset()

    def call(self, m, capture: Capture, args: tuple, kwargs: dict):
        ids, offsets, weights = _arguments(*args, **kwargs)
        # bag i is sample i: the bags' own axis (a 2-D input's dim 0, or the offsets') must be
        # the batch axis the probe established, not one whose size happens to be B
        # (offsets with include_last_offset, B + 1 entries, are checked by their count alone)
        per_bag = ids if ids.dim() != 1 or offsets is None else offsets
        lay = capture.layout_of(per_bag) if per_bag is ids or not m.include_last_offset else None
        if lay is not None and (lay.dim != 0 or lay.merged):
            raise EngineError(f"module {capture.label} got bags along an axis that is not the batch "
                              f"({'shared by all samples' if lay.dim is None else f'axis {lay.dim}'})",
                              "give it one bag per sample: a [B, L] input, or offsets of length B")
        ids, starts, end, weights = _flat(m, capture.label, ids, offsets, weights)
        if weights is not None and m.mode != "sum":
            raise EngineError(f"module {capture.label} got per_sample_weights in mode {m.mode}",
                              "per_sample_weights need mode='sum' (as in torch)")
        bags = _Bags(m, ids, starts, end)
        native = (ids, torch.cat([starts, starts.new_tensor([end])]), weights)
        info = {"bags": bags, "native": native}
        if m.mode == "max":
            x = bags.ids                       # no gradient: the arg-max rows come from the forward
        elif m.mode == "mean":
            counts = bags.valid.sum(1, keepdim=True).clamp(min=1)
            x = bags.valid.to(m.weight.dtype) / counts
        else:
            x = bags.valid.to(m.weight.dtype) if weights is None else bags.gather(weights)
        return capture.op(self, x, info)

    def forward(self, m, x, info):
        ids, offsets, weights = info["native"]
        # the bags' ends made explicit (include_last_offset=True): the same bags as torch's call
        out, _, bag_size, max_rows = torch.embedding_bag(
            m.weight, ids, offsets, False, _MODES[m.mode], False, weights, True, m.padding_idx)
        if m.mode == "max":
            info["max_rows"] = torch.where(bag_size[:, None] > 0, max_rows, -1)
        return out

    def input_grad(self, m, x, gy, info):
        if m.mode != "sum":
            return None
        rows = F.embedding(info["bags"].ids, m.weight.to(gy.dtype))          # [B, L, d]
        return (rows * gy[:, None, :]).sum(-1) * info["bags"].valid.to(gy.dtype)

    def uses(self, m, x, gy, info):
        if m.mode == "max":
            rows = info.pop("max_rows")                                       # [B, d], -1: empty
            right = torch.diag_embed(gy * (rows >= 0).to(gy.dtype))           # [B, d, d]
            return {"weight": Bilinear(rows.clamp(min=0), right.unsqueeze(1),
                                       vocab=m.num_embeddings)}
        right = x.to(gy.dtype)[:, :, None] * gy[:, None, :]                  # [B, L, d]
        return {"weight": Bilinear(info["bags"].ids, right.unsqueeze(1), vocab=m.num_embeddings)}

    def examples(self):
        # Bags as [B, L] ids with a length per sample: run() cuts them into a 1-D input with
        # offsets, so that sample i is bag i and the contract tests can slice samples.
        def as_offsets(module, ids, lengths, weights=None):
            keep = torch.arange(ids.shape[1]) < lengths[:, None]
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            if not module.include_last_offset:
                offsets = offsets[:-1]
            return module(ids[keep], offsets, None if weights is None else weights[keep])

        lengths = torch.tensor([3, 0, 4, 1, 2])     # an empty bag among them
        ids = example_tensor(5, 4, seed=30, high=6)
        ids[0, 1] = ids[0, 0]                        # a repeated id inside one bag
        return [
            Example(seeded(nn.EmbeddingBag(6, 3, mode="sum"), 30), (ids,)),
            Example(seeded(nn.EmbeddingBag(6, 3, mode="mean", padding_idx=0), 31),
                    (ids, lengths), as_offsets),
            Example(seeded(nn.EmbeddingBag(6, 3, mode="max", include_last_offset=True), 32),
                    (ids, lengths), as_offsets),
            Example(seeded(nn.EmbeddingBag(6, 3, mode="sum", padding_idx=2), 33),
                    (ids, lengths, example_tensor(5, 4, seed=33)), as_offsets),
        ]
