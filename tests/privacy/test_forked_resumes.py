"""Two continuations of one checkpoint must not draw the same noise for their new steps.

The attacker holds two models continued from one checkpoint (a copy of a run directory
resumed beside the original, a make_private checkpoint copied with its release log and loaded
twice, a DPTrainer checkpoint resumed twice), trained on the same data with the same lr. Had both drawn the checkpoint's
noise stream for their new steps, each weight of one would equal the other's: the same batch,
the same noise, the same gradient. With fresh streams (OS entropy, dpclip.rng.fork_private_streams)
after the redone steps, they differ by fresh noise. The redone steps themselves still replay the
checkpoint's streams (checked against what was released: test_crash_and_resume.py, and the
DPTrainer's release log here). A seeded run's forks share the stream, as its seed says.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.train.workflow import train
from tests.privacy.test_crash_and_resume import _crashed_copy, _records

SEEDED = "privacy.unsafe_seeded_randomness=true"


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "model.safetensors")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("seeded", [False, True])
def test_two_copies_of_a_crashed_run_directory_resumed_draw_independent_noise_after_the_redone_steps(
        tiny_recipe, tmp_path, seeded):
    recipe = tiny_recipe("training.steps=6", "checkpoint.every_steps=2", "checkpoint.keep=5",
                         *([SEEDED] if seeded else []))
    full = train(recipe).run_dir
    first = _crashed_copy(full, tmp_path / "first", checkpoint_step=2, crash_step=3)
    second = tmp_path / "second"
    shutil.copytree(first, second)
    train(resume=first)
    train(resume=second)
    # step 3 was released before the crash: both copies redo it exactly (else the resume stops)
    redone = [r for r in _records(full / "metrics.jsonl") if r["step"] <= 3]
    for copy in (first, second):
        assert [r for r in _records(copy / "metrics.jsonl") if r["step"] <= 3] == redone
    assert _same(_final_weights(first), _final_weights(second)) == seeded
    assert _same(_final_weights(first), _final_weights(full)) == seeded
    # each stream itself, not only the weights (fresh batches alone would move them, the noise shared)
    streams = [_final_state(copy) for copy in (first, second)]
    for name in ("engine.noise.states.cpu", "sampler.generator"):
        assert torch.equal(streams[0][name], streams[1][name]) == seeded, name


def _final_state(run_dir) -> dict[str, torch.Tensor]:
    return load_file(sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "state.safetensors")


def _loader_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g))


def _private(unsafe_seed: int | None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(_loader_data(), batch_size=16), criterion=nn.CrossEntropyLoss(),
                               delta=1e-5, noise_multiplier=1.0, steps=10, max_grad_norm=1.0,
                               unsafe_seed=unsafe_seed)


def _one_step(private) -> list[torch.Tensor]:
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("unsafe_seed", [None, 5])
def test_a_make_private_checkpoint_loaded_twice_continues_into_independent_noise(tmp_path, unsafe_seed):
    original = _private(unsafe_seed)
    _one_step(original)
    original.save_checkpoint(tmp_path / "run" / "c.pt")
    shutil.copytree(tmp_path / "run", tmp_path / "copy")   # with its release log, before either goes on
    forks, noise, draws = [], [], []
    for folder in ("run", "copy"):
        fork = _private(unsafe_seed)
        fork.load_checkpoint(tmp_path / folder / "c.pt")
        forks.append(_one_step(fork))
        noise.append(fork.engine.noise.state_dict()["states"]["cpu"].clone())
        draws.append(fork.draws.generator.get_state().clone())
    same = all(torch.equal(a, b) for a, b in zip(*forks))
    assert same == (unsafe_seed is not None)
    # each stream itself, not only the weights (fresh batches alone would move them, the noise shared)
    assert torch.equal(*noise) == torch.equal(*draws) == (unsafe_seed is not None)
    assert forks[0][0].shape == (8, 5) and fork.ledger.steps == 2


@pytest.mark.slow  # two resumed end-to-end Trainer runs: the slow set (README)
def test_a_dptrainer_checkpoint_resumed_twice_redoes_its_released_step_then_draws_independent_noise(tmp_path):
    from tests.integrations.test_transformers import _CrashAfter, _trainer

    crashed = _trainer(tmp_path / "run", max_steps=6, save_strategy="steps", save_steps=2)
    crashed.add_callback(_CrashAfter(2))   # checkpoint-2 on disk, step 3 released (in the release log)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    weights, noise, draws = [], [], []
    for folder in ("run", "copy"):
        resumed = _trainer(tmp_path / folder, max_steps=6, save_strategy="steps", save_steps=2)
        resumed.train(resume_from_checkpoint=True)   # step 3 redone: checked against the log, else refused
        assert resumed.account.ledger.steps == 6
        weights.append([p.detach().clone() for p in resumed.model.parameters()])
        noise.append(resumed.engine.noise.state_dict()["states"]["cpu"].clone())
        draws.append(resumed._sampler().draws.generator.get_state().clone())
    assert not all(torch.equal(a, b) for a, b in zip(*weights))
    assert not torch.equal(*noise) and not torch.equal(*draws)   # each stream itself, not only the weights


def test_fork_private_streams_renews_every_os_entropy_stream_and_leaves_seeded_ones():
    from dpclip.data.sampler import PoissonSampler
    from dpclip.engine.noise import NoiseSource
    from dpclip.rng import fork_private_streams

    holders = [NoiseSource(), PoissonSampler(30, 0.2, 5), NoiseSource(seed=1), PoissonSampler(30, 0.2, 5, seed=1)]
    holders[0].generator(torch.device("cpu"))
    holders[2].generator(torch.device("cpu"))
    generators = [holders[0].generator(torch.device("cpu")), holders[1].generator,
                  holders[2].generator(torch.device("cpu")), holders[3].generator]
    before = [g.get_state().clone() for g in generators]
    assert fork_private_streams(*holders, None)
    changed = [not torch.equal(b, g.get_state()) for b, g in zip(before, generators)]
    assert changed == [True, True, False, False]
    assert not fork_private_streams(holders[2], holders[3])


def test_a_renewed_shuffle_sampler_finishes_its_epoch_with_the_same_examples_in_a_fresh_order():
    from dpclip.data.sampler import ShuffleSampler
    from dpclip.rng import fork_private_streams

    sampler = ShuffleSampler(60, 6, 10)
    batches = iter(sampler)
    seen = [next(batches) for _ in range(3)]
    rest = sampler.permutation[sampler.position:].clone()
    fork_private_streams(sampler)
    assert sorted(sampler.permutation[sampler.position:].tolist()) == sorted(rest.tolist())
    assert not torch.equal(sampler.permutation[sampler.position:], rest)   # 42! orders: equal by chance ~1e-51
    seen += [next(batches) for _ in range(7)]
    assert sorted(torch.cat(seen).tolist()) == list(range(60))   # one epoch: each example once


def _private_with_workers(unsafe_seed: int | None, workers: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(_loader_data(), batch_size=16, num_workers=workers),
                               criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=6,
                               max_grad_norm=1.0, unsafe_seed=unsafe_seed)


def _steps(private, count: int) -> list[torch.Tensor]:
    model, optimizer, criterion, loader = private
    batches = []
    for x, y in loader:
        batches.append(x)
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        if len(batches) == count:
            break
    return batches


def test_a_checkpoint_taken_while_loader_workers_fetch_ahead_holds_the_draws_the_loop_took(tmp_path):
    """Two workers fetch up to 4 batches ahead of the loop: the checkpoint's sampler must be the one
    after the 2 draws taken (it held 6, so a resume lost 4 planned steps and, being past the point
    where its stream is renewed, two resumes drew the same batches)."""
    whole = _steps(_private_with_workers(3, workers=0), 6)   # seeded: the draws a resume must go on with
    first = _private_with_workers(3, workers=2)
    assert [len(x) for x in _steps(first, 2)] == [len(x) for x in whole[:2]]
    path = first.save_checkpoint(tmp_path / "c.pt")
    state = torch.load(path, weights_only=True)
    assert state["sampler"]["step"] == state["draws"] == 2
    resumed = _private_with_workers(3, workers=2)
    resumed.load_checkpoint(path)
    rest = _steps(resumed, 4)
    assert len(rest) == 4 and all(torch.equal(a, b) for a, b in zip(rest, whole[2:]))
    assert resumed.ledger.steps == 6


def test_a_dptrainer_checkpoint_with_loader_workers_holds_the_draws_its_steps_took(tmp_path):
    from tests.integrations.test_transformers import _trainer

    trainer = _trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, dataloader_num_workers=2)
    trainer.train()
    state = torch.load(tmp_path / "out" / "checkpoint-2" / "dpclip_state_rank0.pt", weights_only=True)
    assert state["steps"] == 2 and state["sampler"]["step"] == 2   # the workers had fetched ahead
