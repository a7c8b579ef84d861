"""The engine's threshold policies and noise mechanisms with the model on a CUDA device
(skipped without one; docs/performance.md, "GPU").

Each case runs the same steps on the CPU and on the GPU and compares them: with the
statistics' noise negligible (σ 1e-9) the thresholds are a function of the norms, so the
two devices must move them alike and write the same clipped sums; the correlated
mechanisms draw from different generators on the two devices, so their noise is compared
in distribution (the sample std over the coordinates of each step).
"""

import copy
import math

import pytest
import torch
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.blt import blt_strategy
from dpclip.engine.correlated import banded_strategy

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
B, STEPS = 16, 4

POLICIES = {
    "fixed": {"kind": "fixed", "value": 0.5},
    "quantile": {"kind": "quantile", "sigma": 1e-9, "initial": 0.5},
    "dcsgd-p": {"kind": "dcsgd-p", "sigma_hist": 1e-9, "bins": 8, "range": 4.0},
    "dcsgd-e": {"kind": "dcsgd-e", "sigma_hist": 1e-9},   # its error rule needs σ_g > 0: thresholds only
    "discriminative": {"kind": "discriminative", "small": 0.3, "large": 1.0, "tail_threshold": 0.8},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, 6, generator=g) * (1 + step), torch.randint(0, 3, (B,), generator=g))
            for step in range(STEPS)]


def _sigma(threshold: dict) -> float:
    return 1.0 if threshold["kind"] == "dcsgd-e" else 0.0


def _run(device: str, threshold: dict) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    model = _model().to(device)
    engine = DPEngine(model, {"grouping": "layer", "threshold": threshold}, gradient_noise_multiplier=_sigma(threshold),
                      expected_batch_size=B, seed=0)
    grads, thresholds = [], []
    for x, y in _batches():
        engine.backward(nn.functional.cross_entropy(model(x.to(device)), y.to(device), reduction="none"))
        engine.privatize()
        grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        thresholds.append(engine.thresholds.detach().cpu().clone())
        assert all(p.grad.is_cuda == (device == "cuda") for p in model.parameters())
        model.zero_grad(set_to_none=True)
    engine.detach()
    return grads, thresholds


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_threshold_policy_moves_and_clips_on_cuda_as_on_the_cpu(name):
    cpu_grads, cpu_thresholds = _run("cpu", POLICIES[name])
    gpu_grads, gpu_thresholds = _run("cuda", POLICIES[name])
    for step, (want, got) in enumerate(zip(cpu_thresholds, gpu_thresholds)):
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-7, msg=f"thresholds, step {step}")
    for step, (want, got) in enumerate(zip(cpu_grads, gpu_grads)):
        if _sigma(POLICIES[name]):   # noised: the two devices draw different noise
            break
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=f"clipped sum, step {step}")


def _noise_stds(device: str, correlation) -> list[float]:
    """Sample std of each step's noise on a model whose gradient is zero (p.grad is the noise)."""
    model = nn.Linear(250, 60).to(device)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=1, noise_correlation=correlation)
    stds = []
    for _ in range(STEPS):
        engine.backward(model(torch.zeros(1, 250, device=device)).sum(1) * 0)
        engine.privatize()
        stds.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).double().std()))
        assert all(p.grad.is_cuda == (device == "cuda") for p in model.parameters())
        model.zero_grad(set_to_none=True)
    engine.detach()
    return stds


@pytest.mark.parametrize("mechanism", ["banded", "blt"])
def test_correlated_noise_on_cuda_has_the_cpu_distribution(mechanism):
    """Each step's noise is a Gaussian of a std fixed by the strategy; its sample std over
    n = 15,060 coordinates has a relative standard error of 1/sqrt(2n) on each device, so the
    two devices' sample stds differ by less than 6·sqrt(2)/sqrt(2n) relative (6 standard errors,
    the band of 5 at n = 10,050): the noise is from OS entropy, and the 8 comparisons of a run fail
    with probability 1.6e-8 (at 5 standard errors, 4.6e-6)."""
    correlation = banded_strategy(2, STEPS) if mechanism == "banded" else blt_strategy(1, STEPS, 1)
    cpu, gpu = _noise_stds("cpu", copy.deepcopy(correlation)), _noise_stds("cuda", copy.deepcopy(correlation))
    n = 250 * 60 + 60
    tolerance = 6 * math.sqrt(2) / math.sqrt(2 * n)
    for step, (want, got) in enumerate(zip(cpu, gpu)):
        assert abs(got / want - 1) < tolerance, (step, want, got)
