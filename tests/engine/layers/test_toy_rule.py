"""A layer rule added by one definition: ``Scale`` (y = x ⊙ w) stops using the fallback."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine, LayerRule, register_layer_rule
from dpclip.engine.factors import Dense
from dpclip.engine.layers import Example, find_layer_rule, unregister_layer_rule
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, check_example_exact, check_exact


class Scale(nn.Module):
    """y = x ⊙ w over the last dim, w a vector parameter."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=DTYPE))

    def forward(self, x):
        return x * self.w


class ScaleRule(LayerRule):
    """The whole rule: dw_i = Σ_t b_t ⊙ x_t, instantiated (it is d numbers per sample)."""

    name = "scale"
    calls = 0

    def forward(self, m, x, info):
        return x * m.w

    def input_grad(self, m, x, gy, info):
        return gy * m.w

    def uses(self, m, x, gy, info):
        type(self).calls += 1
        return {"w": Dense((gy * x).reshape(x.shape[0], -1, x.shape[-1]).sum(1))}

    def examples(self):
        g = torch.Generator().manual_seed(0)
        return [Example(Scale(4), (torch.randn(5, 3, 4, generator=g, dtype=DTYPE),))]


@pytest.fixture
def scale_rule():
    register_layer_rule(Scale)(ScaleRule)          # the decorator form, applied by hand
    yield
    unregister_layer_rule(Scale)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.scale, self.head = nn.Linear(4, 4), Scale(4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(torch.tanh(self.lin(x)))).mean(1))


def _loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _batch():
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(5, 3, 4, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 3, (5,), generator=g)}


def test_without_a_rule_scale_is_a_fallback_that_strict_mode_refuses():
    assert find_layer_rule(Scale(3)) is None
    with pytest.raises(EngineError, match="scale \\(Scale\\)"):
        DPEngine(Net().to(DTYPE), {"strict": True}, expected_batch_size=5)


def test_a_registered_rule_is_used_and_matches_per_example_loop(scale_rule):
    assert isinstance(find_layer_rule(Scale(3)), ScaleRule)
    before = ScaleRule.calls
    for grouping in ("all-layer", "layer"):
        check_exact(lambda: Net().to(DTYPE), _loss, _batch(), grouping, strict=True)
    assert ScaleRule.calls > before               # its uses() delivered the gradients
    check_example_exact(ScaleRule().examples()[0], "param")   # the contract, as for any rule


def test_unregistering_restores_the_fallback(scale_rule):
    unregister_layer_rule(Scale)
    assert find_layer_rule(Scale(3)) is None
    register_layer_rule(Scale, ScaleRule())        # the call form (for the fixture's teardown)
