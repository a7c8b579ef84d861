"""The attacker holds the recipe (so its seed), the run's released files and the model.

With the default settings they must not be able to regenerate the gradient noise or the
Poisson batches. Each attack below is run twice: against a default run (it must fail)
and against a run that opted in to ``privacy.unsafe_seeded_randomness`` (it must work:
that shows the attack has the power to detect a leak)."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from dpclip.data import load_data
from dpclip.models import build_model
from dpclip.rng import derived_seed, entropy_generator, private_random, seeded_generator
from dpclip.train.workflow import train

# Large noise: a failed subtraction leaves a residual of norm ≈ sqrt(2d)·σ·C ≈ 980 (d = 1210
# parameters), far above any clipped sum (≤ |batch|·C ≈ 64).
SIGMA = 20.0


def _one_step_run(tiny_recipe, *overrides):
    recipe = tiny_recipe("training.steps=1", "privacy.epsilon=null", f"privacy.noise_multiplier={SIGMA}",
                         "clipping.grouping=all-layer", "training.optimizer={kind: sgd, lr: 1.0}",
                         "checkpoint.every_steps=null", *overrides)
    return recipe, train(recipe).run_dir


def _gradient_from_released_model(recipe, run_dir) -> list[torch.Tensor]:
    """SGD with lr 1: the released weights minus the initial ones (rebuilt from the recipe's seed)."""
    from safetensors.torch import load_file

    data = load_data(recipe.data, seed=recipe.seed)
    model, _ = build_model(recipe.model, data, seed=recipe.seed)
    final = load_file(str(run_dir / "checkpoints" / "step_000001" / "model.safetensors"))
    return [(p.detach() - final[name]) for name, p in model.named_parameters()]


def _regenerated_noise(grads, std, generator) -> list[torch.Tensor]:
    return [torch.empty(g.shape).normal_(0.0, std, generator=generator) for g in grads]


def _attack_residual_norm(recipe, run_dir, generator) -> float:
    """||B·(grad − guessed noise)||: the clipped sum (norm ≤ |batch|·C) if the guess is right."""
    grads = _gradient_from_released_model(recipe, run_dir)
    batch, threshold = recipe.training.batch_size, 1.0
    noise = _regenerated_noise(grads, SIGMA * threshold / batch, generator)
    residual = torch.cat([(g - n).flatten() for g, n in zip(grads, noise)]) * batch
    return float(residual.norm())


def _attacker_generators(seed: int):
    """Every way the attacker can think of to turn the recipe's seed into the noise stream."""
    main_style = torch.Generator()
    main_style.manual_seed(seed)
    return {"manual_seed(seed)": main_style,
            "seeded_generator(seed)": seeded_generator(seed, "gradient-noise")}


def test_default_run_noise_cannot_be_regenerated_from_the_recipe(tiny_recipe):
    recipe, run_dir = _one_step_run(tiny_recipe)
    batch_bound = 3 * recipe.training.batch_size  # |batch|·C, generously
    for name, generator in _attacker_generators(recipe.seed).items():
        assert _attack_residual_norm(recipe, run_dir, generator) > 2 * batch_bound, name


def test_seeded_opt_in_run_noise_is_regenerated_by_the_same_attack(tiny_recipe):
    recipe, run_dir = _one_step_run(tiny_recipe, "privacy.unsafe_seeded_randomness=true")
    batch_bound = 3 * recipe.training.batch_size
    residual = _attack_residual_norm(recipe, run_dir, _attacker_generators(recipe.seed)["seeded_generator(seed)"])
    assert residual <= batch_bound


def _attacker_batch_sizes(seed: int, num_train: int, rate: float, steps: int) -> list[list[int]]:
    """Realised batch sizes predicted from the seed, under each seed-derivation scheme."""
    predictions = []
    old = torch.Generator()
    old.manual_seed(derived_seed(seed, "poisson-sampler"))
    for generator, dtype in ((old, torch.float32), (seeded_generator(seed, "poisson-sampler"), torch.float64)):
        sizes = [int((torch.rand(num_train, generator=generator, dtype=dtype) < rate).sum()) for _ in range(steps)]
        predictions.append(sizes)
    return predictions


@pytest.mark.parametrize("opt_in", [False, True])
def test_batches_cannot_be_predicted_from_the_recipe_unless_opted_in(tiny_recipe, opt_in):
    extra = ["privacy.unsafe_seeded_randomness=true"] if opt_in else []
    recipe = tiny_recipe("training.steps=12", "checkpoint.every_steps=null", *extra)
    run_dir = train(recipe).run_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    released = [r["diagnostics"]["batch_size"] for r in records if "diagnostics" in r]
    meta = json.loads((run_dir / "meta.json").read_text())
    predicted = _attacker_batch_sizes(recipe.seed, meta["plan"]["num_train"], meta["plan"]["sample_rate"], 12)
    # Twelve Binomial(1438, 0.0445) sizes (sd ≈ 7.8) all equal by chance: probability < 1e-12.
    assert (released in predicted) == opt_in


@pytest.mark.parametrize("opt_in", [False, True])
def test_members_cannot_be_recomputed_from_the_released_recipe_unless_opted_in(tiny_recipe, opt_in):
    """The attacker re-splits the data with the released recipe's seed (the split every workflow used
    to draw from it) and compares with the members meta.json (secret) lists."""
    import numpy as np
    import yaml

    from dpclip.data.split import split_indices

    extra = ["privacy.unsafe_seeded_randomness=true"] if opt_in else []
    recipe = tiny_recipe("training.steps=1", "checkpoint.every_steps=null", *extra)
    run_dir = train(recipe).run_dir
    released = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    meta = json.loads((run_dir / "meta.json").read_text())
    members = np.asarray(meta["members"])
    total = len(members) + len(meta["non_members"])
    guess, _ = split_indices(total, released["data"]["test_fraction"], released["seed"])
    # 1438 of 1797 digits: a random split matching the seeded one exactly has probability ~0
    assert np.array_equal(guess, members) == opt_in
    # and the run's own audit rebuilds its members from the stored key either way
    from dpclip.audit.report import build_pool
    from dpclip.recipe import load_recipe
    pool = build_pool(run_dir, load_recipe(run_dir / "recipe.yaml"))
    assert int(pool.is_member.sum()) == len(members)


def test_two_default_runs_of_one_recipe_draw_different_noise_and_the_opt_in_the_same(tiny_recipe):
    def gradient(*overrides):
        recipe, run_dir = _one_step_run(tiny_recipe, *overrides)
        return torch.cat([g.flatten() for g in _gradient_from_released_model(recipe, run_dir)])

    assert not torch.equal(gradient(), gradient())
    seeded = "privacy.unsafe_seeded_randomness=true"
    assert torch.equal(gradient(seeded), gradient(seeded))


def _mt_words(generator: torch.Generator) -> list[int]:
    raw = generator.get_state().numpy().tobytes()
    return [struct.unpack_from("<Q", raw, 24 + 8 * i)[0] for i in range(624)]


def _follows_mt_seeding(words: list[int]) -> bool:
    """MT19937 seeded with a 32-bit s has state[i] = 1812433253·(state[i−1] ^ state[i−1] >> 30) + i."""
    return all(words[i] == (1812433253 * (words[i - 1] ^ (words[i - 1] >> 30)) + i) & 0xFFFFFFFF
               for i in range(1, 624))


def test_entropy_generator_fills_the_whole_state_not_a_32_bit_seed():
    seeded = torch.Generator()
    seeded.manual_seed(2 ** 63 - 25)
    assert _follows_mt_seeding(_mt_words(seeded))  # the check recognises a seeded state
    assert not _follows_mt_seeding(_mt_words(entropy_generator()))


def test_generator_from_words_holds_exactly_those_words_and_draws_from_them():
    from dpclip.rng import _cpu_generator_from_words

    words = os.urandom(4 * 624)
    want = [int.from_bytes(words[4 * i:4 * i + 4], "little") for i in range(624)]
    generator = _cpu_generator_from_words(words)
    assert _mt_words(generator) == want                       # every word, in order, none shifted
    twin = _cpu_generator_from_words(words)
    assert torch.equal(torch.rand(64, generator=generator), torch.rand(64, generator=twin))
    flipped = bytearray(words)
    flipped[4 * 623] ^= 1                                     # the last word reaches the stream too
    assert _mt_words(_cpu_generator_from_words(bytes(flipped)))[623] == want[623] ^ 1


def test_manual_seed_keeps_32_bits_but_seeded_generator_uses_every_bit():
    low, high = torch.Generator(), torch.Generator()
    low.manual_seed(7)
    high.manual_seed(7 + 2 ** 32)
    assert torch.equal(torch.rand(8, generator=low), torch.rand(8, generator=high))  # the weakness
    a = torch.rand(8, generator=seeded_generator(7, "gradient-noise"))
    b = torch.rand(8, generator=seeded_generator(7 + 2 ** 32, "gradient-noise"))
    c = torch.rand(8, generator=seeded_generator(7 + 2 ** 62, "gradient-noise"))
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_private_generators_come_from_os_urandom(monkeypatch):
    """Fixing os.urandom fixes every private stream; nothing else (time, seed) enters."""
    from dpclip.data import PoissonSampler
    from dpclip.engine.noise import NoiseSource

    def draws():
        sampler = PoissonSampler(1000, 0.1, 3)
        noise = torch.randn(50, generator=NoiseSource().generator(torch.device("cpu")))
        search = private_random(None, "search").random()
        return [b.tolist() for b in sampler], noise, search

    monkeypatch.setattr("os.urandom", lambda n: bytes(range(256)) * (n // 256) + bytes(range(n % 256)))
    first, second = draws(), draws()
    assert first[0] == second[0] and torch.equal(first[1], second[1]) and first[2] == second[2]
    monkeypatch.undo()
    third = draws()
    assert third[0] != first[0] and not torch.equal(third[1], first[1])


def test_split_generators_follow_the_parent_and_differ_from_each_other():
    from dpclip.rng import split_generator

    def streams(parent):
        return [torch.rand(16, generator=g) for g in split_generator(parent, 4, "gradient-noise")]

    a = streams(seeded_generator(3, "gradient-noise"))
    b = streams(seeded_generator(3, "gradient-noise"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))           # the parent's state decides
    assert len({tuple(x.tolist()) for x in a}) == 4                # four different streams
    parent = seeded_generator(3, "gradient-noise")
    first, second = streams(parent), streams(parent)               # the split advances the parent
    assert not torch.equal(first[0], second[0])
    other = streams(seeded_generator(4, "gradient-noise"))
    assert not torch.equal(other[0], a[0])
    fresh = streams(entropy_generator())
    assert not any(torch.equal(x, y) for x, y in zip(fresh, a))
