"""`dpclip train RECIPE --nproc 2` end to end: a rank killed with -9 ends the run with one clear
error, and `--resume ... --nproc 2` finishes it with the ledger of an uninterrupted run (data
parallel, pipeline stages and a sharded model alike)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dpclip.recipe import recipe_to_yaml
from dpclip.train.workflow import train
from tests.distributed.workers import small_recipe

REPO = Path(__file__).resolve().parents[2]


def _rank_pid(tag: str, rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DPCLIP_TEST_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def _launch_two_ranks(recipe, tmp_path: Path):
    """`dpclip train RECIPE --nproc 2` as a subprocess whose ranks carry a tag (to find their pids)."""
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe_to_yaml(recipe))
    tag = uuid.uuid4().hex
    env = {**os.environ, "DPCLIP_TEST_TAG": tag, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "dpclip", "train", str(recipe_file), "--nproc", "2", "--threads", "1", "--json"]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return launcher, tag, env


def _steps_written(runs: Path) -> int:
    files = list(runs.glob("*/metrics.jsonl"))
    return len(files[0].read_text().splitlines()) if files else 0


PIPELINE = ["clipping.grouping={stages: ['^1$', '^3$']}"]  # quickstart's MLP cut before its first two Linears


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's pid in /proc")
@pytest.mark.parametrize("parallel", ["data", "pipeline", "fsdp"])
def test_kill_9_of_a_rank_then_resume_gives_the_uninterrupted_ledger(tmp_path, parallel):
    overrides = ["training.steps=60", "checkpoint.every_steps=10", "training.micro_batch_size=4"]
    if parallel == "pipeline":  # the one-process reference clips the same stages in one process
        overrides += PIPELINE
    recipe = small_recipe(tmp_path / "runs", "layer", *overrides, f"training.parallel={parallel}")
    launcher, tag, env = _launch_two_ranks(recipe, tmp_path)
    killed = False
    deadline = time.monotonic() + 600
    while launcher.poll() is None and time.monotonic() < deadline:
        if _steps_written(tmp_path / "runs") >= 12:
            pid = _rank_pid(tag, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.02)
    _, err = launcher.communicate(timeout=600)
    assert killed, "the run ended before rank 1 could be killed"
    assert launcher.returncode != 0
    assert "error: rank 1 was killed by SIGKILL" in err and "hint:" in err
    run_dir = next((tmp_path / "runs").iterdir())
    assert f"dpclip train --resume {run_dir} --nproc 2" in err.replace("\n", "")
    ledger_after_kill = json.loads((run_dir / "ledger.json").read_text())  # whole, never half written
    assert 12 <= sum(e["count"] for e in ledger_after_kill["entries"]) < 60

    resumed = subprocess.run([sys.executable, "-m", "dpclip", "train", "--resume", str(run_dir), "--nproc", "2",
                              "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr

    reference = train(small_recipe(tmp_path / "one", "layer", *overrides), run_dir=tmp_path / "one" / "run")
    assert reference.steps_done == 60
    ours = json.loads((run_dir / "ledger.json").read_text())
    theirs = json.loads((reference.run_dir / "ledger.json").read_text())
    assert ours == theirs


@pytest.mark.slow
def test_two_nodes_through_torchrun_rendezvous_flags_on_one_machine(tmp_path):
    """What docs/distributed.md tells a user of several machines, with both "nodes" here."""
    from tests.distributed.ranks import free_port

    recipe = small_recipe(tmp_path / "runs", "layer")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe_to_yaml(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
                               "-m", "dpclip", "train", str(recipe_file), "--threads", "1", "--json"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    run_dir = next((tmp_path / "runs").iterdir())
    reference = train(small_recipe(tmp_path / "one", "layer"), run_dir=tmp_path / "one" / "run")
    assert json.loads((run_dir / "ledger.json").read_text()) == json.loads((reference.run_dir / "ledger.json").read_text())


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_stops_every_rank_cleanly_and_resume_completes(tmp_path):
    """SIGINT to `dpclip train --nproc 2` (what Ctrl-C in a terminal sends it; the ranks are in
    their own sessions): one error line, no traceback, exit 130, every rank gone; `--resume`
    then trains the remaining steps and the ledger holds the plan's count."""
    overrides = ["training.steps=40", "checkpoint.every_steps=100"]
    recipe = small_recipe(tmp_path / "runs", "layer", *overrides)
    launcher, tag, env = _launch_two_ranks(recipe, tmp_path)
    deadline = time.monotonic() + 600
    while launcher.poll() is None and time.monotonic() < deadline and _steps_written(tmp_path / "runs") < 5:
        time.sleep(0.02)
    assert launcher.poll() is None, "the run ended before it could be interrupted"
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 130, err
    assert "Traceback" not in err and "SignalException" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 2, err  # one error and its hint: no rank's own line, no agent log
    assert lines[0].startswith("error: interrupted at step ") and "a checkpoint was saved" in lines[0]
    run_dir = next((tmp_path / "runs").iterdir())
    assert lines[1] == f"hint: continue with: dpclip train --resume {run_dir} --nproc 2"
    stopped_at = int(lines[0].split("step ")[1].split(";")[0])
    assert 5 <= stopped_at < 40 and json.loads(out)["stopped"] == "interrupted"
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == f"step_{stopped_at:06d}"
    assert _rank_pid(tag, 0) is None and _rank_pid(tag, 1) is None  # no rank left behind

    resumed = subprocess.run([sys.executable, "-m", "dpclip", "train", "--resume", str(run_dir), "--nproc", "2",
                              "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["stopped"] == "completed"
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert sum(entry["count"] for entry in ledger["entries"]) == 40
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval" not in r] == list(range(1, 41))  # each step written once


@pytest.mark.slow
@pytest.mark.parametrize("parallel, line", [("data", "distribution:"), ("fsdp", "distribution:")])
def test_a_dry_run_with_nproc_plans_the_processes_it_names(tmp_path, parallel, line):
    """`--dry-run --nproc 2` runs the two ranks' dry runs: an FSDP recipe is not refused as "one
    process", and the statement has the distribution line of two processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "dpclip", "train", str(REPO / "recipes" / "quickstart.yaml"),
                           f"training.parallel={parallel}", f"output_dir={tmp_path / 'runs'}", "--dry-run",
                           "--nproc", "2", "--threads", "1", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    statement = json.loads(done.stdout)["statement"]
    assert any(s.startswith(line) and "2" in s for s in statement), statement
    assert not (tmp_path / "runs").exists()   # a dry run writes nothing
