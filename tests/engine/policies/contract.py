"""The contract every threshold policy keeps, as functions of its kind (docs/engine.md,
"Adding a threshold policy"). test_contract.py runs them over every registered policy; a test
that registers its own policy can run them on it too."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dpclip.engine.policies import PolicyContext, build_policy, policy_spec, validate_policy

F64 = torch.float64
SIZES = (4, 3, 2)          # d_k of three groups
BATCH = 8                  # expected batch size B


def context(groups: int = len(SIZES), sigma: float = 1.0) -> PolicyContext:
    sizes = list(SIZES[:groups]) + [2] * max(0, groups - len(SIZES))
    return PolicyContext([f"g{k}" for k in range(groups)], sizes, BATCH, sigma, torch.device("cpu"), F64)


def make(kind: str, groups: int = len(SIZES)):
    return build_policy(copy.deepcopy(policy_spec(kind).example), context(groups))


def per_sample_grads(generator: torch.Generator, n: int, groups: int = len(SIZES)) -> list[torch.Tensor]:
    """Per-sample gradients [n, d_k] per group, with heavy-tailed norms (a few samples far out)."""
    scale = torch.exp(1.5 * torch.randn(n, 1, generator=generator, dtype=F64))
    return [torch.randn(n, context(groups).group_sizes[k], generator=generator, dtype=F64) * scale
            for k in range(groups)]


def norms_of(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.norm(dim=1) for g in grads], dim=1)


def clipped_sum(policy, grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ_i min(1, C_ik / n_ik) g_ik over all groups, as one vector (what the engine noises)."""
    norms = norms_of(grads)
    thresholds = policy.per_sample_thresholds(norms) if policy.per_sample else None
    if thresholds is None:
        thresholds = policy.thresholds().expand_as(norms)
    factors = torch.clamp(thresholds / norms, max=1.0)
    return torch.cat([(factors[:, k:k + 1] * g).sum(0) for k, g in enumerate(grads)])


def step(policy, grads, seed: int):
    """One engine step on a batch: clip (per-sample thresholds), observe, release."""
    clipped_sum(policy, grads)
    policy.observe(norms_of(grads))
    return policy.release(torch.Generator().manual_seed(seed))


def check_state_round_trip(kind: str) -> None:
    """A policy loaded from another's state continues exactly as that one does."""
    generator = torch.Generator().manual_seed(0)
    first = make(kind)
    for t in range(3):
        step(first, per_sample_grads(generator, 7), seed=t)
    again = make(kind)
    again.load_state_dict(copy.deepcopy(first.state_dict()))
    for t in range(3, 6):
        grads = per_sample_grads(generator, 7)
        torch.testing.assert_close(again.thresholds(), first.thresholds(), rtol=0, atol=0)
        torch.testing.assert_close(clipped_sum(again, grads), clipped_sum(first, grads), rtol=0, atol=0)
        for policy in (first, again):
            policy.observe(norms_of(grads))
        released = [p.release(torch.Generator().manual_seed(t)) for p in (first, again)]
        assert released[0] == released[1] and first.summary() == again.summary()
        torch.testing.assert_close(again.thresholds(), first.thresholds(), rtol=0, atol=0)
        torch.testing.assert_close(again.sensitivity_thresholds(), first.sensitivity_thresholds(), rtol=0, atol=0)


def check_roll_back(kind: str) -> None:
    """A release rolled back (``privatize`` raised before or after the policy released) leaves the
    policy as one that never saw the step: the next step's statistic, release and thresholds are a
    fresh one's on the next batch alone."""
    generator = torch.Generator().manual_seed(2)
    warm = [per_sample_grads(generator, 7) for _ in range(2)]
    lost, following = per_sample_grads(generator, 7), per_sample_grads(generator, 7)
    for released in (False, True):
        policy, fresh = make(kind), make(kind)
        for t, grads in enumerate(warm):
            for p in (policy, fresh):
                step(p, grads, seed=t)
        clipped_sum(policy, lost)
        policy.observe(norms_of(lost))
        held = policy.held()
        if released:
            policy.release(torch.Generator().manual_seed(50))
        policy.roll_back(held)
        for p in (policy, fresh):
            clipped_sum(p, following)
            p.observe(norms_of(following))
        pending = policy.pending_statistic()
        if pending is not None:
            torch.testing.assert_close(pending, fresh.pending_statistic(), rtol=0, atol=0)
        releases = [p.release(torch.Generator().manual_seed(51)) for p in (policy, fresh)]
        assert releases[0] == releases[1] and policy.summary() == fresh.summary(), released
        torch.testing.assert_close(policy.thresholds(), fresh.thresholds(), rtol=0, atol=0)
        assert policy.state_dict() == fresh.state_dict(), released


