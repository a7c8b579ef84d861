"""make_private holds its ε whatever the loop does (issue 51, item 1): nothing runs that is not
charged and nothing is charged that did not run.

The attacker here is the loop itself: it accumulates two Poisson draws into one step, backwards a
batch twice, feeds a batch of its own loader, steps after part of a batch. Each would release more
than the ledger charges; each is refused before the noisy step, and the ledger counts exactly the
steps whose noise was added.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError
from tests.privacy.conftest import counted_releases

N = 200


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g))


def _private(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    options = {"criterion": nn.CrossEntropyLoss(), "delta": 1e-5, "noise_multiplier": 1.0, "steps": 20,
               "max_grad_norm": 1.0, **kwargs}
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  DataLoader(_data(), batch_size=40), **options)
    return private, counted_releases(private)


def _refused(private, released, loop, match: str) -> None:
    with pytest.raises(DpclipError, match=match) as caught:
        loop(*private)
    assert "optimizer.step()" in caught.value.hint
    # what ran is what is charged: every noisy step the engine released is in the ledger, no other
    assert private.ledger.steps == len(released)


def test_two_draws_accumulated_into_one_step_are_refused_at_the_second_draw():
    private, released = _private()

    def accumulate(model, optimizer, criterion, loader):
        for k, (x, y) in enumerate(loader):
            criterion(model(x), y).backward()
            if k % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    _refused(private, released, accumulate, "drew batch 2 before optimizer.step")
    assert private.ledger.steps == 0


def test_a_second_backward_over_one_batch_is_refused():
    private, released = _private()

    def twice(model, optimizer, criterion, loader):
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            loss.backward()    # a retry
            optimizer.step()
    _refused(private, released, twice, "second backward over batch 1")


def test_the_users_own_loader_with_the_returned_parts_is_refused():
    private, released = _private()
    mine = DataLoader(_data(), batch_size=40, shuffle=True)

    def own_loader(model, optimizer, criterion, _):
        for x, y in mine:
            criterion(model(x), y).backward()
            optimizer.step()
    _refused(private, released, own_loader, "without a batch drawn by make_private's data loader")
    assert private.ledger.steps == 0


def test_an_evaluation_with_the_returned_criterion_is_refused_with_the_way_to_evaluate():
    private, released = _private()
    held_out = _data()[:50]

    def evaluate_between_steps(model, optimizer, criterion, loader):
        for x, y in loader:
            criterion(model(x), y).backward()
            optimizer.step()
            with torch.no_grad():
                criterion(model(held_out[0]), held_out[1])
    with pytest.raises(DpclipError, match="without a batch drawn by make_private's data loader") as caught:
        evaluate_between_steps(*private)
    assert "the criterion you passed to make_private" in caught.value.hint
    assert private.ledger.steps == len(released) == 1


def test_a_step_after_each_part_of_a_batch_split_by_hand_is_refused():
    private, released = _private()

    def parts(model, optimizer, criterion, loader):
        for x, y in loader:
            for xp, yp in zip(x.tensor_split(2), y.tensor_split(2)):
                criterion(model(xp), yp).backward()
                optimizer.step()
    _refused(private, released, parts, "not backwarded")


def test_a_draw_left_without_its_step_is_refused():
    private, released = _private()

    def skip_some(model, optimizer, criterion, loader):
        for k, (x, y) in enumerate(loader):
            if k == 3:
                continue             # e.g. a batch the loop decided to skip
            criterion(model(x), y).backward()
            optimizer.step()
    _refused(private, released, skip_some, "drew batch 5 before optimizer.step")
    assert private.ledger.steps == 3


def test_a_second_step_without_a_new_draw_is_refused():
    private, released = _private()

    def step_twice(model, optimizer, criterion, loader):
        for x, y in loader:
            criterion(model(x), y).backward()
            optimizer.step()
            optimizer.step()
    _refused(private, released, step_twice, "optimizer.step.. without a batch drawn")
    assert private.ledger.steps == 1


def _noiseless_steps_recorded(monkeypatch, private, steps: list):
    """``private``'s parts; each noisy step's gradient, with the noise left out, goes to ``steps``
    instead of the parameters."""
    model = private.model
    monkeypatch.setattr(private.engine.noise, "add_gaussians", lambda grads, stds: None)
    monkeypatch.setattr(private.optimizer.original, "step",
                        lambda: steps.append([p.grad.clone() for p in model.parameters()]))
    return private


def _whole_and_parted(monkeypatch):
    """Two runs of one seed, whole draws and parts of at most 8 rows, recording their noiseless
    steps: ([(name, run)], the parted run's releases, {name: steps})."""
    whole, _ = _private(unsafe_seed=11)
    parted, released = _private(unsafe_seed=11, max_physical_batch_size=8)
    grads = {"whole": [], "parted": []}
    for name, private in (("whole", whole), ("parted", parted)):
        _noiseless_steps_recorded(monkeypatch, private, grads[name])
    return [("whole", whole), ("parted", parted)], released, grads


def _assert_same_steps(ours, theirs):
    for a, b in zip(ours, theirs):   # the steps both took
        for ga, gb in zip(a, b):
            torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)


