"""``nn.Embedding(max_norm=...)`` renormalises the rows it looks up, in place, during the
forward. On private data that writes the batch's tokens into the weights: the released
model's row norms say which tokens were looked up, with no noise at all. The engine
refuses such a module when it is built."""

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError


def _embedding(**kwargs):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, **kwargs)
    with torch.no_grad():
        emb.weight.mul_(10)              # every row norm above max_norm
    return emb


def test_max_norm_embedding_writes_the_looked_up_tokens_into_its_weights():
    # The attack, on plain torch: compare the weights before and after one private forward.
    emb = _embedding(max_norm=1.0)
    before = emb.weight.detach().clone()
    emb(torch.tensor([[3, 5, 3]]))
    changed = (emb.weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 5]


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
def test_engine_refuses_an_embedding_with_max_norm(trainable):
    emb = _embedding(max_norm=1.0)
    emb.weight.requires_grad_(trainable)
    model = nn.Sequential(emb, nn.Linear(4, 2))
    with pytest.raises(EngineError, match=r"module 0 \(Embedding\) has max_norm") as err:
        DPEngine(model, {}, expected_batch_size=4)
    assert "max_norm=None" in err.value.hint


def test_engine_refuses_an_embedding_bag_with_max_norm():
    model = nn.Sequential(nn.EmbeddingBag(10, 4, max_norm=1.0), nn.Linear(4, 2))
    with pytest.raises(EngineError, match="max_norm"):
        DPEngine(model, {}, expected_batch_size=4)


def test_engine_accepts_an_embedding_without_max_norm_and_leaves_unused_rows_alone():
    emb = _embedding(max_norm=None)
    model = nn.Sequential(emb, nn.Linear(4, 2))
    before = emb.weight.detach().clone()
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=0.0, seed=0)
    engine.backward(model(torch.tensor([[3, 5], [5, 3]])).sum((1, 2)))
    assert torch.equal(emb.weight.detach(), before)     # the forward wrote nothing
    engine.privatize()
    assert emb.weight.grad[[0, 1, 2, 4, 6, 7, 8, 9]].abs().sum() == 0
    engine.detach()


class FunctionalMaxNorm(nn.Module):
    """``F.embedding(ids, weight, max_norm=1)`` on a raw parameter: no nn.Embedding to refuse when built."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 4) * 3)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(torch.nn.functional.embedding(ids, self.weight, max_norm=1.0).mean(1))


def test_a_forward_renormalising_a_trained_weight_in_place_is_refused_before_any_noise():
    torch.manual_seed(0)
    model = FunctionalMaxNorm()
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                      gradient_noise_multiplier=1.0, expected_batch_size=4)
    noise = engine.noise.generator(torch.device("cpu"))
    before = noise.get_state().clone()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 7, 8], [2, 3, 9]])
    with pytest.raises(EngineError, match="writes the trained parameter weight in place") as refused:
        model(ids)
    assert "max_norm" in refused.value.hint
    assert torch.equal(noise.get_state(), before)
    # the checked forward's draw recorder (a dispatch mode) is off again: the caller's process goes on as before
    assert _get_current_dispatch_mode() is None
    engine.detach()
