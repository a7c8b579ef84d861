"""An attacker holding two releases of a banded-MF run whose threshold moved between them
(an adaptive threshold: the noise std drops 100x from step 0 to step 1; the example attacked
is in step 0 only, as b-separated participation guarantees).

With the noise correlated before it is scaled (w_t = std_t·(C⁻¹Z)_t, dpclip/engine/noise.py),
the best linear combination r_0 − β·r_1 leaves exactly std_0 of noise on the step-0 gradient,
DP-SGD's: with ω = C⁻¹ζ for b = 2 (c_0² + c_1² = 1), Var(ω_0) = 1/c_0², Var(ω_1) = 1/c_0⁴,
Cov(ω_0, ω_1) = −c_1/c_0³, so Var(ω_0 | ω_1) = (1 − c_1²)/c_0² = 1, whatever the two stds.
Correlating noise drawn at each step's own scale (w = C⁻¹z, z_t ~ std_t) would leave about
std_1 instead, 100x less: the test simulates that too, so it can fail.

Through the engine, with a threshold that moves at every step (quantile) and the engine's state
saved and loaded into a new engine mid-band (mid-cycle for BLT), each step's noise is exactly
std_t·(C⁻¹Z)_t, Z the unit draws of the same seeded stream without correlation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.blt import blt_strategy
from dpclip.engine.correlated import CorrelatedNoise, banded_strategy, toeplitz_strategy
from dpclip.engine.noise import NoiseSource, add_step_noise

COORDINATES = 200_000
STDS = (1.0, 0.01)


def _releases(correlate_scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    c = banded_strategy(2, 2)
    correlation = CorrelatedNoise(c)
    source = NoiseSource(seed=3)
    rows = []
    for std in STDS:
        target = [torch.zeros(COORDINATES, dtype=torch.float64)]
        if correlate_scaled:  # the unsafe order: draw at this step's std, then correlate
            fresh = [torch.zeros_like(target[0])]
            source.add_gaussians(fresh, [std])
            correlation.correlate_(fresh)
            target[0].add_(fresh[0])
        else:
            add_step_noise(source, target, [std], correlation)
        rows.append(target[0])
    return rows[0], rows[1]


def _attack(noise_0: torch.Tensor, noise_1: torch.Tensor) -> float:
    """std of the least-squares residual of step 0's noise given step 1's: what remains on the
    step-0 gradient once the attacker subtracts the best multiple of the later release."""
    beta = (noise_0 @ noise_1) / (noise_1 @ noise_1)
    return float((noise_0 - beta * noise_1).std())


def test_a_later_smaller_noise_does_not_unmask_an_earlier_step():
    remaining = _attack(*_releases(correlate_scaled=False))
    # std_0 exactly (module doc), up to sampling error: relative std of a sample std about
    # 1/√(2n) ≈ 0.0016 at n = 200,000; 1% is six of them.
    assert abs(remaining - STDS[0]) < 0.01 * STDS[0]
    unsafe = _attack(*_releases(correlate_scaled=True))
    assert unsafe < 0.1 * STDS[0]   # the attack works on the unsafe order: the test can fail


QUANTILE = {"kind": "quantile", "sigma": 2.0, "target": 0.6, "lr": 0.5, "initial": 0.8}


def _engine(correlation):
    model = nn.Linear(20, 10, bias=False).double()
    return model, DPEngine(model, {"threshold": QUANTILE}, gradient_noise_multiplier=1.0, expected_batch_size=1,
                           seed=11, noise_correlation=correlation)


def _noise_and_stds(correlation, steps: int, resume_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each empty step's p.grad (its noise) and its noise std; at ``resume_at`` the engine's state
    goes into a new engine, as a resumed run's does."""
    model, engine = _engine(correlation)
    rows, stds = [], []
    for step in range(steps):
        if step == resume_at:
            state = engine.state_dict()
            engine.detach()
            model, engine = _engine(correlation)
            engine.load_state_dict(state)
        report = engine.privatize()
        rows.append(model.weight.grad.reshape(-1).clone())
        stds.append(float(report.noise_std_grad.reshape(-1)[0]))
    engine.detach()
    return torch.stack(rows), torch.tensor(stds, dtype=torch.float64)


@pytest.mark.parametrize("mechanism", ["banded-mf", "blt"])
def test_a_moving_thresholds_noise_resumed_mid_band_is_each_steps_std_times_the_inverse_strategys_row(mechanism):
    steps = 11
    if mechanism == "banded-mf":
        strategy = banded_strategy(3, steps)
        dense = toeplitz_strategy(strategy, steps)
    else:
        strategy = blt_strategy(2, steps, 3)
        c = strategy.coefficients(steps)
        dense = torch.stack([torch.cat([c[:t + 1].flip(0), c.new_zeros(steps - t - 1)]) for t in range(steps)])
    fresh, fresh_stds = _noise_and_stds(None, steps)   # the same stream uncorrelated: std_t·Z_t
    noise, stds = _noise_and_stds(strategy, steps, resume_at=5)   # mid-band (b = 3), mid-cycle (G = 3)
    assert torch.equal(stds, fresh_stds) and len(set(stds.tolist())) == steps   # the threshold moved every step
    unit = torch.linalg.solve_triangular(dense, fresh / fresh_stds[:, None], upper=False)   # C⁻¹Z
    assert torch.allclose(noise, unit * stds[:, None], atol=1e-12, rtol=0)
