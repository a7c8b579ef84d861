"""``nn.Conv1d`` / ``nn.Conv2d``: im2col, then the Linear rule per conv group (docs/layer-rules.md).

With T = output positions, a convolution is a Linear over unfolded input patches: sample
i's gradient of group j is ``L_{i,j}ᵀ R_{i,j}`` with L the output gradient and R the
unfolded input (groupwise-clipping paper §2.2, eq. (3)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpclip.engine.factors import Bilinear, Dense, Use
from dpclip.engine.layers import (Example, LayerRule, example_tensor, expand_batch,
                                  register_layer_rule, seeded)
from dpclip.engine.precision import autocast_input, widened
from dpclip.torch_compat import conv_pad_widths


def _tuple(v, n):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def unfold(x: Tensor, kernel, dilation, padding, stride) -> Tensor:
    """``F.unfold`` (im2col) as a strided view plus one copy: the same [B, C·kh·kw, P]
    columns, several times faster on CPU for small images (benchmarks/profile_step.py). The view
    keeps ``x``'s storage offset by default (asking for it by ``storage_offset()`` would break a
    torch.compile graph: it returns no tensor)."""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    x = x.contiguous()
    batch, channels, height, width = x.shape
    out_h = (height - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    out_w = (width - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    sb, sc, sh, sw = x.stride()
    view = x.as_strided((batch, channels, kernel[0], kernel[1], out_h, out_w),
                        (sb, sc, dilation[0] * sh, dilation[1] * sw, stride[0] * sh, stride[1] * sw))
    return view.reshape(batch, channels * kernel[0] * kernel[1], out_h * out_w)


class ConvRule(LayerRule):
    name = "conv"

    def prepare(self, m, x, batch_hint):
        """Make padding explicit so unfold sees the same geometry as the convolution."""
        x = autocast_input(expand_batch(x, batch_hint))
        nd = len(m.kernel_size)
        padding = m.padding
        if m.padding_mode != "zeros":
            x = F.pad(x, conv_pad_widths(m), mode=m.padding_mode)
            padding = (0,) * nd
        elif isinstance(padding, str):
            if padding == "valid":
                padding = (0,) * nd
            else:  # "same" with stride 1: total padding dilation·(k−1), extra on the right
                pads = []
                for k, d in zip(reversed(m.kernel_size), reversed(_tuple(m.dilation, nd))):
                    total = d * (k - 1)
                    pads += [total // 2, total - total // 2]
                x = F.pad(x, pads)
                padding = (0,) * nd
        return x, _tuple(padding, nd)

    def forward(self, m, x, padding):
        fn = F.conv1d if len(m.kernel_size) == 1 else F.conv2d
        return fn(x, m.weight, m.bias, m.stride, padding, m.dilation, m.groups)

    def input_grad(self, m, x, gy, padding):
        fn = torch.nn.grad.conv1d_input if len(m.kernel_size) == 1 else torch.nn.grad.conv2d_input
        return fn(x.shape, m.weight.to(gy.dtype), gy, m.stride, padding, m.dilation, m.groups)

    def uses(self, m, x, gy, padding):
        batch, g = x.shape[0], m.groups
        if len(m.kernel_size) == 1:  # unfold is 2-d only: view Conv1d as a 1 x L image
            x4, k, s, p, d = (x.unsqueeze(2), (1,) + tuple(m.kernel_size), (1,) + tuple(m.stride),
                              (0,) + tuple(padding), (1,) + tuple(m.dilation))
        else:
            x4, k, s, p, d = x, m.kernel_size, m.stride, padding, m.dilation
        cols = unfold(x4, k, d, p, s)                                   # [B, C·K, P]
        positions = cols.shape[-1]
        right = cols.view(batch, g, -1, positions).transpose(2, 3)        # [B, g, P, C/g·K]
        gyf = gy.reshape(batch, gy.shape[1], -1)                          # [B, out, P]
        left = gyf.view(batch, g, -1, positions).transpose(2, 3)          # [B, g, P, out/g]
        uses: dict[str, Use] = {"weight": Bilinear(left, right)}
        if m.bias is not None:
            uses["bias"] = Dense(widened(gyf).sum(-1))
        return uses

    def examples(self):
        return [
            Example(seeded(nn.Conv1d(4, 4, 3, stride=2, padding=1, groups=2), 5),
                    (example_tensor(5, 4, 9, seed=5),)),
            Example(seeded(nn.Conv2d(2, 4, 3, padding="same", padding_mode="circular",
                                     bias=False), 6), (example_tensor(5, 2, 5, 4, seed=6),)),
            Example(seeded(nn.Conv2d(4, 2, (2, 3), stride=2, dilation=(1, 2), groups=2), 7),
                    (example_tensor(5, 4, 6, 7, seed=7),)),
        ]


CONV_RULE = ConvRule()
register_layer_rule(nn.Conv1d, CONV_RULE)
register_layer_rule(nn.Conv2d, CONV_RULE)
