"""The certificate on models no step can check (docs/certificate.md): a model about
to be sharded (FSDP) or cut into pipeline stages is checked whole, on a few training rows, before
the cut. A fault on one rank stops every rank before any noisy step."""

from __future__ import annotations

import json

import pytest

from dpclip.layout import LEDGER
from tests.distributed.certificate_case import sabotaged_on_rank_one
from tests.distributed.ranks import run_ranks


@pytest.mark.slow   # two spawned ranks each: about 10 s
@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
def test_an_engine_sabotaged_on_one_rank_is_refused_on_every_rank_before_the_cut(parallel, tmp_path):
    errors = run_ranks(sabotaged_on_rank_one, str(tmp_path), parallel)
    assert [e[0] for e in errors] == [0, 1], errors
    by_rank = {rank: (kind, message) for rank, kind, message, _, _ in errors}
    assert by_rank[1][0] == "EngineError" and "norms and clipped gradients disagree" in by_rank[1][1]
    assert by_rank[0][0] == "PeerStopped" and by_rank[0][1].startswith("rank 1: ")
    ledger = tmp_path / "run" / LEDGER
    assert not ledger.exists() or json.loads(ledger.read_text())["entries"] == []   # nothing was released
