"""dpclip/floor.py: the flop floor of a step, as ``dpclip bench`` counts it."""

import torch
from torch import nn

from dpclip.floor import Call, param_costs, step_floor, walk


def _step_floor(model, x, batch):
    loss = lambda: model(x).pow(2).sum(-1)  # noqa: E731  per-sample losses
    return step_floor(model, lambda: loss().mean().backward(), loss, batch)


def test_two_linear_layers_floor_matches_the_hand_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b = 5
    found = _step_floor(model, torch.randn(b, 3), b)
    # non-private, matmuls only: forward 2·B·(4·3 + 2·4) = 200; backward the weight
    # gradients 200 and the second layer's input gradient 2·B·2·4 = 80 (x needs none): 480
    assert found["nonprivate_flops"] == 480
    # extra at T 1, the cheaper per weight (ghost: Grams B·T(T+1)·(m+n) + B·T(T+1) + B·T·min(m, n);
    # instantiate: 4·B·m·n); biases 4·B·n:
    #   4x3: ghost 10·7 + 10 + 15 = 95, instantiate 240 -> 95;  bias 4·5·4 = 80
    #   2x4: ghost 10·6 + 10 + 10 = 80, instantiate 160 -> 80;  bias 4·5·2 = 40
    assert found["extra_flops"] == 95 + 80 + 80 + 40
    assert found["ratio"] == (480 + 295) / 480
    assert found["unmodelled"] == [] and found["parameters"] == 12 + 4 + 8 + 2


def test_a_parameter_no_rule_models_is_named_and_costs_nothing():
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2))
    found = _step_floor(model, torch.randn(5, 3), 5)
    assert found["unmodelled"] == ["1.weight"]
    assert found["extra_flops"] == 95 + 80 + 80 + 40        # the same as without the PReLU


def test_a_convolution_is_a_dense_use_over_its_output_positions():
    conv = nn.Conv2d(1, 2, 3)                                # 5x5 -> 3x3: T = 9, m = 2, n = 1·3·3
    norm = nn.GroupNorm(1, 2)
    model = nn.Sequential(conv, norm)
    params = walk(model, {}, 4, run=lambda: model(torch.randn(4, 1, 5, 5)))
    calls = {p.name: p.calls for p in params}
    assert calls["0.weight"] == [Call("dense", 2, 9, 9, False, 2)]
    assert calls["0.bias"] == [Call("vector", 1, 2, 9)]
    assert calls["1.weight"] == [Call("vector", 1, 2, 9)]
    grouped = nn.Conv2d(2, 2, 3, groups=2)
    assert walk(grouped, {}, 4, run=lambda: grouped(torch.randn(4, 2, 5, 5))) == []


def test_weights_reading_one_input_count_its_gram_once():
    class SharedInput(nn.Module):                   # q, k, v of one input, T 8
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(512, 512), nn.Linear(512, 128), nn.Linear(512, 128)

        def forward(self, x):
            return self.q(x).sum((1, 2)) + self.k(x).sum((1, 2)) + self.v(x).sum((1, 2))

    model = SharedInput()
    b, t = 2, 8
    x = torch.randn(b, t, 512)
    alone = sum(param_costs(p, b, "symmetric")["floor"]
                for p in walk(model, {}, b, run=lambda: model(x)))
    found = _step_floor(model, x, b)
    # ghost is the cheaper for each weight at T 8 (about T²(m+n) against 4·m·n); k and v
    # need no Gram of the 512-wide input: 2·B·T(T+1)·512 less
    gram = b * t * (t + 1) * 512
    assert alone - found["extra_flops"] == 2 * gram
