"""Random draws cut per sample for the certificate's replays (dpclip/engine/certificate/draws.py)."""

from __future__ import annotations

import pytest
import torch

from dpclip.engine.certificate.draws import DrawsNotCut, Recorder, Substitute, _cut


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
