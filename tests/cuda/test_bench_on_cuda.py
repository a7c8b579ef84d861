"""``dpclip bench`` of a recipe with ``training.device: cuda`` measures on the GPU (skipped without one)."""

from pathlib import Path

import pytest
import torch

from dpclip.bench import NON_PRIVATE, bench_recipe

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_bench_times_and_measures_a_gpu_recipe_on_the_gpu():
    result = bench_recipe(RECIPES / "quickstart.yaml", ["training.device=cuda", "training.batch_size=16"],
                          repeats=2, warmup=1, threads=None)
    assert result.settings["device"].startswith("cuda")
    assert result.ratio[NON_PRIVATE] == 1.0 and all(0 < r < 100 for r in result.ratio.values())
    # the private steps hold per-sample quantities the non-private one does not
    assert all(mib > 0 for mib in result.memory_mib.values())
    assert result.floor["floor"] >= 1.0