def check_neighbouring_batches(kind: str, trials: int = 40) -> None:
    """Removing one example moves the clipped sum and the released statistic (before noise)
    by at most the sensitivities the policy declares."""
    generator = torch.Generator().manual_seed(1)
    worst_gradient = worst_statistic = 0.0
    for trial in range(trials):
        n = int(torch.randint(2, 2 * BATCH, (1,), generator=generator))
        grads = per_sample_grads(generator, n)
        removed = int(torch.randint(0, n, (1,), generator=generator))
        neighbour = [torch.cat([g[:removed], g[removed + 1:]]) for g in grads]
        # both sides start from the same state, a few steps in
        warm = make(kind)
        for t in range(trial % 3):
            step(warm, per_sample_grads(generator, BATCH), seed=100 + t)
        policies = [make(kind), make(kind)]
        for policy in policies:
            policy.load_state_dict(copy.deepcopy(warm.state_dict()))
        sums = [clipped_sum(p, g) for p, g in zip(policies, (grads, neighbour))]
        declared = float(policies[0].sensitivity_thresholds().norm())
        change = float((sums[0] - sums[1]).norm())
        assert change <= declared * (1 + 1e-9), (trial, change, declared)
        worst_gradient = max(worst_gradient, change / declared)
        for policy, g in zip(policies, (grads, neighbour)):
            policy.observe(norms_of(g))
        statistics = [p.pending_statistic() for p in policies]
        releases = policies[0].release(torch.Generator().manual_seed(trial)) or []
        if statistics[0] is None:
            assert not releases, "a policy that releases a statistic must expose it to pending_statistic()"
            continue
        declared_statistic = math.sqrt(sum(r.sensitivity ** 2 for r in releases))
        change = float((statistics[0] - statistics[1]).norm())
        assert change <= declared_statistic * (1 + 1e-9), (trial, change, declared_statistic)
        worst_statistic = max(worst_statistic, change / declared_statistic)
    assert worst_gradient > 0.5          # the batches did exercise the bound
    assert worst_statistic > 0.5 or make(kind).pending_statistic() is None


def check_planner_agrees_with_engine(kind: str) -> None:
    """What the planner charges (the spec) is what the engine reports, for several K."""
    spec = validate_policy(copy.deepcopy(policy_spec(kind).example))
    for groups in (1, 2, 5):
        policy = spec.build(context(groups))
        generator = torch.Generator().manual_seed(groups)
        releases = step(policy, per_sample_grads(generator, BATCH, groups), seed=groups) or []
        statistic = spec.statistic(groups)
        if statistic is None:
            assert releases == [] and not spec.releases_statistic()
        else:
            (release,) = releases
            assert release.sensitivity == pytest.approx(statistic.sensitivity, rel=1e-12)
            assert release.sigma == statistic.sigma == spec.aux_sigma and release.name == statistic.name
        gradient = spec.gradient_sensitivity()
        if gradient is not None:
            assert float(spec.build(context(groups)).sensitivity_thresholds().norm()) == pytest.approx(gradient)


def check_engine_dict(kind: str) -> None:
    """The spec's engine dict carries the budget split's noise std into the engine policy."""
    spec = validate_policy(copy.deepcopy(policy_spec(kind).example))
    again = validate_policy(spec.engine_dict(7.5))
    assert type(again) is type(spec)
    if spec.releases_statistic():
        assert again.aux_sigma == 7.5 and again.statistic(2).sigma == 7.5
    else:
        assert again == spec
