"""make_private under torchrun: rank 0 draws the noise for the sum of every rank's clipped
examples, so the ranks must share the plan and the model. Before the fix a rank 1 called with
max_grad_norm=50 (rank 0: 0.5) trained, its examples clipped at 100 times the bound the noise
covers, and so did another noise_multiplier, delta or steps; another batch size or a float64
model hung the collectives until their timeout. Ranks whose datasets held the same number of rows
in another order (a per-rank shuffle) trained too, though rank r draws the examples at ITS
positions r, r + W, ...: reversed on rank 1, every even row was owned by both ranks (in a batch
with probability about 2q) and no odd row by any. And a rank running another dpclip (another
node's install) trained under rank 0's plan. Now each is refused on every rank, naming the
argument, before any draw."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.agreement_case import ON_RANK_ONE, each_case
from tests.distributed.ranks import run_ranks


@pytest.mark.slow   # two spawned ranks, eleven make_private calls each
def test_ranks_whose_privacy_arguments_or_model_differ_are_refused_before_any_step(tmp_path):
    assert run_ranks(each_case, str(tmp_path)) == []
    for rank in (0, 1):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        for case in ON_RANK_ONE:
            kind, message, hint = found[case]
            assert kind == "DpclipError" and "the ranks disagree on" in message and "rank 1 has" in message, \
                (rank, case, found[case])
            assert ("same dpclip" if case == "code" else "same arguments") in hint, (rank, case, hint)
            if case in ("order", "content"):   # same length, other rows: positions would be owned twice
                assert "the training rows in their order" in message and "same order" in hint, (rank, case)
        assert found[None] == ("trained", 4)   # ranks that agree train as before
