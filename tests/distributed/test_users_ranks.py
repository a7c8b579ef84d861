"""User-level privacy on two ranks (docs/users.md): each rank samples its own people (u mod W)
with all their records, so a person whose records would split over ranks by index is still one
person; with seeded randomness the two ranks draw the batches and charge the ledger of one
process, and data-parallel ranks train its weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dpclip.train.workflow import train
from tests.distributed import workers
from tests.distributed.ranks import run_ranks


def _weights(run_dir):
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["data", "fsdp"])
def test_two_ranks_sample_people_and_train_as_one_process(parallel, tmp_path):
    torch.set_num_threads(1)
    assert run_ranks(workers.train_users, str(tmp_path), parallel) == []
    two = tmp_path / "run"
    one = train(workers.user_recipe(tmp_path / "runs"), run_dir=tmp_path / "one").run_dir
    mine, theirs = _weights(one), _weights(two)
    assert mine.keys() == theirs.keys()
    if parallel == "data":  # fsdp ranks draw their own rows' noise from their own streams: other numbers
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-6)
    assert json.loads((one / "ledger.json").read_text())["entries"] == \
        json.loads((two / "ledger.json").read_text())["entries"]
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["diagnostics"]["batch_size"] for r in records if "diagnostics" in r] == \
        [r["diagnostics"]["batch_size"] for r in reference if "diagnostics" in r]
    statement = json.loads((two / "summary.json").read_text())["statement"]
    assert any("user-level" in line for line in statement)


def test_a_persons_records_are_all_on_the_rank_that_owns_the_person():
    from dpclip.data.user_sampler import UserPoissonSampler

    users = torch.tensor([3, 0, 1, 3, 2, 0, 3, 1, 2, 2, 3])
    parts = [UserPoissonSampler(users, 1.0, 1, 10, seed=4, rank=r, world_size=2) for r in (0, 1)]
    batches = [next(iter(p)) for p in parts]
    assert sorted(torch.cat(batches).tolist()) == list(range(len(users)))   # every record once
    for rank, batch in enumerate(batches):
        assert set((users[batch] % 2).tolist()) == {rank}
