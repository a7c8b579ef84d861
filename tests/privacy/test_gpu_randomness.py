"""The attack of test_randomness.py on a run that trains on a GPU (``training.device: cuda``;
skipped without one): the attacker holds the recipe (its seed), the released model and
knows the run used a GPU. The default run's noise, drawn by the GPU's own generator, must
not be regenerable from the seed; the opt-in run's must be (the attack's power)."""

from __future__ import annotations

import pytest
import torch

from dpclip.rng import seeded_generator
from tests.privacy.test_randomness import SIGMA, _gradient_from_released_model, _one_step_run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore:unsafe_seed")]


def _guesses(grads: list[torch.Tensor], std: float, seed: int) -> list[list[torch.Tensor]]:
    """The noise as the attacker regenerates it from the seed on the GPU: each generator
    scheme, drawn tensor by tensor, or packed in one flat draw (the engine packs small
    tensors into one draw on a GPU), scaled by the draw or after it."""
    sizes = [g.numel() for g in grads]
    guesses = []
    for make in (lambda: torch.Generator("cuda").manual_seed(seed),
                 lambda: seeded_generator(seed, "gradient-noise", "cuda")):
        generator = make()
        guesses.append([torch.empty(g.shape, device="cuda").normal_(0.0, std, generator=generator).cpu()
                        for g in grads])
        flat = torch.empty(sum(sizes), device="cuda").normal_(0.0, std, generator=make()).cpu()
        guesses.append(list(flat.split(sizes)))
        unit = torch.empty(sum(sizes), device="cuda").normal_(generator=make()).cpu() * std
        guesses.append(list(unit.split(sizes)))
    return [[n.view(g.shape) for n, g in zip(guess, grads)] for guess in guesses]


def _best_residual(recipe, run_dir) -> float:
    """min over the attacker's guesses of ||B·(gradient − guessed noise)||: at most |batch|·C if one is right."""
    grads = _gradient_from_released_model(recipe, run_dir)
    batch = recipe.training.batch_size
    return min(float(torch.cat([(g - n).flatten() for g, n in zip(grads, guess)]).norm()) * batch
               for guess in _guesses(grads, SIGMA * 1.0 / batch, recipe.seed))


def test_a_gpu_runs_noise_cannot_be_regenerated_from_the_recipe(tiny_recipe):
    recipe, run_dir = _one_step_run(tiny_recipe, "training.device=cuda")
    assert _best_residual(recipe, run_dir) > 6 * recipe.training.batch_size


def test_a_seeded_opt_in_gpu_runs_noise_is_regenerated_by_the_same_attack(tiny_recipe):
    recipe, run_dir = _one_step_run(tiny_recipe, "training.device=cuda", "privacy.unsafe_seeded_randomness=true")
    assert _best_residual(recipe, run_dir) <= 3 * recipe.training.batch_size