def test_physical_parts_with_a_step_after_each_are_one_noisy_step_per_draw(monkeypatch):
    """Opacus's BatchMemoryManager loop shape with max_physical_batch_size: each draw is cut into
    parts of at most 8 rows, step() after each part; one noisy step, one charge, per draw, and the
    step's gradient (noise removed) is the whole draw's."""
    runs, released, grads = _whole_and_parted(monkeypatch)
    for name, (model, optimizer, criterion, loader) in runs:
        private = dict(runs)[name]
        parts = 0
        for x, y in loader:
            assert len(x) <= (8 if name == "parted" else 200)
            parts += 1
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
        assert private.ledger.steps == 5   # a pass: ⌈200/40⌉ draws
    assert parts > 5 and len(released) == 5
    _assert_same_steps(grads["whole"], grads["parted"])


def test_a_loop_that_breaks_out_between_parts_gets_the_draw_s_other_parts_first_then_one_step(monkeypatch):
    """A loop counting parts (Opacus's BatchMemoryManager examples: `if i == max_iterations: break`)
    left a draw open: every later iterator was refused and step() did nothing. The next iterator
    hands out the draw's other parts first; the step's gradient is still the whole draw's."""
    runs, released, grads = _whole_and_parted(monkeypatch)
    parted = dict(runs)["parted"]
    for name, (model, optimizer, criterion, loader) in runs:
        for stop in (2, 7, None):             # two loops that break mid-draw, then a whole pass
            for k, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()
                if k == stop:
                    break
    assert len(released) == len(grads["parted"]) == parted.ledger.steps
    assert parted.ledger.steps >= 5 and parted.optimizer.tracker.rows is None
    _assert_same_steps(grads["whole"], grads["parted"])


def test_an_empty_draw_is_a_step_without_a_backward():
    private, released = _private()
    optimizer = private.optimizer
    tracker = private.optimizer.tracker
    tracker.open(0)               # as the loader hands out an empty Poisson draw
    optimizer.step()
    assert private.ledger.steps == len(released) == 1


