"""make_private across 2 gloo ranks gives what 1 process gives (docs/python-api.md, "Several
processes"): the ranks' seeded draws union to the one-process batch, the clipped sums add over
the ranks and rank 0 draws the noise once, so the weights match to float tolerance and the
ledger is the same."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import api_case
from tests.distributed.ranks import run_ranks


@pytest.mark.slow   # a two-rank run (README: the slow tests)
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled-train-step"])
def test_two_ranks_of_make_private_train_the_weights_and_ledger_of_one_process(tmp_path, compile):
    """With compile, each rank's part of the draw goes through private.train_step's compiled graph
    in pieces of its 6 rows; the one process it is compared with trains eagerly."""
    assert run_ranks(api_case.rank_main, str(tmp_path / "two"), compile) == []
    api_case.train(tmp_path / "one", per_rank_batch=12, seed_model=100)   # B = 6 per rank × 2 ranks
    one, two = load_file(tmp_path / "one" / "weights.st"), load_file(tmp_path / "two" / "weights.st")
    assert sorted(one) == sorted(two)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    ledger_one = json.loads((tmp_path / "one" / "ledger.json").read_text())
    ledger_two = json.loads((tmp_path / "two" / "ledger.json").read_text())
    assert ledger_two["steps"] == api_case.STEPS and ledger_two["epsilon"] == ledger_one["epsilon"]
    assert ledger_two["entries"] == ledger_one["entries"]
    privacy = json.loads((tmp_path / "two" / "privacy.json").read_text())
    assert privacy["sample_rate"] == 12 / api_case.N


def test_a_perturbed_start_is_detected(tmp_path):
    """The comparison can fail: without the broadcast, another starting point moves the weights."""
    api_case.train(tmp_path / "a", per_rank_batch=12, seed_model=100)
    api_case.train(tmp_path / "b", per_rank_batch=12, seed_model=101)
    a, b = load_file(tmp_path / "a" / "weights.st"), load_file(tmp_path / "b" / "weights.st")
    assert any(not torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
