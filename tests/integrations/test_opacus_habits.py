"""Opacus habits work in make_private, or are refused with a one-line translation (issue 51, item 3)."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError, EngineError

N = 120


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _opacus_style(model=None, **options):
    model = model or _model()
    return dpclip.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=DataLoader(_data(), batch_size=12), criterion=nn.CrossEntropyLoss(),
                               **options)


def _run(private, steps=2):
    model, optimizer, criterion, loader = private
    for k, (x, y) in enumerate(loader):
        if k == steps:
            break
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()


def test_opacus_keyword_names_plan_what_dpclips_do():
    opacus = _opacus_style(noise_multiplier=1.1, max_grad_norm=1.0, target_delta=1e-5, epochs=2,
                           grad_sample_mode="ghost", secure_mode=True, poisson_sampling=True)
    model = _model()
    native = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), batch_size=12),
                                 criterion=nn.CrossEntropyLoss(), noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5,
                                 epochs=2)
    assert opacus.plan.plan == native.plan.plan
    _run(opacus)
    assert opacus.ledger.steps == 2


@pytest.mark.parametrize("options, message, hint", [
    ({"loss_reduction": "sum"}, "loss_reduction='sum'", "multiply the learning rate by B"),
    ({"clipping": "adaptive"}, "quantile threshold policy", "'kind': 'quantile'"),
    ({"max_grad_norm": [1.0, 1.0, 1.0, 1.0]}, "list of thresholds needs per-layer", "clipping='per_layer'"),
    ({"clipping": "per_layer", "max_grad_norm": [1.0, 2.0]}, "2 thresholds, and the model trains 4", "one threshold"),
    ({"delta": 1e-5, "target_delta": 1e-5}, "not both", "delta=... alone"),
])
def test_what_means_something_else_is_refused_with_its_translation(options, message, hint):
    options = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "target_delta": 1e-5, "steps": 2, **options}
    if "delta" in options and options.get("target_delta") is None:
        options.pop("target_delta")
    with pytest.raises(DpclipError, match=message) as caught:
        _opacus_style(**options)
    assert hint in caught.value.hint


def test_per_layer_clipping_is_one_threshold_per_parameter_tensor_as_in_opacus():
    private = _opacus_style(noise_multiplier=1.0, clipping="per_layer", max_grad_norm=[0.5, 0.1, 0.4, 0.2],
                            target_delta=1e-5, steps=2)
    names = private.engine.group_names
    assert len(names) == 4
    torch.testing.assert_close(private.engine.thresholds.cpu().double(),
                               torch.tensor([0.5, 0.1, 0.4, 0.2], dtype=torch.float64))
    flat = _opacus_style(noise_multiplier=1.0, clipping="flat", max_grad_norm=0.7, target_delta=1e-5, steps=2)
    assert len(flat.engine.group_names) == 1


def test_epsilon_at_another_delta_is_dp_accountings():
    private = _opacus_style(noise_multiplier=1.2, max_grad_norm=1.0, target_delta=1e-5, steps=3)
    _run(private, steps=3)
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(12 / N, dp_accounting.GaussianDpEvent(1.2)), 3)
    for delta in (1e-3, 1e-7):
        assert private.get_epsilon(delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-2)
    assert private.epsilon(1e-7) > private.epsilon() > private.epsilon(1e-3)


def test_make_private_with_epsilon_is_the_name_opacus_uses():
    model = _model()
    private = dpclip.make_private_with_epsilon(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               DataLoader(_data(), batch_size=12), target_epsilon=3.0,
                                               target_delta=1e-5, epochs=2, max_grad_norm=1.0,
                                               criterion=nn.CrossEntropyLoss())
    for _ in range(2):   # two epochs: two passes of ⌈120/12⌉ = 10 draws
        _run(private, steps=10)
    assert private.ledger.steps == 20 and private.epsilon() <= 3.0 * 1.01


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 3)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x.view(-1, 1, 6)))).mean(-1))


def test_fix_replaces_batch_norm_so_that_the_engine_accepts_the_model():
    with pytest.raises(EngineError, match="BatchNorm"):
        _opacus_style(BatchNormNet(), noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, steps=2)
    fixed = dpclip.fix(BatchNormNet())
    assert isinstance(fixed.norm, nn.GroupNorm) and fixed.norm.num_groups == 8
    private = _opacus_style(fixed, noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, steps=2)
    _run(private)
    assert private.ledger.steps == 2


def test_the_returned_loss_takes_arithmetic_and_checks_and_keeps_its_rows():
    # seeded: an empty draw's loss is NaN (item() of no rows), and from OS entropy one in 0.9**-120 = 3e5 is empty
    private = _opacus_style(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, steps=2, unsafe_seed=0)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    assert not torch.isnan(loss) and bool(torch.isfinite(loss)) and loss < 1e6 and f"{loss:.2f}"
    halved = loss / 2
    assert halved.per_sample.shape == (len(x),)
    torch.testing.assert_close(halved.per_sample, loss.per_sample / 2)
    l2 = sum(p.pow(2).sum() for p in model.parameters())
    with pytest.raises(DpclipError, match="carries gradients") as caught:
        loss + 1e-3 * l2
    assert "weight_decay" in caught.value.hint
    (0.5 * (loss + 1.0)).backward()
    optimizer.step()
    assert private.ledger.steps == 1


@pytest.mark.parametrize("reduce", [lambda loss: loss.mean(), lambda loss: loss.sum(), lambda loss: torch.mean(loss),
                                    lambda loss: torch.autograd.backward(loss), lambda loss: loss.backward(create_graph=True)],
                         ids=["mean", "sum", "torch.mean", "autograd.backward", "create_graph"])
def test_the_returned_loss_reduced_or_differentiated_by_torch_is_refused_with_the_fix(reduce):
    private = _opacus_style(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, steps=2)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    assert loss.requires_grad
    with pytest.raises(DpclipError) as caught:
        reduce(loss)
    assert "loss.backward()" in caught.value.hint
    loss.backward(retain_graph=True)   # accepted (it changes nothing here)
    optimizer.step()
    assert private.ledger.steps == 1


def test_lbfgs_is_refused_when_made_private():
    model = _model()
    with pytest.raises(DpclipError, match="LBFGS") as caught:
        dpclip.make_private(model, torch.optim.LBFGS(model.parameters()), DataLoader(_data(), batch_size=12),
                            criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5,
                            steps=2)
    assert "first-order" in caught.value.hint


def test_opacus_batch_memory_manager_is_refused_with_its_dpclip_form():
    pytest.importorskip("opacus")
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    private = _opacus_style(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, steps=2)
    model, optimizer, criterion, loader = private
    with pytest.raises(DpclipError, match="BatchMemoryManager") as caught:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as parts:
            for x, y in parts:
                criterion(model(x), y).backward()
                optimizer.step()
    assert "max_physical_batch_size" in caught.value.hint and private.ledger.steps == 0


def test_fix_stops_instance_norm_tracking_running_statistics():
    model = nn.Sequential(nn.Conv1d(1, 4, 3), nn.InstanceNorm1d(4, affine=True, track_running_stats=True))
    fixed = dpclip.fix(model)
    norm = fixed[1]
    assert isinstance(norm, nn.InstanceNorm1d) and not norm.track_running_stats
    assert norm.running_mean is None and norm.running_var is None
    assert fixed(torch.randn(3, 1, 6)).shape == (3, 4, 4)
