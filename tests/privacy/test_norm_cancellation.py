"""The cancellation attack: no input can make a per-sample norm come out too small.

An attacker who controls one training example crafts its activations so that the terms of
the ghost norm Σ_{t,s} (a_t·a_s)(g_t·g_s) cancel: two positions with a_{1,2} = ±K·u + w and
the same output gradient v. The exact per-sample gradient is v (2w)ᵀ, of norm 2‖v‖‖w‖, but
every term is of size K², so float32 returns round-off (≤ 0 is clamped to 0, and the sample
would pass unclipped: 10·C and more before the fix). The invariant tested: whatever the norm
path, grouping and precision, removing the crafted example changes each group's clipped sum
by at most C·(1 + 1e-5) (docs/formulas.md, "Cancellation").
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.cancellation import (CANCELLATION_TOLERANCE, cancellation_bound, cancellation_flags, certified_rows,
                                        stacked_cancellation_flags)
from dpclip.engine.factors import Bilinear, Dense, param_norm_sq

C = 1.0
SLACK = 1 + 1e-5
METHODS = ["ghost", "instantiate", "auto"]
GROUPINGS = ["all-layer", "layer", "param"]


def _vectors(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(d, generator=g) for _ in range(3))


def crafted_inputs(d: int, scale: float, benign: int = 3, seed: int = 0) -> torch.Tensor:
    """[1 + benign, 2, d]: the crafted example first (rows ±scale·u + w), then benign ones."""
    u, w, _ = _vectors(d, seed)
    attack = torch.stack([scale * u + w, -scale * u + w])
    others = torch.randn(benign, 2, d, generator=torch.Generator().manual_seed(seed + 1))
    return torch.cat([attack[None], others])


class LinearProbe(nn.Module):
    """y = W a (+ b); per-sample loss Σ_t ⟨y_t, v⟩, so every position's output gradient is v."""

    def __init__(self, d: int, p: int, bias: bool):
        super().__init__()
        self.lin = nn.Linear(d, p, bias=bias)
        self.register_buffer("v", torch.randn(p, generator=torch.Generator().manual_seed(7)))

    def forward(self, x):
        return (self.lin(x) * self.v).sum((1, 2))


class EmbeddingProbe(nn.Module):
    """The same token at both positions, with output gradients ±scale·u + w (the example's
    own coefficients): the embedding row's gradient is their sum, 2w."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)

    def forward(self, ids, coeffs):
        return (self.emb(ids) * coeffs).sum((1, 2))


def group_contributions(make_engine, run, with_attack, without_attack) -> list[float]:
    """‖S(D) − S(D − attacker)‖ per group, from the engine's own clipped sums (no noise)."""
    sums = []
    for batch in (with_attack, without_attack):
        engine = make_engine()
        engine.backward(run(engine.model, batch))
        sums.append(engine.debug_clipped())
        engine.detach()
    groups = engine.groups
    out = []
    for members in groups.members:
        sq = sum(float((sums[0].sums[groups.params[j].name] - sums[1].sums[groups.params[j].name])
                       .double().pow(2).sum()) for j in members)
        out.append(math.sqrt(sq))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp64", "bf16-weights"])
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", [1e3, 1e5])
@pytest.mark.parametrize("bias", [False, True])
def test_crafted_linear_input_moves_no_group_by_more_than_c(precision, grouping, method, scale, bias):
    d, p = 16, 8
    torch.manual_seed(0)
    model = LinearProbe(d, p, bias)
    x = crafted_inputs(d, scale)
    if precision == "fp64":
        model, x = model.double(), x.double()
    if precision == "bf16-weights":   # the model itself in bfloat16, no autocast
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)

    def make_engine():
        return DPEngine(model, {"grouping": grouping, "norm_method": method,
                                "threshold": {"kind": "fixed", "value": C}},
                        gradient_noise_multiplier=0.0, expected_batch_size=4)

    def run(m, batch):
        if precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(batch).float()
        return m(batch)

    contributions = group_contributions(make_engine, run, x, x[1:])
    assert max(contributions) <= C * SLACK, contributions
    if not precision.startswith("bf16"):  # clipped, not dropped (bf16 rounds both rows to ±bf16(K·u): 0)
        assert max(contributions) > 0.5 * C


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("method", METHODS)
def test_crafted_embedding_gradients_move_no_group_by_more_than_c(grouping, method):
    d, vocab = 16, 10
    torch.manual_seed(0)
    model = EmbeddingProbe(vocab, d)
    coeffs = crafted_inputs(d, 1e5)
    ids = torch.tensor([[3, 3], [1, 2], [4, 3], [5, 5]])

    def make_engine():
        return DPEngine(model, {"grouping": grouping, "norm_method": method,
                                "threshold": {"kind": "fixed", "value": C}},
                        gradient_noise_multiplier=0.0, expected_batch_size=4)

    def run(m, batch):
        return m(*batch)

    contributions = group_contributions(make_engine, run, (ids, coeffs), (ids[1:], coeffs[1:]))
    assert C * 0.5 < max(contributions) <= C * SLACK, contributions


