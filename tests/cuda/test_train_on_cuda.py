"""``dpclip train`` with ``training.device: cuda`` (skipped without a GPU; docs/training.md, "Device").

A run on the GPU must account exactly as the same run on the CPU (the ledger is the plan's,
whatever the device), record its device, and resume bit for bit from a checkpoint: the
checkpoint holds the GPU's noise and dropout generator states, and the steps after it are
redone with them (a difference would stop the resume, tests/train/test_workflow.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpclip.accounting import Ledger
from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore:unsafe_seed")]
REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
SEEDED = ("privacy.unsafe_seeded_randomness=true", "privacy.epsilon=null", "privacy.noise_multiplier=1.0")


def _weights(run_dir: Path, step: str | None = None) -> dict[str, torch.Tensor]:
    latest = step or (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def _ledger(run_dir: Path) -> Ledger:
    return Ledger.from_dict(json.loads((run_dir / "ledger.json").read_text()))


def test_a_cuda_run_accounts_as_on_the_cpu_and_resumes_to_the_run_that_never_stopped(small_recipe, tmp_path):
    full = train(small_recipe("training.device=cuda", *SEEDED)).run_dir
    assert json.loads((full / "meta.json").read_text())["plan"]["device"].startswith("cuda")
    on_cpu = train(small_recipe("training.device=cpu", *SEEDED)).run_dir
    assert _ledger(full) == _ledger(on_cpu)
    # As if killed right after step 10: checkpoint 8 is the latest, the ledger counts 10 steps.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    (cut / "checkpoints" / "LATEST").write_text("step_000008\n")
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= 10))
    resumed = train(resume=cut)
    assert resumed.steps_done == 12 and _ledger(cut) == _ledger(full)
    a, b = _weights(full), _weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp16_trains_on_cuda_with_the_ledger_of_fp32(small_recipe):
    fp16 = train(small_recipe("training.device=cuda", "training.precision=fp16", "training.steps=3",
                              "eval.every_steps=null"))
    fp32 = train(small_recipe("training.device=cuda", "training.steps=3", "eval.every_steps=null"))
    assert fp16.stopped == "completed" and fp16.epsilon == fp32.epsilon
    assert all(value == value for value in fp16.final_eval.values())  # no NaN


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_takes_two_private_steps_on_cuda(path, tmp_path):
    public = ["continual.switch.max_public_steps=3"] if "\ncontinual:" in path.read_text() else []
    steps = max(2, load_recipe(path).privacy.mechanism.bands)
    recipe = load_recipe(path, [f"output_dir={tmp_path}", "training.epochs=null", f"training.steps={steps}",
                                "eval.every_steps=null", "eval.batch_size=512", "training.device=cuda", *public])
    result = train(recipe)
    assert result.stopped == "completed" and result.steps_done == steps
    assert result.final_eval and all(value == value for value in result.final_eval.values())
