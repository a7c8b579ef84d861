"""Ctrl-C twice leaves a usable run and says how to go on (issue 50, item 8)."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

import dpclip.rundir.checkpoint as checkpoint
import dpclip.train.workflow as workflow
from dpclip.rundir.checkpoint import latest_checkpoint, save_checkpoint
from dpclip.interrupt import shielded

REPO = Path(__file__).resolve().parents[2]


def test_a_signal_during_a_checkpoint_write_waits_until_it_is_written(tmp_path, monkeypatch):
    events = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: events.append("handler"))
    real = checkpoint.save_file

    def interrupted_midway(tensors, path, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)   # Ctrl-C while the checkpoint's files are written
        events.append("still writing")
        return real(tensors, path, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "save_file", interrupted_midway)
    try:
        save_checkpoint(tmp_path, 3, torch.nn.Linear(2, 2), {"step": 3}, keep=2)
        events.append("written")
    finally:
        signal.signal(signal.SIGINT, previous)
    # each signal reached the handler once the write had finished, before the call returned
    assert events == ["still writing", "still writing", "handler", "handler", "written"]
    assert latest_checkpoint(tmp_path).name == "step_000003"
    assert not list((tmp_path / "checkpoints").glob(".*staging"))


def test_a_staging_folder_left_by_a_killed_write_is_removed_by_the_next(tmp_path):
    (tmp_path / "checkpoints" / ".step_000001.staging").mkdir(parents=True)
    save_checkpoint(tmp_path, 2, torch.nn.Linear(2, 2), {"step": 2}, keep=2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["step_000002"]


def test_shielded_changes_nothing_without_a_signal():
    before = signal.getsignal(signal.SIGINT)
    with shielded():
        pass
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_ctrl_c_stops_at_once_and_says_how_to_resume(cli, tmp_path, monkeypatch):
    def second_ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(workflow, "run_loop", second_ctrl_c)
    result = cli("train", REPO / "recipes" / "quickstart.yaml", f"output_dir={tmp_path / 'runs'}",
                 "training.epochs=null", "training.steps=2", "model.hidden=[8]", "eval.every_steps=null")
    run_dir = next((tmp_path / "runs").iterdir())
    assert result.code == 130
    assert "error: interrupted twice" in result.err
    hint = result.err.replace("\n", "")
    assert f"dpclip train --resume {run_dir}" in hint and "step_000000" in hint
    assert latest_checkpoint(run_dir) is not None


def test_a_double_press_is_one_request_and_a_later_second_signal_stops_at_once(monkeypatch):
    from dpclip.interrupt import DeferredInterrupt
    import dpclip.interrupt as interrupt

    now = [100.0]
    monkeypatch.setattr(interrupt.time, "monotonic", lambda: now[0])
    deferred = DeferredInterrupt()
    deferred._handle(signal.SIGINT, None)
    assert deferred.requested
    now[0] += 0.05                      # 50 ms later: the same request, the step boundary still checkpoints
    deferred._handle(signal.SIGINT, None)
    now[0] += DeferredInterrupt.GRACE_S
    try:                                # later: the escape hatch for a step that hangs
        deferred._handle(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("a second Ctrl-C after the grace period must stop at once")