def test_crafted_example_takes_the_float64_path_and_benign_ones_do_not():
    torch.manual_seed(0)
    model = LinearProbe(16, 8, bias=False)
    engine = DPEngine(model, {"norm_method": "ghost", "threshold": {"kind": "fixed", "value": C}},
                      gradient_noise_multiplier=0.0, expected_batch_size=4)
    engine.backward(model(crafted_inputs(16, 1e5)))
    debug = engine.debug_clipped()
    assert debug.paths["lin.weight"] == "ghost + float64 for 1 cancelling sample(s)"
    # the crafted example's exact norm is 2‖v‖‖w‖; the engine's is not below it, and above
    # it only by the float64 bound γ·M² (here ~1e-3: M ≈ 2·10⁵‖u‖‖v‖ against ‖G‖ ≈ 25)
    _, w, _ = _vectors(16, 0)
    exact = 2 * float(model.v.double().norm()) * float(w.double().norm())
    assert exact <= float(debug.norms[0, 0]) <= exact * (1 + 1e-3)
    engine.backward(model(crafted_inputs(16, 1e5)[1:]))
    assert engine.debug_clipped().paths["lin.weight"] == "ghost"


# ------------------------------------------------------------- the stated error bound


def _exact_norm_sq(left: torch.Tensor, right: torch.Tensor) -> int:
    """||Lᵀ R||² in Python integers: exact for integer-valued factors."""
    lt, rt = left.long().tolist(), right.long().tolist()
    t, m, n = len(lt), len(lt[0]), len(rt[0])
    return sum(sum(lt[s][i] * rt[s][j] for s in range(t)) ** 2 for i in range(m) for j in range(n))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(t_extra=st.integers(0, 12), m=st.integers(1, 12), n=st.integers(1, 12),
       log_scale=st.integers(0, 18), seed=st.integers(0, 10_000))
def test_unflagged_ghost_norms_are_within_the_tolerance_and_flagged_ones_are_bounded_above(
        t_extra, m, n, log_scale, seed):
    """Integer factors (exact in float32 and in Python integers): a cancelling pair of
    positions scaled by 2^log_scale plus random ones. An unflagged float32 ghost norm² is
    within CANCELLATION_TOLERANCE of exact; a flagged one's float64 bound is ≥ exact and
    above it by no more than the stated γ·M², γ = 2(m + n + T² + 8)·u₆₄."""
    g = torch.Generator().manual_seed(seed)
    scale = 2 ** log_scale
    lead = torch.randint(-4, 5, (m,), generator=g)
    u, w = torch.randint(-4, 5, (n,), generator=g), torch.randint(-4, 5, (n,), generator=g)
    left = torch.cat([torch.stack([lead, lead]), torch.randint(-4, 5, (t_extra, m), generator=g)])
    right = torch.cat([torch.stack([scale * u + w, -scale * u + w]),
                       torch.randint(-4, 5, (t_extra, n), generator=g)])
    exact = _exact_norm_sq(left, right)
    use = Bilinear(left.float()[None, None], right.float()[None, None])
    got, _, atoms = param_norm_sq([use], torch.Size([m, n]), "ghost", with_atoms=True)
    flags = cancellation_flags([use], got, atoms)
    if not bool(flags[0]):
        assert abs(float(got[0]) - exact) <= CANCELLATION_TOLERANCE * exact
    else:
        upper, _ = certified_rows([use], torch.tensor([0]), torch.Size([m, n]), "ghost")
        size = float((left.double().norm(dim=1) * right.double().norm(dim=1)).sum())
        gamma = 2 * (m + n + left.shape[0] ** 2 + 8) * 2.0 ** -53
        assert exact <= float(upper[0]) <= exact * (1 + 1e-12) + 2 * gamma * size ** 2


def test_a_groups_stacked_check_flags_exactly_the_samples_each_parameters_own_check_flags():
    """The engine checks a group's parameters in one stacked comparison
    (stacked_cancellation_flags); it must flag what each parameter's own check flags, at the
    boundary too. Parameters of different widths and lengths (different bounds); samples
    with a norm² just above, at and below u·sqrt(m + n + T)·D/ρ, with a NaN and with a zero."""
    g = torch.Generator().manual_seed(5)
    shapes = [(3, 4, 7), (9, 2, 5), (1, 16, 3)]   # (m, n, T)
    uses, norms, atoms = [], [], []
    for m, n, t in shapes:
        use = Bilinear(torch.randn(6, 1, t, m, generator=g), torch.randn(6, 1, t, n, generator=g))
        bound = cancellation_bound([use], torch.float32)
        atom = torch.rand(6, generator=g) + 0.5
        edge = bound * atom / CANCELLATION_TOLERANCE
        norm = torch.stack([edge * 1.0001, edge, edge * 0.9999, torch.full_like(edge, float("nan")),
                            torch.zeros_like(edge), edge * 100]).diagonal()
        uses.append(use)
        norms.append(norm)
        atoms.append(atom)
    own = torch.stack([cancellation_flags([u], s, a) for u, s, a in zip(uses, norms, atoms)])
    stacked = stacked_cancellation_flags(torch.stack(norms), torch.stack(atoms),
                                         [cancellation_bound([u], torch.float32) for u in uses])
    assert torch.equal(stacked, own)
    assert own[:, 2].all() and own[:, 4].all() and not own[:, 0].any() and not own[:, 3].any()
    assert cancellation_bound([Dense(torch.ones(6, 3))], torch.float32) is None
