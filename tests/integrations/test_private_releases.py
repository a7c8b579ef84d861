"""make_private's release log: the steps after a checkpoint are redone as they were released, or
refused (dpclip/integrations/releases.py; docs/python-api.md, "Checkpoints")."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError

LOG = "dpclip_releases.jsonl"


def _private(unsafe_seed: int | None = None, dropout: float = 0.0, poisson_sampling: bool = True):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g))
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(dropout), nn.Tanh(), nn.Linear(8, 3))
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=16),
                               criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=10,
                               max_grad_norm=1.0, unsafe_seed=unsafe_seed, poisson_sampling=poisson_sampling)


def _steps(private, count: int) -> list[list[torch.Tensor]]:
    """``count`` steps; the weights after each (what a loop that logs or saves the model releases)."""
    model, optimizer, criterion, loader = private
    released = []
    while len(released) < count:
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            released.append([p.detach().clone() for p in model.parameters()])
            if len(released) == count:
                break
    return released


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _crashed(folder, dropout: float = 0.0, after: int = 2, lost: int = 2):
    """A run checkpointed after ``after`` steps that released ``lost`` more, then crashed."""
    run = _private(dropout=dropout)
    _steps(run, after)
    path = run.save_checkpoint(folder / "c.pt")
    return path, _steps(run, lost)


def _records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / LOG).read_text().splitlines()]


def test_each_step_after_the_first_checkpoint_logs_its_fingerprint_under_the_runs_id(tmp_path):
    path, _ = _crashed(tmp_path, after=2, lost=3)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [3, 4, 5]   # none before the first checkpoint
    run = torch.load(path, weights_only=True)["run"]
    assert {r["run"] for r in records} == {run} and all(len(r["fingerprint"]) == 2 for r in records)
    assert ((tmp_path / LOG).stat().st_mode & 0o077) == 0


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_loaded_checkpoint_redoes_the_lost_steps_as_released_then_draws_fresh_noise(tmp_path, dropout):
    path, lost = _crashed(tmp_path / "run", dropout=dropout)
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    after = []
    for folder in ("run", "copy"):
        resumed = _private(dropout=dropout)
        resumed.load_checkpoint(tmp_path / folder / "c.pt")
        redone = _steps(resumed, 3)
        assert _equal(redone[0], lost[0]) and _equal(redone[1], lost[1])   # the same batches, noise, dropout
        assert resumed.ledger.steps == 5
        after.append(redone[2])
    assert not _equal(*after)   # step 5 is new in each: fresh streams


def test_a_redone_step_that_releases_another_gradient_is_refused_before_it_is_applied(tmp_path):
    path, lost = _crashed(tmp_path, dropout=0.5)
    resumed = _private(dropout=0.5)
    resumed.load_checkpoint(path)
    torch.rand(1)   # a draw outside the checkpoint's streams: step 3's dropout mask moves
    before = [p.detach().clone() for p in resumed.model.parameters()]
    with pytest.raises(DpclipError, match="did not reproduce step 3") as caught:
        _steps(resumed, 1)
    assert caught.value.hint
    assert _equal(before, [p.detach() for p in resumed.model.parameters()]) and resumed.ledger.steps == 2


def test_a_checkpoint_without_its_release_log_beside_it_is_refused(tmp_path):
    path, _ = _crashed(tmp_path / "run")
    (tmp_path / "moved").mkdir()
    shutil.copy(path, tmp_path / "moved" / "c.pt")
    resumed = _private()
    with pytest.raises(DpclipError, match=f"no {LOG}") as caught:
        resumed.load_checkpoint(tmp_path / "moved" / "c.pt")
    assert LOG in caught.value.hint and resumed.ledger.steps == 0
    shutil.copy(tmp_path / "run" / LOG, tmp_path / "moved")   # the hint's way out
    resumed.load_checkpoint(tmp_path / "moved" / "c.pt")
    assert resumed.ledger.steps == 2


def test_a_checkpoint_in_another_folder_than_the_runs_log_is_refused(tmp_path):
    run = _private()
    _steps(run, 1)
    run.save_checkpoint(tmp_path / "a" / "c.pt")
    run.save_checkpoint(tmp_path / "a" / "d.pt")   # another file in the folder: fine
    with pytest.raises(DpclipError, match="beside the log of its released steps") as caught:
        run.save_checkpoint(tmp_path / "b" / "c.pt")
    assert str(tmp_path / "a") in caught.value.hint


def test_two_runs_checkpointed_into_one_folder_redo_only_their_own_steps(tmp_path):
    path, _ = _crashed(tmp_path, after=2, lost=2)
    other = _private()
    _steps(other, 2)
    other.save_checkpoint(tmp_path / "other.pt")
    _steps(other, 6)   # steps 3..8 of another run, in the same log
    assert len({r["run"] for r in _records(tmp_path)}) == 2
    resumed = _private()
    resumed.load_checkpoint(path)
    _steps(resumed, 4)   # 3 and 4 checked against this run's records, 5 and 6 new
    assert resumed.ledger.steps == 6


def test_a_second_continuation_in_the_checkpoints_folder_after_the_first_went_on_is_refused(tmp_path):
    path, _ = _crashed(tmp_path, after=2, lost=1)
    first = _private()
    first.load_checkpoint(path)
    _steps(first, 2)   # step 3 redone, step 4 on fresh streams: no load of c.pt can replay it
    second = _private()
    second.load_checkpoint(path)
    _steps(second, 1)
    with pytest.raises(DpclipError, match="did not reproduce step 4") as caught:
        _steps(second, 1)
    assert "newest checkpoint" in caught.value.hint and second.ledger.steps == 3


def test_a_seeded_run_resumed_after_lost_steps_reaches_the_uninterrupted_runs_weights(tmp_path):
    uninterrupted = _private(unsafe_seed=3, dropout=0.5)
    whole = _steps(uninterrupted, 2) + _steps(uninterrupted, 4)   # the loop as the resumed one runs it
    crashed = _private(unsafe_seed=3, dropout=0.5)
    _steps(crashed, 2)
    path = crashed.save_checkpoint(tmp_path / "c.pt")
    _steps(crashed, 2)
    resumed = _private(unsafe_seed=3, dropout=0.5)
    resumed.load_checkpoint(path)
    assert _equal(_steps(resumed, 4)[-1], whole[-1])


def test_your_own_loaders_batch_redone_otherwise_is_refused(tmp_path):
    """poisson_sampling=False: your loader's place is not in the checkpoint (a new pass starts at its
    first batch), so the redone step 2 takes batch 1 where the lost one took batch 2, with the same
    noise: refused, not released."""
    run = _private(poisson_sampling=False)
    model, optimizer, criterion, loader = run
    for k, (x, y) in enumerate(loader):   # one pass, checkpointed inside it
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        if k == 0:
            path = run.save_checkpoint(tmp_path / "c.pt")
        if k == 1:
            break
    resumed = _private(poisson_sampling=False)
    resumed.load_checkpoint(path)
    with pytest.raises(DpclipError, match="did not reproduce step 2"):
        _steps(resumed, 1)
    assert resumed.ledger.steps == 1
