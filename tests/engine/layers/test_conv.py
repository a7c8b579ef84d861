"""The convolution rule (dpclip/engine/layers/conv.py): im2col and geometry."""

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from dpclip.engine.layers.conv import unfold
from tests.engine.conftest import DTYPE, check_exact, classify_loss


class _ConvNet(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv, self.head = conv, nn.Linear(conv.out_channels, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(2).mean(-1))


@settings(max_examples=8, deadline=None)
@given(dim=st.sampled_from([1, 2]), k=st.integers(1, 3), stride=st.integers(1, 2),
       padding=st.integers(0, 2), dilation=st.integers(1, 2), groups=st.sampled_from([1, 2]),
       method=st.sampled_from(["auto", "ghost", "instantiate"]))
def test_conv_geometry_matches_per_example_loop(dim, k, stride, padding, dilation, groups, method):
    cls = nn.Conv1d if dim == 1 else nn.Conv2d
    size = (9,) if dim == 1 else (7, 6)
    conv = cls(2 * groups, 2 * groups, k, stride=stride, padding=padding, dilation=dilation,
               groups=groups)
    gen = torch.Generator().manual_seed(k + 10 * stride)
    batch = {"x": torch.randn(3, 2 * groups, *size, generator=gen, dtype=DTYPE),
             "y": torch.randint(0, 3, (3,), generator=gen)}
    check_exact(lambda: _ConvNet(conv).to(DTYPE), classify_loss, batch, "all-layer",
                norm_method=method)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), c=st.integers(1, 3), h=st.integers(1, 9), w=st.integers(1, 9),
       kh=st.integers(1, 3), kw=st.integers(1, 3), dh=st.integers(1, 2), dw=st.integers(1, 2),
       ph=st.integers(0, 2), pw=st.integers(0, 2), sh=st.integers(1, 3), sw=st.integers(1, 3))
def test_strided_im2col_equals_torchunfold(b, c, h, w, kh, kw, dh, dw, ph, pw, sh, sw):
    if h + 2 * ph < dh * (kh - 1) + 1 or w + 2 * pw < dw * (kw - 1) + 1:
        return  # kernel larger than the padded image: no output positions
    x = torch.randn(b, c, h, w, dtype=DTYPE)
    expected = torch.nn.functional.unfold(x, (kh, kw), dilation=(dh, dw), padding=(ph, pw),
                                          stride=(sh, sw))
    assert torch.equal(unfold(x, (kh, kw), (dh, dw), (ph, pw), (sh, sw)), expected)
