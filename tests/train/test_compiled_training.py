"""training.compile end to end (docs/compiled.md): a run whose micro-batches go
through one inductor-compiled graph trains, charges every step and resumes (a new process: its
first micro-batch runs through the engine again, checked, and the graph must match it)."""

from __future__ import annotations

import shutil

import pytest

from dpclip.rundir.run import spent
from dpclip.train.workflow import train


@pytest.mark.slow   # inductor compiles the MLP's micro-batch: about 30 s
def test_a_compiled_run_trains_charges_every_step_and_resumes(small_recipe, tmp_path):
    result = train(small_recipe("training.compile=true", "training.micro_batch_size=32"))
    assert result.stopped == "completed" and result.steps_done == 12
    assert spent(result.run_dir)[0].steps == 12
    cut = tmp_path / "cut"   # as if stopped after checkpoint 8
    shutil.copytree(result.run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    (cut / "checkpoints" / "LATEST").write_text("step_000008\n")
    resumed = train(resume=cut)
    assert resumed.steps_done == 12 and spent(cut)[0].steps >= 12
