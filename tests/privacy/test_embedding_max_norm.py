"""``nn.Embedding(max_norm=...)`` renormalises the rows it looks up, in place, during the
forward. On private data that writes the batch's tokens into the weights: the released
model's row norms say which tokens were looked up, with no noise at all. The engine
refuses such a module when it is built."""

import pytest
import torch
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
