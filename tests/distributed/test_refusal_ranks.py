"""A certificate refusal raised on rank 1 only (its model mixes the samples of its part of the
batch) stops the run as one raised on rank 0 does: before any step is released, with rank 1's
own error, and with the run directory's statement naming the stop on a private batch
(plan.json ``stopped_on_private_batch``, docs/accounting.md)."""

from __future__ import annotations

import json

import pytest

from dpclip.planning.plan import PRIVATE_STOP
from dpclip.rundir.run import RunDir, spent
from tests.distributed.ranks import run_ranks
from tests.distributed.refusal_case import mixing_on_rank_one


@pytest.mark.slow   # two spawned ranks
def test_a_refusal_on_rank_one_stops_every_rank_and_states_the_private_stop(tmp_path):
    errors = run_ranks(mixing_on_rank_one, str(tmp_path))
    by_rank = {rank: (kind, message, hint) for rank, kind, message, hint, _ in errors}
    assert sorted(by_rank) == [0, 1], errors
    assert by_rank[1][0] == "EngineError" and "mixes samples" in by_rank[1][1] and by_rank[1][2]
    assert by_rank[0][0] == "PeerStopped" and by_rank[0][2]
    run = tmp_path / "run"
    assert json.loads((run / "ledger.json").read_text())["entries"] == []   # nothing was released
    assert (run / "metrics.jsonl").read_text() == ""
    assert RunDir(run).public_plan()["stopped_on_private_batch"] is True
    assert PRIVATE_STOP in spent(run)[1].not_covered
