"""private.train_step(inputs, targets) and make_private(compile=True) (docs/python-api.md, "One call
per step, compiled"). Compiled cases trace with aot_eager (no generated code, seconds); the
inductor case is in the slow run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dpclip
from dpclip.data.sampler import PoissonSampler
from dpclip.errors import DpclipError
from tests.integrations.reference import CLASSES, FEATURES, N, clipped_per_example_sum, small_data, small_model

_data, _model = small_data, small_model


def _private(model: nn.Module | None = None, dataset: Dataset | None = None, batch_size: int = 12, **kwargs):
    model = _model() if model is None else model
    options = {"criterion": nn.CrossEntropyLoss(), "delta": 1e-5, "noise_multiplier": 1.0, "steps": 4,
               "max_grad_norm": 0.05, "compile_backend": "aot_eager", **kwargs}
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(_data() if dataset is None else dataset, batch_size=batch_size), **options)


def _first_step_gradient(private, monkeypatch) -> list[torch.Tensor]:
    """p.grad of the first noisy step that train_step takes over the loader's parts (noise removed,
    the wrapped optimizer's own step left out)."""
    monkeypatch.setattr(private.engine.noise, "add_gaussians", lambda grads, stds: None)
    captured = []
    monkeypatch.setattr(private.optimizer.original, "step",
                        lambda: captured.append([p.grad.clone() for p in private.model.parameters()]))
    for x, y in private.data_loader:
        private.train_step(x, y)
        if captured:
            return captured[0]
    raise AssertionError("no step taken")


@pytest.mark.parametrize("compile, physical", [(False, None), (True, None), (True, 5)],
                         ids=["eager", "compiled", "compiled-parts-of-5"])
def test_train_step_writes_the_clipped_per_example_sum_over_the_expected_batch_size(monkeypatch, compile, physical):
    """Noise removed, p.grad is Σ_i min(1, C/‖g_i‖)·g_i / B over the seeded Poisson draw, g_i by
    autograd on each example alone, B the expected batch 12 (the draw has 18 rows: compiled, two
    pieces of 12, the second padded; in parts of 5, four pieces of 5, the last padded)."""
    private = _private(unsafe_seed=11, compile=compile, max_physical_batch_size=physical)
    shapes = []
    if compile:
        graph = private.stepper.compiled.compiled
        private.stepper.compiled.compiled = lambda *args: shapes.append(tuple(args[1].shape)) or graph(*args)
    got = _first_step_gradient(private, monkeypatch)
    rows = next(iter(PoissonSampler(N, 12 / N, 1, seed=11)))   # the same generator the loader drew from
    assert len(rows) not in (0, 12)
    x, y = _data()[rows]
    for grad, want in zip(got, clipped_per_example_sum(_model(), x, y, 0.05)):
        torch.testing.assert_close(grad, want / 12, rtol=1e-5, atol=1e-8)
    assert private.ledger.steps == 1
    if compile:   # the pieces after the first (checked against the engine) ran the graph, at one shape
        assert shapes and set(shapes) == {(physical or 12,)}


class _Named(Dataset):
    """Rows as ({"features": x, "scale": s}, y): a model called with keyword arguments."""

    def __init__(self):
        self.x, self.y = _data().tensors
        self.scale = torch.linspace(0.5, 1.5, N).unsqueeze(1)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return {"features": self.x[i], "scale": self.scale[i]}, self.y[i]


class _KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.out = nn.Linear(FEATURES, 8), nn.Linear(8, CLASSES)

    def forward(self, features: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(features)) * scale)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (1, FEATURES)), nn.Conv1d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * (FEATURES - 2), CLASSES))