def test_epochs_e_plans_exactly_e_passes_of_the_loader():
    """N 1400, B 256: a pass is ⌈1400/256⌉ = 6 draws; epochs=15 is 90 steps (⌈15·1400/256⌉ = 83 stopped
    the loop inside its 14th pass), and `for epoch in range(15)` runs them all."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1400, 5, generator=g), torch.randint(0, 3, (1400,), generator=g))
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=256),
                                  criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, epochs=15,
                                  max_grad_norm=1.0)
    model, optimizer, criterion, loader = private
    assert private.plan.plan.steps == 90 and len(loader) == 6
    for _ in range(15):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    assert private.ledger.steps == 90


def _steps(private, count: int) -> None:
    model, optimizer, criterion, loader = private
    taken = 0
    while taken < count:
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            taken += 1
            if taken == count:
                return


def test_a_checkpoint_carries_the_ledger_so_a_continued_run_counts_its_earlier_steps(tmp_path):
    """2 + 2 steps: rebuilt with make_private and restored, ε is the 4 steps' (what ran), not 2's."""
    first, _ = _private()
    _steps(first, 2)
    path = first.save_checkpoint(tmp_path / "ckpt.pt")
    assert (path.stat().st_mode & 0o077) == 0          # generator states: secret
    weights = [p.detach().clone() for p in first.model.parameters()]
    second, _ = _private()
    assert any("starts ε again at 0" in line for line in second.statement())
    second.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(weights, second.model.parameters()))
    assert second.ledger.steps == 2 and second.draws.step == 2
    _steps(second, 2)
    whole, _ = _private()
    _steps(whole, 4)
    assert second.ledger.steps == 4
    assert second.epsilon() == pytest.approx(whole.epsilon(), rel=1e-12)
    assert not any("starts ε again at 0" in line for line in second.statement())


def test_a_checkpoint_of_another_plan_is_refused():
    import tempfile
    first, _ = _private()
    _steps(first, 1)
    with tempfile.TemporaryDirectory() as folder:
        path = first.save_checkpoint(f"{folder}/c.pt")
        other, _ = _private(noise_multiplier=2.0)
        with pytest.raises(DpclipError, match="planned as"):
            other.load_checkpoint(path)


def test_a_checkpoint_of_another_clipping_threshold_is_refused(tmp_path):
    """The threshold is part of the plan: loading must not silently swap the one asked for."""
    first, _ = _private()
    _steps(first, 1)
    path = first.save_checkpoint(tmp_path / "c.pt")
    other, _ = _private(max_grad_norm=0.25)
    with pytest.raises(DpclipError, match="planned as"):
        other.load_checkpoint(path)
    assert other.engine.thresholds.tolist() == [0.25]


def test_an_older_checkpoint_loaded_into_a_run_that_went_further_is_refused(tmp_path):
    """Rewinding in one process would drop from the ledger a step already released (ε would fall)."""
    private, _ = _private()
    _steps(private, 2)
    path = private.save_checkpoint(tmp_path / "c.pt")
    _steps(private, 1)
    epsilon = private.epsilon()
    with pytest.raises(DpclipError, match="already drawn batches"):
        private.load_checkpoint(path)
    assert private.ledger.steps == 3 and private.epsilon() == epsilon


def test_a_longer_checkpoint_loaded_into_a_run_that_has_stepped_is_refused(tmp_path):
    """Loading a 3-step checkpoint after 2 steps of this run set the ledger to 3 where 5 ran."""
    first, _ = _private()
    _steps(first, 3)
    path = first.save_checkpoint(tmp_path / "c.pt")
    second, _ = _private()
    _steps(second, 2)
    with pytest.raises(DpclipError, match="already drawn batches") as caught:
        second.load_checkpoint(path)
    assert "before its first step" in caught.value.hint
    assert second.ledger.steps == 2


def test_your_own_loader_with_poisson_sampling_false_is_held_to_one_step_per_batch_and_stated():
    """poisson_sampling=False keeps your loader's batches: still one noisy step per batch, and
    the statement says they were accounted as if Poisson-sampled."""
    private, released = _private(poisson_sampling=False)
    model, optimizer, criterion, loader = private
    for k, (x, y) in enumerate(loader):
        assert len(x) == 40                        # your loader's fixed batches
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert private.ledger.steps == len(released) == 5
    assert any("your loader's own batches" in line for line in private.statement())

    def accumulate(model, optimizer, criterion, loader):
        for x, y in loader:
            criterion(model(x), y).backward()
    again, released = _private(poisson_sampling=False)
    _refused(again, released, accumulate, "drew batch 2 before optimizer.step")


def test_your_own_loader_with_poisson_sampling_false_stops_at_the_planned_steps():
    """ε (and a target_epsilon's σ) covers the planned steps: a shuffled loader ran past them,
    silently, as far as the loop went (the Poisson loader stops its pass and refuses another)."""
    private, released = _private(poisson_sampling=False, steps=7)
    model, optimizer, criterion, loader = private
    passes = []
    with pytest.raises(DpclipError, match="the 7 planned steps are done") as caught:
        for _ in range(3):
            passes.append(0)
            for x, y in loader:
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()
                passes[-1] += 1
    assert passes == [5, 2, 0] and "more epochs (or steps)" in caught.value.hint
    assert private.ledger.steps == len(released) == 7


def test_a_loss_handed_to_a_grad_scaler_is_refused_with_a_hint_not_a_torch_traceback():
    """torch.amp.GradScaler.scale(loss) raised a ValueError from inside torch."""
    private, released = _private()
    model, optimizer, criterion, loader = private
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = next(iter(loader))
    with pytest.raises(DpclipError, match="torch.amp.GradScaler") as caught:
        scaler.scale(criterion(model(x), y)).backward()
    assert "drop the GradScaler" in caught.value.hint and "bf16" in caught.value.hint
    assert private.ledger.steps == len(released) == 0
