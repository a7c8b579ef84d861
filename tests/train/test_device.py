"""``training.device``: named in the recipe, resolved before anything is written, kept on resume
(docs/training.md, "Device"). The GPU runs themselves are in tests/cuda/test_train_on_cuda.py."""

import json

import pytest
import torch

from dpclip.errors import DpclipError, RecipeError
from dpclip.recipe import load_recipe
from dpclip.train.device import check_resume_device, recorded_device, resolve_device
from dpclip.train.workflow import train
from tests.conftest import REPO

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12", "auto"])
def test_device_names_a_recipe_may_give(name):
    assert load_recipe(REPO / "recipes" / "quickstart.yaml", [f"training.device={name}"]).training.device == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "mps", "cpu:0", "cuda:-1", "0"])
def test_other_device_names_are_refused_with_the_ones_there_are(name):
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / "recipes" / "quickstart.yaml", [f"training.device={name}"])
    assert "training.device" in info.value.message and "cuda:N" in info.value.message


def test_the_default_device_is_the_cpu():
    assert load_recipe(REPO / "recipes" / "quickstart.yaml").training.device == "cpu"
    assert resolve_device("cpu") == torch.device("cpu")


@NO_CUDA
def test_a_recipe_asking_for_a_gpu_this_machine_lacks_stops_before_writing_anything(cli, tmp_path):
    runs = tmp_path / "runs"
    result = cli("train", REPO / "recipes" / "quickstart.yaml", f"output_dir={runs}", "training.device=cuda")
    assert result.code == 2
    assert "error: training.device is cuda, but torch sees no CUDA device" in result.err
    assert "hint:" in result.err and "training.device=cpu" in result.err and "Traceback" not in result.err
    assert not runs.exists()


@NO_CUDA
def test_auto_trains_on_the_cpu_of_a_machine_without_a_gpu():
    assert resolve_device("auto") == torch.device("cpu")


def test_several_processes_train_on_the_cpu_whatever_the_machine_has():
    assert resolve_device("auto", world_size=2) == torch.device("cpu")
    with pytest.raises(DpclipError) as info:
        resolve_device("cuda:0", world_size=2)
    assert "2 processes runs on the CPU only" in info.value.message and "training.device=cpu" in info.value.hint


def test_a_resume_on_another_kind_of_device_is_refused():
    with pytest.raises(DpclipError) as info:
        check_resume_device("cuda:0", torch.device("cpu"))
    assert "trained on cuda:0" in info.value.message and "training.device=cuda" in info.value.hint
    with pytest.raises(DpclipError):
        check_resume_device("cpu", torch.device("cuda", 0))
    with pytest.raises(DpclipError):  # a run from before the setting trained on the CPU
        check_resume_device(None, torch.device("cuda", 0))
    check_resume_device("cuda:1", torch.device("cuda", 0))  # another GPU of the same kind: the replay check decides
    check_resume_device(None, torch.device("cpu"))


def test_a_run_records_its_device_and_its_resume_checks_it(small_recipe):
    run = train(small_recipe("training.steps=2", "checkpoint.every_steps=1", "eval.every_steps=null")).run_dir
    meta = json.loads((run / "meta.json").read_text())
    assert meta["plan"]["device"] == "cpu" and recorded_device(run) == "cpu"
    # What a GPU machine would record for a recipe's cuda.
    meta["plan"]["device"] = "cuda:0"
    (run / "meta.json").write_text(json.dumps(meta))
    expected = ("trained on cuda:0, and this resume would train on cpu" if torch.cuda.is_available()
                else "the run trained on cuda:0, and torch sees no CUDA device on this machine")
    with pytest.raises(DpclipError, match=expected) as info:
        train(resume=run)
    assert "--resume" not in info.value.message and info.value.hint
    del meta["plan"]["device"]  # a run from before the setting trained on the CPU
    (run / "meta.json").write_text(json.dumps(meta))
    assert recorded_device(run) == "cpu"


@NO_CUDA
def test_a_gpu_run_is_not_resumed_on_a_machine_without_one_whatever_the_recipe_says():
    for spec in ("cpu", "auto", "cuda"):
        with pytest.raises(DpclipError, match="the run trained on cuda:0, and torch sees no CUDA device"):
            resolve_device(spec, trained_on="cuda:0")
    assert resolve_device("auto", trained_on="cpu") == torch.device("cpu")


def test_the_start_table_names_the_device_a_run_trains_on(cli):
    result = cli("train", REPO / "recipes" / "quickstart.yaml", "--dry-run", "training.device=auto")
    expected = "cuda:" if torch.cuda.is_available() else "cpu"
    assert result.code == 0
    assert any(line.split()[:1] == ["device"] and expected in line for line in result.out.splitlines()), result.out


def test_a_damaged_meta_json_is_named_with_a_hint_before_the_resume_reads_its_device(tmp_path):
    # `dpclip train --resume RUN` with meta.json overwritten by binary crashed (UnicodeDecodeError)
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    (tmp_path / "meta.json").write_bytes(bytes(range(200, 256)))
    with pytest.raises(DpclipError) as info:
        recorded_device(tmp_path)
    assert "meta.json" in info.value.message and "damaged" in info.value.message and info.value.hint
