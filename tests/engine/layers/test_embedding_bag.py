"""nn.EmbeddingBag: bag i is sample i (1-D input with offsets, or a 2-D input), every mode.

The contract suite (test_contract.py) runs the rule's own examples; here: trainable
per-sample weights, a property test over shapes and modes, and what is refused.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, check_exact


class BagNet(nn.Module):
    """Bags given as padded [B, L] ids with a length per sample, cut into a 1-D input with
    offsets (so that the per-example reference can slice samples)."""

    def __init__(self, vocab=9, dim=3, weighted=False, **bag_kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, **bag_kw)
        self.weigh = nn.Linear(2, 1) if weighted else None    # trainable per-sample weights
        self.head = nn.Linear(dim, 3)

    def forward(self, ids, lengths, feats):
        keep = torch.arange(ids.shape[1]) < lengths[:, None]
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        if not self.bag.include_last_offset:
            offsets = offsets[:-1]
        weights = torch.sigmoid(self.weigh(feats)).squeeze(-1)[keep] if self.weigh else None
        return self.head(torch.tanh(self.bag(ids[keep], offsets, weights)))


def bag_loss(model, batch):
    return F.cross_entropy(model(batch["ids"], batch["lengths"], batch["feats"]), batch["y"],
                           reduction="none")


def bag_batch(n, width, vocab=9, seed=0, empty=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0 if empty else 1, width + 1, (n,), generator=g)
    return {"ids": torch.randint(0, vocab, (n, width), generator=g), "lengths": lengths,
            "feats": torch.randn(n, width, 2, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 3, (n,), generator=g)}


@pytest.mark.parametrize("method", ["ghost", "instantiate"])
@pytest.mark.parametrize("padding_idx", [None, 1])
def test_trainable_per_sample_weights_get_their_gradient_through_the_bag(method, padding_idx):
    check_exact(lambda: BagNet(weighted=True, mode="sum", padding_idx=padding_idx).to(DTYPE),
                bag_loss, bag_batch(5, 4, seed=1), "param", norm_method=method)


@settings(max_examples=40, deadline=None)
@given(mode=st.sampled_from(["sum", "mean", "max"]), batch=st.integers(1, 6),
       width=st.integers(1, 5), dim=st.integers(1, 4), last=st.booleans(),
       padding=st.sampled_from([None, 0]), seed=st.integers(0, 2**16))
def test_property_embedding_bags_are_exact_at_any_shape(mode, batch, width, dim, last, padding,
                                                       seed):
    """B = 1, B = bag length, B = length + 1, empty bags, repeats, every mode; AUTO clipping
    (every sample scaled by its own norm), since two equal bags would tie abadi's median."""
    data = bag_batch(batch, width, seed=seed, empty=batch > 1)
    check_exact(lambda: BagNet(dim=dim, mode=mode, include_last_offset=last,
                               padding_idx=padding).to(DTYPE),
                bag_loss, data, "all-layer", fn="auto", strict=True)   # equal bags tie the median


def test_scale_grad_by_freq_is_refused_naming_the_module():
    model = nn.Sequential(nn.EmbeddingBag(5, 2, scale_grad_by_freq=True))
    with pytest.raises(EngineError) as err:
        DPEngine(model, {}, expected_batch_size=4)
    assert "0 (EmbeddingBag)" in err.value.message and "scale_grad_by_freq" in err.value.hint


def test_bags_that_are_not_the_samples_are_refused():
    """Two bags per sample: the bag count is not the number of per-sample losses."""
    bag = nn.EmbeddingBag(5, 2).to(DTYPE)
    engine = DPEngine(bag, {}, expected_batch_size=4)
    out = bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3]))      # 4 bags
    with pytest.raises(EngineError) as err:
        engine.backward(out.reshape(2, 4).sum(1))                           # 2 samples
    assert "EmbeddingBag" in err.value.message
    engine.detach()


def test_offsets_that_do_not_cut_the_input_are_refused():
    bag = nn.EmbeddingBag(5, 2).to(DTYPE)
    engine = DPEngine(bag, {}, expected_batch_size=4)
    with pytest.raises(EngineError) as err:
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    assert "offsets" in err.value.message
    engine.detach()
