"""Random draws cut per sample for the certificate's replays (dpclip/engine/certificate/draws.py)."""

from __future__ import annotations

import pytest
import torch

from dpclip.engine.certificate.draws import DrawsNotCut, Recorder, Substitute, _cut
from dpclip.engine.certificate.replay import rng_state


def test_a_draw_is_cut_along_the_one_axis_that_shrank_from_b_to_one():
    draw = torch.arange(4 * 3 * 2.0).reshape(4, 3, 2)
    torch.testing.assert_close(_cut(draw, torch.Size([4, 1, 2]), 2, 3), draw[:, 2:3])


def test_a_merged_batch_axis_is_cut_by_blocks_of_rows():
    draw = torch.arange(6 * 5.0).reshape(6, 5)          # [B·k, d] with B 3, k 2
    torch.testing.assert_close(_cut(draw, torch.Size([2, 5]), 1, 3), draw[2:4])


def test_a_draw_of_the_same_shape_is_shared_by_all_samples():
    draw = torch.randn(7)
    assert _cut(draw, torch.Size([7]), 1, 3) is draw


@pytest.mark.parametrize("shape", [(2, 3, 1), (4, 1, 1), (4, 2)])
def test_a_draw_whose_shapes_do_not_fit_is_not_guessed(shape):
    with pytest.raises(DrawsNotCut):
        _cut(torch.zeros(4, 3, 2), torch.Size(shape), 0, 3)


def test_replayed_draws_are_the_samples_part_of_the_recorded_ones():
    x = torch.randn(3, 5)
    with Recorder(lambda: False) as rec:
        batch_mask = torch.empty_like(x).bernoulli_(0.5)
        batch_noise = torch.randn(3, 5)
    assert len(rec.draws) == 2
    with Substitute(rec.draws, 2, 3) as sub:
        mask = torch.empty(1, 5).bernoulli_(0.5)
        noise = torch.randn(1, 5)
    assert sub.next == 2
    torch.testing.assert_close(mask, batch_mask[2:3])
    torch.testing.assert_close(noise, batch_noise[2:3])


def test_a_seeded_operation_computing_with_its_input_makes_the_forward_unrecordable():
    with Recorder(lambda: False) as rec:
        torch.normal(torch.zeros(3), 1.0)
    assert rec.draws is None


def test_a_draw_too_many_in_the_replay_is_refused():
    with Recorder(lambda: False) as rec:
        torch.rand(3, 2)
    with pytest.raises(DrawsNotCut), Substitute(rec.draws, 0, 3):
        torch.rand(1, 2)
        torch.rand(1, 2)


def test_draws_of_the_engines_own_probes_are_not_recorded():
    skipping = [True]
    with Recorder(lambda: skipping[0]) as rec:
        torch.rand(3)
        skipping[0] = False
        torch.rand(3)
    assert len(rec.draws) == 1


def _recorded(forward):
    start = rng_state([])
    with Recorder(lambda: False) as rec:
        forward()
    return rec, start, rng_state([])


def test_draws_from_the_generator_as_it_stands_follow_its_stream():
    rec, start, end = _recorded(lambda: (torch.empty(3, 4).bernoulli_(0.5), torch.randn(2)))
    assert rec.follows(start, end, [])


@pytest.mark.parametrize("reseed_at", ["before the draws", "after the draws"])
def test_a_forward_that_reseeds_the_generator_does_not_follow_its_stream(reseed_at):
    def forward():
        if reseed_at == "before the draws":
            torch.manual_seed(1234)
        torch.empty(3, 4).bernoulli_(0.5)
        if reseed_at == "after the draws":
            torch.manual_seed(1234)
    rec, start, end = _recorded(forward)
    assert not rec.follows(start, end, [])


class _SeedsFromItsBatch(torch.nn.Module):
    """Dropout after reseeding torch's generator from the batch: every sample's mask depends on
    every sample (replacing one of 32 moved the clipped sum by 5.5·C, found by a hostile review)."""

    def __init__(self, when: str):
        super().__init__()
        self.when = when
        self.a, self.b = torch.nn.Linear(5, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        seed = int((x.detach().sum() * 1e6).abs()) % (2 ** 31)
        if self.when == "fixed":
            seed = 7
        if self.when in ("before", "fixed"):
            torch.manual_seed(seed)
        out = self.b(torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.5, training=True))
        if self.when == "after":   # the next forward's masks would depend on this batch
            torch.manual_seed(seed)
        if self.when == "entropy":   # as Reformer's reversible layers do: the state then follows no sample
            torch.seed()
        return out


def _engine_backward(when: str) -> None:
    from dpclip.engine import DPEngine
    torch.manual_seed(1)
    model = _SeedsFromItsBatch(when)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 0.01}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=32)
    x, y = torch.randn(32, 5), torch.randn(32, 3)
    engine.backward(((model(x) - y) ** 2).mean(1))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_forward_seeding_torchs_generator_from_its_batch_is_refused(when):
    from dpclip.errors import EngineError
    with pytest.raises(EngineError, match="random state the model's forward leaves depends on its batch|changes sample"):
        _engine_backward(when)


@pytest.mark.parametrize("when", ["fixed", "entropy"])
def test_a_forward_seeding_torchs_generator_with_a_constant_or_from_os_entropy_passes(when):
    _engine_backward(when)


def test_rrelu_in_training_on_the_cpu_is_refused_its_draws_count_its_negative_inputs():
    """The CPU's RReLU draws one number per negative input: the generator's position after the
    forward, and so the next forward's dropout masks, depend on every sample."""
    from dpclip.engine import DPEngine
    from dpclip.errors import EngineError
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.RReLU(), torch.nn.Linear(16, 3)).train()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=8)
    with pytest.raises(EngineError, match="RReLU"):
        engine.backward(((model(torch.randn(8, 5)) - torch.randn(8, 3)) ** 2).mean(1))
