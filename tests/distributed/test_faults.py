"""Bad input and faults across ranks: each ends every rank with a clear error and a hint, and
no ledger is ever half written."""

from __future__ import annotations

import importlib
import json
import socket

import pytest

from dpclip.cli.main import main
from dpclip.distributed.launch import check_port, failure_error, interrupted_error
from dpclip.errors import DpclipError, InterruptedRun
from tests.distributed import workers
from tests.distributed.ranks import run_ranks

launch_module = importlib.import_module("dpclip.distributed.launch")  # the package exports a function `launch`


@pytest.mark.slow
def test_ranks_that_disagree_on_the_recipe_all_refuse_before_writing(tmp_path):
    errors = run_ranks(workers.disagree, str(tmp_path))
    assert [e[0] for e in errors] == [0, 1]
    for _, kind, message, hint, _ in errors:
        assert kind == "DpclipError" and "disagree on the recipe" in message and "rank 1" in message
        assert "same recipe" in hint
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_ranks_that_run_other_dpclip_code_all_refuse_before_writing(tmp_path):
    """Before the fix a node with another dpclip install trained as rank 1: its sampling and clipping
    under rank 0's plan and noise, with nothing in the run saying so."""
    errors = run_ranks(workers.other_code, str(tmp_path))
    assert [e[0] for e in errors] == [0, 1]
    for _, kind, message, hint, _ in errors:
        assert kind == "DpclipError" and "the ranks run other code: rank 1 runs dpclip 0.0.9" in message, message
        assert "same dpclip" in hint
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
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


@pytest.mark.slow   # two spawned ranks and a 3 s timeout
def test_a_rank_that_waits_out_the_timeout_says_so_and_how_to_raise_it(tmp_path, monkeypatch):
    """A stuck rank (not a stopped one): rank 0's collective times out. Before, it said "another rank
    stopped", was recorded as only reporting a peer's error, and the launcher named the stuck rank's
    SIGTERM from torchrun's agent ("out of memory and a kill -9 look like this") instead."""
    from dpclip.distributed.world import TIMEOUT_ENV

    monkeypatch.setenv(TIMEOUT_ENV, "3")
    errors = {e[0]: e for e in run_ranks(workers.stuck_rank_one, 12.0)}
    assert errors[0][1] == "NoAnswer", errors[0]
    assert f"did not reach the same collective within {TIMEOUT_ENV} = 3 s" in errors[0][2]
    assert f"raise {TIMEOUT_ENV}" in errors[0][3]
    assert errors[1][1] == "PeerStopped"   # the stuck rank, once it moves on, finds the pair closed


def test_the_launcher_names_a_timed_out_rank_before_the_stuck_rank_the_agent_ended():
    from dpclip.distributed.world import no_answer, run_collective

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                        "1800000ms for recv operation to complete")

    def waits():
        raise gloo

    with pytest.raises(DpclipError) as caught:
        run_collective(waits)
    assert type(caught.value).__name__ == "NoAnswer" and "Timed out waiting 1800000ms" in caught.value.message
    info = {"message": no_answer(gloo).message, "hint": no_answer(gloo).hint, "secondary": False, "ns": 1, "rank": 0}
    error = failure_error({0: _Failure(info), 1: _Failure(exitcode=-15, signal="SIGTERM")}, 2, "runs/r")
    assert error.message.startswith("rank 0 stopped: another rank did not reach the same collective within")
    assert "raise DPCLIP_DIST_TIMEOUT_S" in error.hint and "dpclip train --resume runs/r --nproc 2" in error.hint


def test_a_pipeline_stage_that_waits_out_the_timeout_says_so():
    from dpclip.distributed import pipeline

    def schedule_step():   # torch's schedule wraps gloo's error in its own RuntimeError
        try:
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
                               "operation to complete")
        except RuntimeError as exc:
            raise RuntimeError(f"stage 1 failed: {exc}") from exc

    with pytest.raises(DpclipError, match="did not reach the same collective within DPCLIP_DIST_TIMEOUT_S") as caught:
        getattr(pipeline, "_through_pipeline")(schedule_step)
    assert type(caught.value).__name__ == "NoAnswer"


