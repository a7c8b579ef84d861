"""Correlated noise across steps: the banded Toeplitz matrix factorization mechanism.

DP-SGD releases g_t + z_t with z_t i.i.d. N(0, σ²S²). The matrix factorization mechanism
("Multi-epoch matrix factorization mechanisms for private machine learning", Choquette-Choo
et al., ICML 2023; banded: "Amplified banded matrix factorization: a unified approach to
private training", Choquette-Choo et al., NeurIPS 2023, and "Scaling up the banded matrix
factorization mechanism for differentially private ML", McKenna, 2024) releases
g_t + w_t with the noise correlated across the n steps,

    w = C⁻¹ z,        z the same i.i.d. draws,

for a lower-triangular strategy C (n×n over steps). The model follows the running sum of its
gradients (the prefix-sum workload A, lower-triangular ones), whose error is then A C⁻¹ z:
expected squared error σ²S²·d·||A C⁻¹||_F² instead of DP-SGD's σ²S²·d·||A||_F².

Here C is banded and Toeplitz: C[t, s] = c_{t-s} for 0 <= t-s < b, else 0, with b = ``bands``
coefficients c_0..c_{b-1}. Why this shape (the amplified-banded paper's argument):

* sensitivity: an example that participates at most once every b steps touches columns of C
  that are at least b apart, and those have disjoint supports (column s lives on rows
  s..s+b-1), so ||C·1_P||² = Σ_{s∈P} ||C[:, s]||² <= |P|·max column norm². With Σ_j c_j² = 1
  each participation costs exactly what it costs DP-SGD, and the accounting (done elsewhere,
  from b and the sampler) does not depend on c at all; c only changes the utility.
* streaming: C w = z is the recurrence w_t = (z_t - Σ_{j=1}^{b-1} c_j w_{t-j}) / c_0, so the
  noise of step t needs only the last b-1 noises: memory (b-1)·|θ| (:class:`CorrelatedNoise`).
* Toeplitz: b numbers describe C for any n, optimised once per (b, n) (:func:`banded_strategy`).

b = 1 is DP-SGD (c = [1], w = z).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from dpclip.engine.workload import SGD, Workload
from dpclip.errors import EngineError

# The strategy is optimised over at most this many steps, which keeps banded_strategy well
# under ~2 s for any run length (0.1-0.3 s at this cap on a 2-core CPU). The cap costs some
# utility on longer runs, more with more bands. Measured on a 50,000-step run's error, a
# strategy optimised over 8192 steps is worse than one over 16384 by 0.03% (b=2), 0.6% (b=16),
# 2.4% (b=64), 6% (b=256); over 2048 steps it would be worse than 8192 by 0.1%, 3%, 10%, 23%.
MAX_HORIZON = 8192
# At most this many L-BFGS iterations; it stops earlier when the objective stops changing
# (torch's tolerance_change), itself a deterministic test, so the result is a function of
# (bands, horizon) only. In practice it converges well before the cap (gradient ~1e-8).
LBFGS_ITERATIONS = 200
# C⁻¹'s coefficients are computed block by block (prefix_sum_error): a block of at least
# this many steps amortises the per-block Python overhead; blocks are never shorter than b-1.
MIN_BLOCK = 64




def toeplitz_strategy(coefficients: Tensor, steps: int) -> Tensor:
    """The dense lower-triangular banded Toeplitz C (steps×steps): C[t, s] = c_{t-s} for
    0 <= t-s < b, else 0. Differentiable in ``coefficients``; for tests and small n."""
    c = coefficients.reshape(-1)
    lag = torch.arange(steps).reshape(-1, 1) - torch.arange(steps).reshape(1, -1)
    inside = (lag >= 0) & (lag < c.numel())
    # Gather c at every lag (clamped so the index is valid), then zero outside the band.
    gathered = c[lag.clamp(0, c.numel() - 1)]
    return torch.where(inside, gathered, torch.zeros((), dtype=c.dtype))


def _block_recurrence(c: Tensor) -> tuple[Tensor, Tensor]:
    """(first, step): C⁻¹'s first block of L coefficients and the L×L matrix that maps one
    block to the next, L = max(b-1, MIN_BLOCK).

    C d = e_0 (d = first column of C⁻¹, itself lower-triangular Toeplitz) is the recurrence
    d_0 = 1/c_0, d_k = -(Σ_{j=1}^{min(b-1,k)} c_j d_{k-j}) / c_0. One step at a time it is
    n Python iterations of tiny tensor ops (too slow under autograd inside L-BFGS), so it runs
    L >= b-1 steps at a time: a block depends only on the previous one (b-1 <= L), through

        T_low · d_next = -T_up · d_prev,   T_low = C[L:2L, L:2L],  T_up = C[L:2L, 0:L]

    (the two halves of the 2L×2L Toeplitz C), so d_next = M d_prev with M = -T_low⁻¹ T_up,
    and d_first = T_low⁻¹ e_0: exactly the recurrence, by triangular solves (no FFT rounding),
    differentiable.
    """
    block = max(c.numel() - 1, MIN_BLOCK)
    two = toeplitz_strategy(c, 2 * block)
    low, up = two[block:, block:], two[block:, :block]
    unit = torch.zeros(block, 1, dtype=c.dtype)
    unit[0, 0] = 1.0
    first = torch.linalg.solve_triangular(low, unit, upper=False).reshape(-1)
    return first, -torch.linalg.solve_triangular(low, up, upper=False)


def log_prefix_sum_error(coefficients: Tensor, steps: int, workload: Workload = SGD) -> Tensor:
    """log ||A C⁻¹||_F² (:func:`prefix_sum_error`), finite even where C⁻¹ explodes.

    With a :class:`Workload` of momentum β, A is the running sum of the momentum's response
    (A[t, s] = Σ_{u=s}^{t} h_{u−s}), still Toeplitz: e becomes the prefix sums of h * d, the
    momentum filter run over each block with its state carried (and rescaled) like e's.

    A (lower-triangular ones) and C⁻¹ (lower-triangular Toeplitz with coefficients d,
    :func:`_block_recurrence`) multiply into a lower-triangular Toeplitz A C⁻¹ with
    coefficients e_k = Σ_{i<=k} d_i (the prefix sums of d); e_k sits on the n-k entries of the
    k-th subdiagonal, so

        ||A C⁻¹||_F² = Σ_{k=0}^{n-1} (n-k) · e_k².

    Computed block by block in O(steps·L) work, L = max(b-1, MIN_BLOCK). In log space
    because an unstable C (c(x) with a root inside the unit disk, e.g. c = [1, 1.1]) has d
    growing geometrically: over thousands of steps d overflows float64, the plain error is
    inf - inf = NaN, and a NaN poisons L-BFGS's line search (it then walks off to infinity).
    Here the running block is rescaled by a power of two whenever it gets large (exact in
    binary floating point, so a stable C computes the very same numbers as without it) and
    each block's sum is taken relative to its largest term: the log error of an unstable C
    is large and finite, a wall the line search backs off from.
    """
    if steps < 1:
        raise EngineError(f"steps must be >= 1, got {steps}", "the error is over at least one step")
    c = coefficients.reshape(-1).to(torch.float64)[:steps]  # later coefficients never reach row < steps
    v, step = _block_recurrence(c)
    block = v.numel()
    weights = torch.arange(steps, 0, -1, dtype=torch.float64)
    carry = torch.zeros((), dtype=torch.float64)  # e at the end of the previous block, scaled
    state = torch.zeros((), dtype=torch.float64)  # the workload's momentum after the previous block, scaled
    matrix = workload.momentum_matrix(block) if workload.momentum else None
    exponent = 0  # the true d, e and momentum are 2**exponent times v, carry and state
    terms = []
    for lo in range(0, steps, block):
        if lo:
            v = step @ v
        response, state = workload.respond(v[:steps - lo], state, matrix)
        e = carry + torch.cumsum(response, 0)
        # Σ w e² = m² Σ w (e/m)², m the largest |e| (a constant: any m gives the same value
        # and gradient), so no square overflows.
        m = e.detach().abs().max().clamp_min(torch.finfo(torch.float64).tiny)
        part = (weights[lo:lo + block] * (e / m).square()).sum()
        terms.append(part.log() + 2 * (m.log() + exponent * math.log(2.0)))
        carry = e[-1]
        big = max(float(v.detach().abs().max()), abs(float(carry.detach())), abs(float(state.detach())))
        if math.isfinite(big) and big > 2.0 ** 64:
            shift = math.frexp(big)[1]
            v, carry, state = (torch.ldexp(x, torch.tensor(-shift)) for x in (v, carry, state))
            exponent += shift
    return torch.logsumexp(torch.stack(terms), 0)


def prefix_sum_error(coefficients: Tensor, steps: int, workload: Workload = SGD) -> Tensor:
    """||A C⁻¹||_F² for the prefix-sum workload A over ``steps`` steps: Σ_k (n-k)·e_k², e the
    prefix sums of C⁻¹'s coefficients (:func:`log_prefix_sum_error` gives the derivation).

    O(steps·max(b, MIN_BLOCK)) work instead of a dense O(steps³) solve; float64;
    differentiable (autograd) in ``coefficients``; coefficients past ``steps`` never reach the
    first ``steps`` rows and are ignored. With Σ_j c_j² = 1 the noise's expected squared error
    on the running sum is σ²S²·(parameters)·prefix_sum_error(c, n); DP-SGD's (c = [1]) is
    σ²S²·(parameters)·n(n+1)/2.
    """
    return log_prefix_sum_error(coefficients, steps, workload).exp()


def square_root_coefficients(bands: int) -> Tensor:
    """The first b coefficients of (1 - x)^{-1/2}: r_k = binom(2k, k) / 4^k, float64.

    The lower-triangular Toeplitz R with these coefficients is the square root of the
    prefix-sum matrix (R² = A, because ((1-x)^{-1/2})² = (1-x)^{-1}); banding it is the
    "square root factorization" of Fichtenberger, Henzinger and Upadhyay, "Constant matters:
    fine-grained error bound on differentially private continual observation" (ICML 2023),
    and the starting point of :func:`banded_strategy`. Built by the ratio
    r_k = r_{k-1}·(2k-1)/(2k), which never forms the huge binomials.
    """
    r = [1.0]
    for k in range(1, bands):
        r.append(r[-1] * (2 * k - 1) / (2 * k))
    return torch.tensor(r, dtype=torch.float64)


def scale_free_error(coefficients: Tensor, steps: int, workload: Workload = SGD) -> Tensor:
    """prefix_sum_error(c, steps) · Σ_j c_j²: the error at unit max column norm.

    Scaling c by α scales C⁻¹ by 1/α and the sensitivity by α, so this product (error after
    normalising to Σ c² = 1) is what a strategy is judged by."""
    c = coefficients.reshape(-1).to(torch.float64)
    return prefix_sum_error(c, steps, workload) * c.square().sum()


def _log_scale_free_error(c: Tensor, steps: int, workload: Workload = SGD) -> Tensor:
    """log of :func:`scale_free_error`, finite for unstable C (the optimiser's objective)."""
    return log_prefix_sum_error(c, steps, workload) + c.square().sum().log()


@functools.lru_cache(maxsize=64)
def _optimised(bands: int, horizon: int, workload: Workload = SGD) -> tuple[float, ...]:
    """The normalised optimal coefficients as plain floats (immutable, safe to cache)."""
    start = square_root_coefficients(bands)
    start = start / start.norm()
    x = start.clone().requires_grad_(True)
    # The log of the scale-free error: the raw error grows up to n² (DP-SGD), its log keeps the
    # line search's steps and L-BFGS's curvature pairs of order one at any horizon.
    optimiser = torch.optim.LBFGS([x], lr=1.0, max_iter=LBFGS_ITERATIONS, history_size=20,
                                  tolerance_grad=1e-12, tolerance_change=1e-14,
                                  line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimiser.zero_grad()
        loss = _log_scale_free_error(x, horizon, workload)
        loss.backward()
        return loss

    optimiser.step(closure)
    best = x.detach()
    # The objective is even in c (C and -C have the same error and sensitivity): keep c_0 > 0.
    if best[0] < 0:
        best = -best
    # A search that ended somewhere non-finite or worse than it began falls back to the
    # square root, which is always a valid (stable) strategy.
    with torch.no_grad():
        found, initial = _log_scale_free_error(best, horizon, workload), _log_scale_free_error(start, horizon, workload)
    if not bool(torch.isfinite(found)) or found > initial:
        best = start
    best = best / best.norm()
    return tuple(float(v) for v in best)


def banded_strategy(bands: int, steps: int, workload: Workload = SGD) -> Tensor:
    """The b coefficients c of the banded Toeplitz strategy for a run of ``steps`` steps.

    Minimises the scale-free error prefix_sum_error(c, n) · Σ_j c_j² (:func:`scale_free_error`)
    over the n = min(steps, MAX_HORIZON) first steps (the cap keeps this fast; the optimum
    barely moves past it), starting from the banded square root
    (:func:`square_root_coefficients`) and refining with a fixed number of L-BFGS iterations,
    as McKenna's scaling-up paper does for banded Toeplitz strategies (optimising the b
    coefficients directly rather than a dense n×n C). The result is normalised so that
    Σ_j c_j² = 1 (max column norm 1: sensitivity exactly DP-SGD's, module doc), with c_0 > 0.

    With a momentum ``workload`` the error is that of the momentum's running sum
    (:class:`Workload`). Nothing random: c is a function of (bands, steps, workload) only, public inputs, so it is
    recomputed rather than stored and needs no privacy budget. Results are cached per
    (bands, horizon); a fresh tensor is returned on each call. bands = 1 is DP-SGD: [1.0].
    """
    if not isinstance(bands, int) or not isinstance(steps, int) or steps < 1:
        raise EngineError(f"bands and steps must be integers, steps >= 1; got bands={bands!r}, steps={steps!r}",
                          "pass the number of bands b and the run's number of steps")
    if bands < 1 or bands > steps:
        raise EngineError(f"bands must be between 1 and the number of steps ({steps}), got {bands}",
                          "use bands=1 for DP-SGD's independent noise, or at most one band per step; "
                          "the sampler must keep each example's participations at least b steps apart")
    if bands == 1:
        return torch.tensor([1.0], dtype=torch.float64)
    return torch.tensor(_optimised(bands, min(steps, MAX_HORIZON), workload), dtype=torch.float64)


# The cache is on the private solver; this clears it (tests, or to free memory).
banded_strategy.cache_clear = _optimised.cache_clear  # type: ignore[attr-defined]


def check_same_tensors(fresh: list[Tensor], kept: list[list[Tensor]], what: str, held: str) -> None:
    """A stream's state holds ``kept[p]`` for parameter p: the same parameters every step, in
    the same order, shape and precision (another list would mix the noise of one parameter into
    another's). State loaded on another device is moved once, a bit-exact copy."""
    if len(fresh) != len(kept):
        raise EngineError(f"{what} got {len(fresh)} tensors, its {held} has {len(kept)}",
                          "pass one tensor per parameter, the same parameters in the same order every step")
    for i, (z, state) in enumerate(zip(fresh, kept)):
        first = state[0]
        if z.shape != first.shape or z.dtype != first.dtype:
            raise EngineError(f"{what} tensor {i} is {tuple(z.shape)} {z.dtype}, its {held} is "
                              f"{tuple(first.shape)} {first.dtype}",
                              "pass the same parameters in the same order and precision every step")
        if z.device != first.device:
            state[:] = [w.to(z.device) for w in state]


class CorrelatedNoise:
    """Streamed correlated noise w = C⁻¹ z for a banded Toeplitz C with ``coefficients``.

    Each step, :meth:`correlate_` turns the step's fresh draws z_t (one tensor per parameter)
    in place into

        w_t = (z_t - Σ_{j=1}^{b-1} c_j w_{t-j}) / c_0

    (row t of C w = z; w_s = 0 for s < 0, C starting at step 0), keeping the last b-1 noises
    per parameter in a ring buffer: memory (b-1)·|θ|, one copy per step. The history is
    secret: with it and the released gradients one can subtract noise from later steps. It
    lives in checkpoints beside the noise generators' states (:meth:`state_dict`), never in
    anything released. b = 1 keeps nothing and leaves z unchanged (DP-SGD).
    """

    def __init__(self, coefficients: Tensor):
        c = torch.as_tensor(coefficients, dtype=torch.float64).reshape(-1)
        if c.numel() < 1 or not bool(torch.isfinite(c).all()) or float(c[0]) <= 0:
            raise EngineError(f"correlated noise needs finite coefficients with c_0 > 0, got {c.tolist()}",
                              "use banded_strategy(bands, steps)")
        self.coefficients = c.clone()
        # Python floats: multiplying a float32 tensor by one keeps it float32.
        self._c = [float(v) for v in c]
        self.bands = c.numel()
        self.step = 0
        # _ring[p][slot]: w_s of parameter p in slot s % (b-1); allocated on the first step.
        self._ring: list[list[Tensor]] | None = None

    def correlate_(self, fresh: list[Tensor]) -> None:
        """z_t → w_t in place, for every parameter's tensor of this step's fresh draws."""
        if self.bands == 1:
            self.step += 1
            return
        width = self.bands - 1
        if self._ring is None:
            self._ring = [[torch.zeros_like(z) for _ in range(width)] for z in fresh]
        self._check(fresh)
        t = self.step
        for z, ring in zip(fresh, self._ring):
            for j in range(1, min(width, t) + 1):
                z.add_(ring[(t - j) % width], alpha=-self._c[j])
            z.div_(self._c[0])
            # Slot t % width held w_{t-(b-1)}, used above for the last time (j = b-1).
            ring[t % width].copy_(z)
        self.step += 1

    def _check(self, fresh: list[Tensor]) -> None:
        assert self._ring is not None
        check_same_tensors(fresh, self._ring, "correlated noise", "history")

    def state_dict(self) -> dict:
        """Step count, coefficients and the kept noises, newest first (copies: the live
        buffers change every step). Secret: save with the generator states, never release."""
        history: list[list[Tensor]] = []
        if self._ring is not None:
            width = self.bands - 1
            kept = min(width, self.step)
            history = [[ring[(self.step - j) % width].clone() for j in range(1, kept + 1)] for ring in self._ring]
        return {"step": self.step, "coefficients": self.coefficients.clone(), "history": history}

    def load_state_dict(self, state: dict) -> None:
        """Resume where :meth:`state_dict` left off; the next :meth:`correlate_` continues
        exactly (bit for bit) as the saved stream would have."""
        saved = torch.as_tensor(state["coefficients"], dtype=torch.float64).reshape(-1)
        if saved.shape != self.coefficients.shape or not torch.equal(saved, self.coefficients):
            # A changed C mid-run is a different mechanism: neither the error analysis nor
            # the column-disjointness argument covers the seam.
            raise EngineError("the checkpoint's correlated-noise coefficients differ from this run's",
                              "resume with the same bands, steps and optimizer momentum the run started with (the "
                              "coefficients are optimised for the momentum: training.optimizer.momentum)")
        step = int(state["step"])
        history = state["history"]
        width = self.bands - 1
        if width == 0 or (step == 0 and not history):
            self.step, self._ring = step, None
            return
        kept = min(width, step)
        if any(len(h) != kept for h in history):
            raise EngineError(f"the checkpoint's correlated-noise history does not hold {kept} steps",
                              "resume from an intact checkpoint")
        ring = []
        for newest_first in history:
            slots = [torch.zeros_like(newest_first[0]) for _ in range(width)]
            for j, w in enumerate(newest_first, start=1):
                slots[(step - j) % width] = w.clone()
            ring.append(slots)
        self.step, self._ring = step, ring