@pytest.mark.parametrize("case", ["dict-inputs", "user-level", "cnn"])
def test_a_compiled_train_step_releases_what_the_eager_one_releases(monkeypatch, case):
    """The same seeded draws and noise: the compiled step's weights are the eager step's (float32
    rounding), with dict inputs (model(**inputs)), with user-level row weights (every row 1/k) and
    for a convolutional network."""
    weights = []
    for compile in (False, True):
        if case == "dict-inputs":
            private = _private(_KeywordModel(), _Named(), unsafe_seed=4, compile=compile)
        elif case == "cnn":
            private = _private(_cnn(), unsafe_seed=4, compile=compile)
        else:
            private = _private(unsafe_seed=4, compile=compile, users=[i // 3 for i in range(N)],
                               max_records_per_user=2, batch_size=4)
        for _ in range(2):
            for inputs, targets in private.data_loader:
                private.train_step(inputs, targets)
                if private.ledger.steps == 2:
                    break
            if private.ledger.steps == 2:
                break
        weights.append([p.detach().clone() for p in private.model.parameters()])
    for eager, compiled in zip(*weights):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_train_step_returns_the_mean_loss_and_charges_one_step_per_draw():
    private = _private(unsafe_seed=2)
    x, y = next(iter(private.data_loader))
    with torch.no_grad():
        want = nn.functional.cross_entropy(_model()(x), y)
    loss = private.train_step(x, y)
    assert not loss.requires_grad and loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert private.ledger.steps == 1


def test_an_empty_draw_through_the_compiled_step_adds_noise_and_is_charged():
    """q = 1/N: a third of the draws are empty; each is still a noisy, charged step."""
    private = _private(batch_size=1, steps=30, compile=True, unsafe_seed=0)
    seen = []
    for x, y in private.data_loader:
        before = [p.detach().clone() for p in private.model.parameters()]
        loss = private.train_step(x, y)
        seen.append(len(x))
        if len(x) == 0:
            assert torch.isnan(loss)
            assert any(not torch.equal(b, p) for b, p in zip(before, private.model.parameters()))
    assert 0 in seen and private.ledger.steps == len(seen) == 30


def test_train_step_refuses_rows_the_loader_did_not_draw_before_the_model_sees_them():
    private = _private(compile=True)
    x, y = _data()[:12]
    calls = []
    private.model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(DpclipError, match="without a batch drawn") as info:
        private.train_step(x, y)
    assert "data loader" in info.value.hint and private.ledger.steps == 0 and not calls
    drawn_x, drawn_y = next(iter(private.data_loader))
    with pytest.raises(DpclipError, match="more rows than the data loader handed"):
        private.train_step(torch.cat([drawn_x, x]), torch.cat([drawn_y, y]))
    assert private.ledger.steps == 0 and not calls


def test_the_classic_loop_under_compile_is_refused_with_the_train_step_form():
    private = _private(compile=True)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(DpclipError, match="outside dpclip's graph") as info:
        criterion(model(x), y)
    assert "private.train_step(inputs, targets)" in info.value.hint and private.ledger.steps == 0


@pytest.mark.parametrize("change, message", [
    ({"compile": "yes"}, "compile must be True or False"),
    ({"compile_backend": 3}, "compile_backend must be"),
    ({"compile_backend": "nope"}, "compile_backend must be a torch.compile backend's name, got 'nope'"),
    ({"clipping": {"threshold": {"kind": "discriminative", "small": 0.5, "large": 2.0,
                                "tail_rule": "top_fraction"}}, "max_grad_norm": None},
     "cannot be compiled"),
])
def test_a_compile_the_step_cannot_take_is_refused_with_a_hint_and_leaves_the_model_as_given(change, message):
    model = _model()
    with pytest.raises(DpclipError, match=message) as info:
        _private(model, **{"compile": True, **change})
    assert info.value.hint
    # the model is as it was given: make_private again, eagerly, trains it
    private = _private(model)
    x, y = next(iter(private.data_loader))
    private.train_step(x, y)
    assert private.ledger.steps == 1


def test_compile_refuses_half_precision_parameters():
    with pytest.raises(DpclipError, match="float32 or float64") as info:
        _private(_model().to(torch.bfloat16), compile=True)
    assert "compile=False" in info.value.hint


def test_compiled_inputs_must_be_tensors_with_a_row_per_example():
    class Texts(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return (_data()[i][0], f"row {i}"), _data()[i][1]
    private = _private(dataset=Texts(), compile=True)
    inputs, targets = next(iter(private.data_loader))
    with pytest.raises(DpclipError, match="one row per example") as info:
        private.train_step(inputs, targets)
    assert "compile=False" in info.value.hint and private.ledger.steps == 0


@pytest.mark.slow
def test_make_private_compiled_with_inductor_trains_the_digits_mlp():
    """The real backend (generated code): a few steps with inductor reach the eager weights."""
    weights = []
    for compile in (False, True):
        private = _private(unsafe_seed=9, compile=compile, compile_backend="inductor")
        for x, y in private.data_loader:
            private.train_step(x, y)
        weights.append([p.detach().clone() for p in private.model.parameters()])
    for eager, compiled in zip(*weights):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