@pytest.mark.parametrize("given", ["30m", "0", "-5", "nan"])
def test_a_bad_timeout_is_refused_once_before_any_rank_starts_and_by_each_rank(given, tmp_path, monkeypatch, capsys):
    """DPCLIP_DIST_TIMEOUT_S=30m was an unexpected ValueError in every rank (0 or less: a group whose
    every collective times out at once)."""
    from dpclip.distributed import joined_world
    from dpclip.distributed.world import TIMEOUT_ENV

    train_launch = importlib.import_module("dpclip.train.launch")
    monkeypatch.setattr(train_launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    monkeypatch.setenv(TIMEOUT_ENV, given)
    assert main(["train", "recipes/quickstart.yaml", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{TIMEOUT_ENV}='{given}' is not a number of seconds > 0" in err
    assert "hint:" in err and "Traceback" not in err
    _as_a_rank(monkeypatch, tmp_path, launcher=False)   # a rank under plain torchrun: refused before it joins
    with pytest.raises(DpclipError, match="not a number of seconds"):
        with joined_world():
            pytest.fail("joined")
    assert "not a number of seconds" in json.loads((tmp_path / "error.json").read_text())["dpclip"]["message"]


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


def test_the_agents_sigterm_to_a_survivor_does_not_hide_the_rank_killed_first():
    """Once rank 1 is killed, torchrun's agent ends rank 0 with SIGTERM and records it too
    (a slow CI run, pipeline parallel): rank 0, lower and killed by a signal as well, must not
    be named in rank 1's place, whether it died of that SIGTERM or stopped at a step boundary."""
    died = failure_error({0: _Failure(exitcode=-15, signal="SIGTERM"), 1: _Failure(exitcode=-9)}, 2, "runs/r")
    assert died.message == "rank 1 was killed by SIGKILL before it could report an error"
    assert "dpclip train --resume runs/r --nproc 2" in died.hint
    stopped = {"message": "interrupted at step 12; a checkpoint was saved", "hint": "h", "secondary": False,
               "interrupted": True, "ns": 1, "rank": 0}
    interrupted = failure_error({0: _Failure(stopped), 1: _Failure(exitcode=-9)}, 2, "runs/r")
    assert not isinstance(interrupted, InterruptedRun)
    assert interrupted.message == "rank 1 was killed by SIGKILL before it could report an error"
    exited = failure_error({1: _Failure(exitcode=-15, signal="SIGTERM"), 0: _Failure(exitcode=3)}, 2, None)
    assert exited.message == "rank 0 exited with code 3 before it could report an error"
    alone = failure_error({0: _Failure(exitcode=-15, signal="SIGTERM")}, 1, None)  # a SIGTERM is all there is
    assert alone.message == "rank 0 was killed by SIGTERM before it could report an error"


def test_resuming_with_another_world_size_is_refused(tmp_path, capsys):
    """A checkpoint made by 2 ranks (its 'ranks' list) refuses a 1-process resume."""
    from dpclip.train.ranks import check_world_size

    with pytest.raises(DpclipError, match="trained by 2 ranks") as info:
        check_world_size({"ranks": [{}, {}]}, 1, tmp_path)
    assert "--nproc 2" in info.value.hint
    with pytest.raises(DpclipError, match="trained by 1 rank, and this resume has 2"):
        check_world_size({}, 2, tmp_path)


def test_an_interrupted_launch_reports_rank_0s_note_once_with_exit_130(tmp_path, monkeypatch):
    run_dir_file = tmp_path / "run_dir"
    monkeypatch.setenv(launch_module.RUN_DIR_ENV, str(run_dir_file))
    before = interrupted_error(run_dir_file, 2)
    assert isinstance(before, InterruptedRun) and "before the run directory was made" in before.message
    run_dir_file.write_text("runs/r")
    killed = interrupted_error(run_dir_file, 2)
    assert "before the ranks reached a step boundary" in killed.message
    assert "dpclip train --resume runs/r --nproc 2" in killed.hint
    assert launch_module.announce_interrupted("interrupted at step 7; a checkpoint was saved", "continue with: x")
    noted = interrupted_error(run_dir_file, 2)
    assert (noted.message, noted.hint, noted.exit_code) == ("interrupted at step 7; a checkpoint was saved",
                                                            "continue with: x", 130)
    monkeypatch.delenv(launch_module.RUN_DIR_ENV)
    assert not launch_module.announce_interrupted("m", None)  # under torchrun, rank 0 prints it itself


def test_a_rank_stopped_by_sigterm_makes_the_launch_an_interruption():
    stopped = {"message": "interrupted at step 3; a checkpoint was saved", "hint": "h", "secondary": False,
               "interrupted": True, "ns": 2, "rank": 1}
    error = failure_error({0: _Failure(dict(stopped, rank=0, ns=3)), 1: _Failure(stopped)}, 2, "runs/r")
    assert isinstance(error, InterruptedRun) and error.exit_code == 130
    assert error.message == "interrupted at step 3; a checkpoint was saved"
    assert error.hint == "continue with: dpclip train --resume runs/r --nproc 2"


def test_a_quiet_error_exits_with_its_code_and_prints_nothing(capsys, monkeypatch):
    """A rank whose interruption the launcher (or rank 0) reports exits 130 without a line of its own."""
    from dpclip.cli import main as main_module

    def stop(*args, **kwargs):
        error = InterruptedRun("interrupted at step 1", "continue")
        error.quiet = True
        raise error

    monkeypatch.setattr(main_module, "app", stop)
    assert main(["train", "x.yaml"]) == 130
    assert capsys.readouterr().err == ""


def test_a_transport_error_from_a_collective_torch_ran_is_a_peer_stopping():
    """FSDP's own gathers fail with gloo's RuntimeError when a rank is killed: joined_world
    reports it as another rank's stop, so the launcher names the killed rank, not this one."""
    from dpclip.distributed.world import lost_a_peer, peer_stopped

    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer "
                        "[127.0.0.1]:36321")
    assert lost_a_peer(gone)
    assert peer_stopped(gone).message.startswith("another rank stopped, so this one cannot go on (Connection closed")
    assert not lost_a_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not lost_a_peer(ValueError("Connection closed by peer"))


def test_a_resume_that_changes_the_parallel_mode_is_refused_with_a_hint_naming_both():
    """Each mode stores the optimizer and sampler state its own way (a sharded run by parameter
    name, a pipeline stage per rank): a resume keeps data, pipeline or fsdp."""
    from pathlib import Path

    from dpclip.errors import DpclipError
    from dpclip.train.ranks import check_parallel

    modes = ("data", "pipeline", "fsdp")
    for mode in modes:
        check_parallel({"parallel": mode}, mode, Path("run"))
    check_parallel({}, "data", Path("run"))   # checkpoints from before the mode was written
    check_parallel({"ranks": [{"sampler": {}, "optimizer": {}}, {}]}, "pipeline", Path("run"))  # a stage's own
    cases = [({"parallel": saved}, saved, asked) for saved in modes for asked in modes if saved != asked]
    cases += [({}, "data", "fsdp"), ({"ranks": [{"sampler": {}, "optimizer": {}}, {}]}, "pipeline", "data")]
    for state, saved, asked in cases:
        with pytest.raises(DpclipError) as caught:
            check_parallel(state, asked, Path("run"))
        assert caught.value.message == (f"run was trained with training.parallel: {saved}, and this resume asks "
                                        f"for {asked}")
        assert f"resume with training.parallel: {saved}" in caught.value.hint


def test_a_resume_override_of_the_parallel_mode_is_refused_before_anything_is_loaded(tmp_path, capsys):
    """`dpclip train --resume RUN training.parallel=...` stops with one error and a hint at the
    recipe, before the checkpoint is read; a checkpoint's own check runs before its weights load."""
    import torch

    from dpclip.rundir.checkpoint import latest_checkpoint, load_checkpoint
    from dpclip.train.ranks import check_parallel
    from dpclip.train.workflow import train

    run = train(workers.small_recipe(tmp_path / "runs", "layer"), run_dir=tmp_path / "run").run_dir
    for asked in ("pipeline", "fsdp"):
        assert main(["train", "--resume", str(run), f"training.parallel={asked}"]) == 2
        err = capsys.readouterr().err
        assert f"trained with training.parallel: data, and this resume asks for {asked}" in err
        assert "hint:" in err and "Traceback" not in err and "unexpected" not in err
    model = torch.nn.Linear(1, 1)
    before = model.weight.detach().clone()
    with pytest.raises(DpclipError, match="asks for pipeline"):   # the quickstart MLP's weights would not fit
        load_checkpoint(latest_checkpoint(run), model, lambda state: check_parallel(state, "pipeline", run))
    assert torch.equal(model.weight, before)


def _as_a_rank(monkeypatch, tmp_path, launcher: bool):
    """This process as rank 1 of 2 (torchrun's environment), started by `--nproc` or not."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    if launcher:
        monkeypatch.setenv(launch_module.RUN_DIR_ENV, str(tmp_path / "run_dir"))
    else:
        monkeypatch.delenv(launch_module.RUN_DIR_ENV, raising=False)


def test_a_rank_started_by_nproc_leaves_its_error_to_the_launcher_and_prints_nothing(tmp_path, monkeypatch, capsys):
    """`--nproc` prints one error: a rank it started writes its own (here a recipe refused before
    the process group exists) where the launcher reads it, and prints nothing; an unexpected
    exception the same way, with the CLI's exit code 1."""
    import torch

    from dpclip.cli import train as train_module

    _as_a_rank(monkeypatch, tmp_path, launcher=True)
    threads = str(torch.get_num_threads())
    assert main(["train", str(tmp_path / "missing.yaml"), "--threads", threads]) == 2
    assert capsys.readouterr().err == ""
    reported = json.loads((tmp_path / "error.json").read_text())["dpclip"]
    assert reported["message"].startswith("recipe file not found") and reported["hint"] and not reported["secondary"]
    error = failure_error({0: _Failure(dict(reported, rank=0)), 1: _Failure(reported)}, 2, None)
    assert error.message.startswith("recipe file not found")   # every rank refused it: no rank to name

    def crash(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(train_module, "thread_count", crash)
    assert main(["train", "x.yaml"]) == 1
    assert capsys.readouterr().err == ""
    reported = json.loads((tmp_path / "error.json").read_text())["dpclip"]
    assert reported["message"] == "unexpected ValueError: a bug" and "--debug" in reported["hint"]


def test_under_plain_torchrun_each_rank_prints_its_own_error(tmp_path, monkeypatch, capsys):
    _as_a_rank(monkeypatch, tmp_path, launcher=False)
    import torch

    assert main(["train", str(tmp_path / "missing.yaml"), "--threads", str(torch.get_num_threads())]) == 2
    err = capsys.readouterr().err
    assert "error: recipe file not found" in err and "hint:" in err
    assert json.loads((tmp_path / "error.json").read_text())["dpclip"]["message"].startswith("recipe file not found")


def test_the_launcher_shows_no_peers_hint_that_points_at_an_error_nobody_printed():
    """Only "another rank stopped" reports (no rank's own error): the launcher's one error does
    not say the failing rank's error is above, and a peer's stop never hides a killed rank."""
    from dpclip.distributed.world import RESUME_HINT

    assert "above" not in RESUME_HINT
    peer = {"message": "another rank stopped, so this one cannot go on (Connection closed by peer)",
            "hint": RESUME_HINT, "secondary": True, "ns": 1, "rank": 0}
    error = failure_error({0: _Failure(peer), 1: _Failure(dict(peer, rank=1))}, 2, "runs/r")
    assert error.message.startswith("rank 0 stopped: another rank stopped")
    assert error.hint == "no rank reported an error of its own; the run continues with: " \
                         "dpclip train --resume runs/r --nproc 2"
    different = failure_error({0: _Failure({"message": "a", "hint": None, "secondary": False, "ns": 2, "rank": 0}),
                               1: _Failure({"message": "b", "hint": None, "secondary": False, "ns": 1, "rank": 1})},
                              2, None)
    assert different.message == "rank 1 stopped: b"


def test_a_recipe_that_does_not_load_is_refused_once_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    train_launch = importlib.import_module("dpclip.train.launch")

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(train_launch, "launch", no_launch)
    assert main(["train", str(tmp_path / "missing.yaml"), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "recipe file not found" in err and "hint:" in err
