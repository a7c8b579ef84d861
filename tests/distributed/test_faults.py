"""Bad input and faults across ranks: each ends every rank with a clear error and a hint, and
no ledger is ever half written."""

from __future__ import annotations

import json
import socket

import pytest

from dpclip.cli.main import main
from dpclip.distributed.launch import check_port, failure_error
from dpclip.errors import DpclipError
from tests.distributed import workers
from tests.distributed.ranks import run_ranks


def test_ranks_that_disagree_on_the_recipe_all_refuse_before_writing(tmp_path):
    errors = run_ranks(workers.disagree, str(tmp_path))
    assert [e[0] for e in errors] == [0, 1]
    for _, kind, message, hint, _ in errors:
        assert kind == "DpclipError" and "disagree on the recipe" in message and "rank 1" in message
        assert "same recipe" in hint
    assert not (tmp_path / "run").exists()


def test_a_rank_that_raises_stops_every_rank_with_the_ledger_whole(tmp_path):
    errors = run_ranks(workers.raise_at_step, str(tmp_path), 5)
    by_rank = {e[0]: e for e in errors}
    assert by_rank[1][1] == "DpclipError" and "injected failure" in by_rank[1][2]
    assert by_rank[0][1] == "PeerStopped" and "--resume" in by_rank[0][3]
    run = tmp_path / "run"
    ledger = json.loads((run / "ledger.json").read_text())
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    charged = sum(entry["count"] for entry in ledger["entries"])
    assert charged == 4 and max(steps) == 4  # rank 1 failed inside step 5: nothing of it was released


def test_a_port_in_use_is_refused_with_a_hint(capsys):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(DpclipError, match=f"port {port} is in use"):
            check_port(port)
        code = main(["train", "recipes/quickstart.yaml", "--nproc", "2", "--master-port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and "in use" in err and "hint:" in err and "--master-port" in err


class _Failure:
    def __init__(self, info=None, exitcode=1, signal="SIGKILL"):
        self.error_file_data = {"dpclip": info} if info else {"message": "<NONE>"}
        self.exitcode = exitcode
        self._signal = signal

    def signal_name(self):
        return self._signal


def test_the_launcher_names_the_rank_that_failed_first():
    peer = {"message": "another rank stopped", "hint": "x", "secondary": True, "ns": 1, "rank": 0}
    killed = failure_error({0: _Failure(peer), 1: _Failure(exitcode=-9)}, 2, "runs/r")
    assert "rank 1 was killed by SIGKILL" in killed.message
    assert "dpclip train --resume runs/r --nproc 2" in killed.hint
    own = {"message": "bad thing", "hint": "fix it", "secondary": False, "ns": 5, "rank": 1}
    raised = failure_error({0: _Failure(peer), 1: _Failure(own)}, 2, None)
    assert raised.message == "rank 1 stopped: bad thing" and raised.hint == "fix it"


def test_resuming_with_another_world_size_is_refused(tmp_path, capsys):
    """A checkpoint made by 2 ranks (its 'ranks' list) refuses a 1-process resume."""
    from dpclip.train.ranks import check_world_size

    with pytest.raises(DpclipError, match="trained by 2 ranks") as info:
        check_world_size({"ranks": [{}, {}]}, 1, tmp_path)
    assert "--nproc 2" in info.value.hint
    with pytest.raises(DpclipError, match="trained by 1 rank, and this resume has 2"):
        check_world_size({}, 2, tmp_path)
