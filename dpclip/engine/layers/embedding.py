"""``nn.Embedding``: the one-hot factor is never formed (docs/layer-rules.md).

Sample i's gradient is ``onehot(x_i)ᵀ b_i``: a Bilinear use whose left factor is the
integer ids themselves (``vocab`` set), ghost-normed as Σ_{t,s} 1[x_t = x_s]⟨b_t, b_s⟩.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from dpclip.engine.factors import Bilinear
from dpclip.engine.layers import (Example, LayerRule, example_tensor, expand_batch, flat3,
                                  register_layer_rule, seeded)
from dpclip.errors import EngineError


@register_layer_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    name = "embedding"

    def feature_dims(self, m):   # position-wise over the ids: the batch may sit in any axis
        return 0

    def prepare(self, m, x, batch_hint):
        if m.scale_grad_by_freq:
            raise EngineError(
                "nn.Embedding(scale_grad_by_freq=True) scales gradients by token counts over "
                "the whole batch, which mixes samples", "set scale_grad_by_freq=False")
        return expand_batch(x, batch_hint), None

    def forward(self, m, x, info):
        return F.embedding(x, m.weight, m.padding_idx, m.max_norm, m.norm_type, False, False)

    def input_grad(self, m, x, gy, info):
        return None   # integer ids have no gradient

    def uses(self, m, x, gy, info):
        ids = x.reshape(x.shape[0], -1)
        b = flat3(gy)
        if m.padding_idx is not None:
            # Rows of padding_idx get no gradient (nn.Embedding's contract).
            b = b * (ids != m.padding_idx).unsqueeze(-1).to(b.dtype)
        return {"weight": Bilinear(ids, b.unsqueeze(1), vocab=m.num_embeddings)}

    def examples(self):
        # 6 tokens over 4 positions: repeats within a sample (the Gram's off-diagonal)
        return [Example(seeded(nn.Embedding(6, 3), 3), (example_tensor(5, 4, seed=3, high=6),)),
                Example(seeded(nn.Embedding(6, 3, padding_idx=0), 4),
                        (example_tensor(5, 2, 3, seed=4, high=6),))]
