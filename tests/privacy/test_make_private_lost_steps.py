"""Steps a crashed make_private run released after its checkpoint are not released twice.

The attacker sees every model the loop releases (it logs or saves the weights after each step),
including those of steps 3 and 4 taken after the checkpoint of step 2, lost in a crash. The run
is loaded from that checkpoint and steps 3 and 4 redone. Had they drawn fresh noise (or fresh
batches), each redone model would be a second noisy release of the same steps, charged nowhere:
the ledger holds 4 steps where 6 were released. With the release log they replay the
checkpoint's batches and noise, so each released model equals the lost one bit for bit, and the
ledger's 4 steps are everything that left.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip


def _private(workers: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randint(0, 2, (48,), generator=g))
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.25), nn.ReLU(), nn.Linear(6, 2))
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data, batch_size=12, num_workers=workers),
                               criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=0.8, steps=8,
                               max_grad_norm=1.0)


def _released(private, count: int) -> list[torch.Tensor]:
    """``count`` steps of the classic loop; the model it releases after each, flattened."""
    model, optimizer, criterion, loader = private
    seen = []
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        seen.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        if len(seen) == count:
            return seen
    raise AssertionError("the loader ran out")


def test_the_models_redone_after_a_crash_equal_the_lost_ones_so_the_ledger_counts_every_release(tmp_path):
    crashed = _private()
    _released(crashed, 2)
    path = crashed.save_checkpoint(tmp_path / "checkpoint.pt")
    lost = _released(crashed, 2)   # released (logged, saved), then the process dies
    del crashed

    resumed = _private()
    resumed.load_checkpoint(path)
    redone = _released(resumed, 2)
    assert all(torch.equal(a, b) for a, b in zip(redone, lost, strict=True))
    assert resumed.ledger.steps == 4


class _CutShort:
    """A value whose pickling fails: the writer stops partway, as on a full disk or a kill."""

    def __reduce__(self):
        raise OSError(28, "No space left on device")


def test_steps_drawn_past_batches_a_loader_fetched_ahead_of_a_break_are_redone_as_released(tmp_path):
    """With a worker, the loader fetches batches ahead; a loop that breaks out of a pass leaves
    them, and the next pass draws past them. The steps after the checkpoint were drawn there, so
    the resume redoes them there too (they were refused as another gradient), then goes on."""
    crashed = _private(workers=1)
    _released(crashed, 2)   # breaks out of the pass, its worker two draws ahead
    path = crashed.save_checkpoint(tmp_path / "checkpoint.pt")
    lost = _released(crashed, 2)
    del crashed

    resumed = _private(workers=1)
    resumed.load_checkpoint(path)
    redone = _released(resumed, 3)
    assert all(torch.equal(a, b) for a, b in zip(redone, lost))
    assert resumed.ledger.steps == 5


def test_a_checkpoint_cut_short_while_overwritten_leaves_the_previous_one_loadable(tmp_path):
    """One checkpoint file, overwritten every few steps (as docs/python-api.md allows): a save cut
    short must not destroy the one before it, or the run cannot continue and its ledger, the only
    record of the steps it released, is lost with it."""
    crashed = _private()
    _released(crashed, 2)
    path = crashed.save_checkpoint(tmp_path / "checkpoint.pt")
    _released(crashed, 2)
    real = crashed.engine.state_dict
    crashed.engine.state_dict = lambda: {**real(), "cut": _CutShort()}
    with pytest.raises(OSError):
        crashed.save_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "dpclip_releases.jsonl"]

    resumed = _private()
    resumed.load_checkpoint(path)
    assert resumed.ledger.steps == 2
    _released(resumed, 2)   # the lost steps 3 and 4, redone as released
    assert resumed.ledger.steps == 4


def test_a_one_process_checkpoint_is_not_loaded_by_several_ranks(tmp_path, monkeypatch):
    """Ranks that all loaded one process's checkpoint would start from the same sampler state:
    their redone steps would draw the same rows on every rank, and their later draws be
    correlated, where each rank must draw its own examples' part of each batch."""
    from dpclip.distributed.world import World
    from dpclip.errors import DpclipError
    from dpclip.integrations import private as private_module

    single = _private()
    _released(single, 2)
    path = single.save_checkpoint(tmp_path / "checkpoint.pt")
    rank = _private()
    monkeypatch.setattr(private_module, "running_world", lambda: World(0, 2, 0, 2))
    with pytest.raises(DpclipError, match="several processes") as refused:
        rank.load_checkpoint(path)
    assert "one-process" in refused.value.hint
    assert rank.ledger.steps == 0


def test_a_loaded_checkpoint_counts_the_released_steps_it_has_not_redone_yet(tmp_path):
    """Steps 3 and 4 left the crashed process; until the loaded run has redone them, its ε,
    statement and privacy.json must still count them (a loop stopped after one redone step
    released 4 steps, not 3), and redoing them charges nothing twice."""
    crashed = _private()
    _released(crashed, 2)
    path = crashed.save_checkpoint(tmp_path / "checkpoint.pt")
    _released(crashed, 2)
    released = crashed.epsilon()
    del crashed

    resumed = _private()
    resumed.load_checkpoint(path)
    assert resumed.epsilon() == pytest.approx(released)
    _released(resumed, 1)
    assert resumed.epsilon() == pytest.approx(released)
    assert "steps: 4" in resumed.statement()
    saved = json.loads((resumed.save(tmp_path / "account") / "privacy.json").read_text())
    assert saved["steps"] == 4 and saved["epsilon"] == pytest.approx(released)

    again = _private()   # once every lost step is redone, each is charged once
    again.load_checkpoint(path)
    _released(again, 2)
    assert again.ledger.steps == 4 and again.epsilon() == pytest.approx(released)
