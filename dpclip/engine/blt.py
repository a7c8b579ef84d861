"""Correlated noise from a few buffers: the buffered linear Toeplitz (BLT) mechanism.

Like banded MF (:mod:`dpclip.engine.correlated`) the step-t noise is row t of w = C⁻¹z for a
lower-triangular Toeplitz strategy C, but C is not banded: its generating function is the
rational function

    C(x) = Π_j (1 − θ̂_j x) / Π_j (1 − θ_j x),     j = 1..k  (k = ``buffers``),

so c_0 = 1 and c_m = Σ_i ω_i θ_i^{m−1} for m >= 1, and C⁻¹ is the same kind of matrix with the
roles of θ and θ̂ swapped: d_0 = 1, d_m = Σ_i ω̂_i θ̂_i^{m−1} (partial fractions:
ω_i = Π_j (θ_i − θ̂_j) / Π_{j≠i} (θ_i − θ_j), ω̂ likewise). "Efficient and near-optimal noise
generation for streaming differential privacy" (Dvijotham, McMahan, Pillutla, Steinke,
Thakurta, FOCS 2024) and "A hassle-free algorithm for private learning in practice"
(McMahan, Xu, Zhang, 2024) introduce it. Why this shape:

* streaming: w_t = z_t + Σ_i ω̂_i A_i with buffers A_i ← θ̂_i A_i + z_t (A_i is the geometric
  sum Σ_{s<t} θ̂_i^{t−1−s} z_s), so the noise needs k buffers, memory k·|θ|, for any run length
  (:class:`BufferedNoise`); banded MF needs b − 1.
* sensitivity: the columns of C are not disjoint, so an example's participations add up. With
  the poles interlaced, 0 < θ̂_1 < θ_1 < θ̂_2 < … < θ̂_k < θ_k < 1, every ω_i > 0 and C's
  coefficients are positive and non-increasing (each c_m is a positive sum of decreasing
  powers; c_1 = Σθ − Σθ̂ < 1 = c_0). For such C, among participations at least G steps apart
  the worst is the earliest and densest, steps 0, G, 2G, …: Kalinin and Lampert, "Banded
  square root matrix factorization for differentially private model training" (NeurIPS
  2024), Thm. 2. Its squared norm ‖Σ_i C[:, iG]‖² is the sensitivity² (per unit clip norm),
  computed for every prefix of the run in :func:`participation_sensitivities`.
* no amplification by sampling is claimed for it (docs/formulas.md, "BLT"): the whole run is
  one Gaussian mechanism of multiplier σ / sensitivity.

The interlaced poles are the optimiser's parameterisation (positions in (0, 1) from a
softmax of 2k + 1 gaps), so every point it visits is a valid strategy, not one a penalty has
to push back; the result is still checked on every coefficient the run uses.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dpclip.engine.correlated import LBFGS_ITERATIONS, MAX_HORIZON, CorrelatedNoise, check_same_tensors
from dpclip.engine.workload import SGD, Workload
from dpclip.errors import EngineError

#: At most this many buffers: each is one more |θ| of memory, and beyond a handful the poles
#: crowd together (their differences divide ω).
MAX_BUFFERS = 8
F64 = torch.float64


@dataclass(frozen=True)
class BltStrategy:
    """The poles of C (``theta``) and of C⁻¹ (``theta_hat``), interlaced, float64 tuples."""

    theta: tuple[float, ...]
    theta_hat: tuple[float, ...]

    @property
    def buffers(self) -> int:
        return len(self.theta)

    def weights(self) -> tuple[Tensor, Tensor]:
        """(ω, ω̂): the partial-fraction weights of C and C⁻¹ (module doc)."""
        theta, theta_hat = torch.tensor(self.theta, dtype=F64), torch.tensor(self.theta_hat, dtype=F64)
        return _weights(theta, theta_hat), _weights(theta_hat, theta)

    def coefficients(self, steps: int) -> Tensor:
        """c_0..c_{steps−1}: C's first column (c_0 = 1, c_m = Σ ω_i θ_i^{m−1})."""
        omega, _ = self.weights()
        return _series(torch.tensor(self.theta, dtype=F64), omega, steps)

    def inverse_coefficients(self, steps: int) -> Tensor:
        """d_0..d_{steps−1}: C⁻¹'s first column (d_0 = 1, d_m = Σ ω̂_i θ̂_i^{m−1})."""
        _, omega_hat = self.weights()
        return _series(torch.tensor(self.theta_hat, dtype=F64), omega_hat, steps)


def _weights(poles: Tensor, zeros: Tensor) -> Tensor:
    """ω_i = Π_j (p_i − z_j) / Π_{j≠i} (p_i − p_j): the weight of 1/(1 − p_i x) in the partial
    fractions of Π(1 − z_j x)/Π(1 − p_j x) (minus its constant 1)."""
    numerator = (poles[:, None] - zeros[None, :]).prod(dim=1)
    differences = poles[:, None] - poles[None, :]
    differences = differences + torch.eye(poles.numel(), dtype=poles.dtype)  # the j = i factor is 1
    return numerator / differences.prod(dim=1)


def _series(poles: Tensor, weights: Tensor, steps: int) -> Tensor:
    """[1, Σ w_i p_i^0, Σ w_i p_i^1, …] (``steps`` terms), p^m as exp(m log p) for any m."""
    powers = torch.exp(torch.arange(max(steps - 1, 0), dtype=F64)[:, None] * poles.log()[None, :])
    return torch.cat([torch.ones(1, dtype=F64), powers @ weights])[:steps]


def participation_vector(c: Tensor, groups: int) -> Tensor:
    """v = Σ_i C[:, iG] over the rows of c: v_t = Σ_{i: iG <= t} c_{t−iG} (the worst pattern's
    column sum, module doc), by a cumulative sum down each residue class t mod G."""
    steps = c.numel()
    rows = -(-steps // groups)
    padded = torch.cat([c, c.new_zeros(rows * groups - steps)]).reshape(rows, groups)
    return padded.cumsum(dim=0).reshape(-1)[:steps]


def participation_sensitivities(strategy: BltStrategy, steps: int, groups: int) -> tuple[float, ...]:
    """s_j², j = 0..K−1 (K = ⌈steps/G⌉): the squared sensitivity (per unit clip norm) of the
    run's first min((j + 1)·G, steps) steps, participations at 0, G, …, jG.

    The first m rows of Σ_{i<K} C[:, iG] only see the participations before m, so each prefix's
    vector is the whole vector cut at m and s_j² is a running sum of its squares. Refuses a
    strategy whose coefficients are not positive and non-increasing over ``steps`` (where the
    worst-pattern theorem would not apply)."""
    if not isinstance(groups, int) or groups < 1:
        raise EngineError(f"groups must be a whole number >= 1, got {groups!r}", "G = ⌊1/q⌋ for BLT")
    c = strategy.coefficients(steps)
    check_monotone(c)
    squares = participation_vector(c, groups).square().cumsum(dim=0)
    ends = [min((j + 1) * groups, steps) - 1 for j in range(-(-steps // groups))]
    return tuple(float(squares[end]) for end in ends)


def check_monotone(c: Tensor) -> None:
    """c > 0 and non-increasing: the condition of the worst-pattern theorem (module doc)."""
    if not bool((c > 0).all()) or not bool((c[1:] <= c[:-1]).all()):
        raise EngineError("the BLT strategy's coefficients are not positive and non-increasing",
                          "use fewer buffers; this is a bug if it happens with the built-in strategy")


def _positions(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(θ, θ̂) from 2k + 1 gap logits: positions = cumulative softmax, interlaced θ̂_1 < θ_1 < …"""
    positions = torch.softmax(logits, dim=0).cumsum(dim=0)[:-1]
    return positions[1::2], positions[0::2]


def log_loss(theta: Tensor, theta_hat: Tensor, steps: int, groups: int, workload: Workload = SGD) -> Tensor:
    """log(‖A C⁻¹‖_F² · s²): the prefix-sum error of the noise C⁻¹z (A lower-triangular ones,
    error Σ_m (n − m)·e_m² with e the prefix sums of d; with momentum, of the momentum's
    response h * d: :class:`~dpclip.engine.correlated.Workload`) times the squared sensitivity
    over the whole horizon: scale-free, what the optimiser minimises."""
    d = _series(theta_hat, _weights(theta_hat, theta), steps)
    e = workload.response(d).cumsum(dim=0)
    error = (torch.arange(steps, 0, -1, dtype=F64) * e.square()).sum()
    c = _series(theta, _weights(theta, theta_hat), steps)
    sensitivity = participation_vector(c, groups).square().sum()
    return error.log() + sensitivity.log()


def _refine(logits: Tensor, horizon: int, groups: int, workload: Workload) -> tuple[Tensor, float]:
    """L-BFGS from ``logits``: (the better of the start and where it ends, its loss)."""
    start = logits.detach().clone()
    logits = start.clone().requires_grad_(True)
    optimiser = torch.optim.LBFGS([logits], lr=1.0, max_iter=LBFGS_ITERATIONS, history_size=20,
                                  tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimiser.zero_grad()
        loss = log_loss(*_positions(logits), horizon, groups, workload)
        loss.backward()
        return loss

    optimiser.step(closure)
    with torch.no_grad():
        found, initial = (float(log_loss(*_positions(x), horizon, groups, workload)) for x in (logits.detach(), start))
    if not math.isfinite(found) or found > initial:
        return start, initial
    return logits.detach().clone(), found


def _logits(theta_hat_and_theta: list[float]) -> Tensor:
    """Gap logits of ascending positions in (0, 1) (the inverse of :func:`_positions`)."""
    positions = torch.tensor(theta_hat_and_theta, dtype=F64)
    gaps = torch.cat([positions[:1], positions[1:] - positions[:-1], 1.0 - positions[-1:]])
    return gaps.log()


@functools.lru_cache(maxsize=32)
def _optimised(buffers: int, horizon: int, groups: int, workload: Workload = SGD) -> BltStrategy:
    # Two starts, the better end kept. (1) The 2k poles spread evenly in log(1 − x) between
    # 1 − n^{−1/(2k+1)} and 1 − n^{−2k/(2k+1)}: rational approximations of a Stieltjes function
    # such as (1 − x)^{−1/2}, the prefix sums' square root, have their poles spread like this.
    # (2) The optimum with one buffer fewer and a nearly cancelling pole-zero pair below its
    # poles: it starts at that optimum's loss, so k buffers never end worse than k − 1.
    count = 2 * buffers
    starts = [_logits([1.0 - horizon ** (-(i + 1) / (count + 1)) for i in range(count)])]
    if buffers > 1:
        fewer = _optimised(buffers - 1, horizon, groups, workload)
        lowest = fewer.theta_hat[0]
        interlaced = [v for pair in zip(fewer.theta_hat, fewer.theta) for v in pair]
        starts.append(_logits([lowest / 3.0, lowest / 3.0 * (1 + 1e-6)] + interlaced))
    best, best_loss = None, math.inf
    for start in starts:
        logits, loss = _refine(start, horizon, groups, workload)
        if loss < best_loss:
            best, best_loss = logits, loss
    theta, theta_hat = _positions(best)
    return BltStrategy(tuple(float(v) for v in theta), tuple(float(v) for v in theta_hat))


def blt_strategy(buffers: int, steps: int, groups: int, workload: Workload = SGD) -> BltStrategy:
    """The BLT strategy with ``buffers`` buffers for a run of ``steps`` steps whose examples take
    part at most once every ``groups`` steps.

    Minimises the error of the noise on the running sum times the sensitivity² under that
    participation (:func:`log_loss`) over the first n = min(steps, 8192) steps, by L-BFGS in
    float64 from a fixed start: a function of (buffers, n, groups, workload) only, public
    inputs, cached, no privacy budget. The poles stay interlaced in (0, 1) (module doc). With a
    momentum ``workload`` the error is that of the momentum's running sum."""
    for name, value in (("buffers", buffers), ("steps", steps), ("groups", groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineError(f"{name} must be a whole number >= 1, got {value!r}",
                              "pass the number of buffers, the run's steps and its participation groups")
    if buffers > MAX_BUFFERS:
        raise EngineError(f"buffers must be at most {MAX_BUFFERS}, got {buffers}",
                          "a few buffers: more only crowd the poles together")
    return _optimised(buffers, min(steps, MAX_HORIZON), groups, workload)


blt_strategy.cache_clear = _optimised.cache_clear  # type: ignore[attr-defined]


class BufferedNoise:
    """Streamed BLT noise w = C⁻¹z from k buffers per parameter.

    :meth:`correlate_` turns a step's fresh draws z_t in place into w_t = z_t + Σ_i ω̂_i A_i and
    then updates A_i ← θ̂_i A_i + z_t (module doc). The buffers are secret (with them and the
    released gradients the noise of later steps could be predicted): they go into checkpoints
    with the generators' states (:meth:`state_dict`), never into anything released.
    """

    def __init__(self, strategy: BltStrategy):
        self.strategy = strategy
        _, omega_hat = strategy.weights()
        self._decay = [float(v) for v in strategy.theta_hat]
        self._scale = [float(v) for v in omega_hat]
        if not all(math.isfinite(v) for v in self._scale):
            raise EngineError("the BLT strategy's weights are not finite", "use blt_strategy(buffers, steps, groups)")
        self.step = 0
        self._buffers: list[list[Tensor]] | None = None  # [parameter][buffer]

    @property
    def buffers(self) -> int:
        return len(self._decay)

    def correlate_(self, fresh: list[Tensor]) -> None:
        """z_t → w_t in place, for every parameter's tensor of this step's fresh draws."""
        if self._buffers is None:
            self._buffers = [[torch.zeros_like(z) for _ in self._decay] for z in fresh]
        self._check(fresh)
        for z, buffers in zip(fresh, self._buffers):
            correction = torch.zeros_like(z)
            for scale, decay, buffer in zip(self._scale, self._decay, buffers):
                correction.add_(buffer, alpha=scale)
                buffer.mul_(decay).add_(z)
            z.add_(correction)
        self.step += 1

    def _check(self, fresh: list[Tensor]) -> None:
        assert self._buffers is not None
        check_same_tensors(fresh, self._buffers, "BLT noise", "buffers")

    def state_dict(self) -> dict:
        """Step count, poles and buffer copies. Secret: save with the generator states."""
        buffers = [] if self._buffers is None else [[b.clone() for b in row] for row in self._buffers]
        return {"step": self.step, "theta": list(self.strategy.theta), "theta_hat": list(self.strategy.theta_hat),
                "buffers": buffers}

    def load_state_dict(self, state: dict) -> None:
        if (tuple(state.get("theta", ())) != self.strategy.theta
                or tuple(state.get("theta_hat", ())) != self.strategy.theta_hat):
            raise EngineError("the checkpoint's BLT strategy differs from this run's",
                              "resume with the same buffers, steps, batch size and optimizer momentum the run started "
                              "with (the buffers are optimised for the momentum: training.optimizer.momentum)")
        buffers = state["buffers"]
        if buffers and any(len(row) != self.buffers for row in buffers):
            raise EngineError(f"the checkpoint's BLT state does not hold {self.buffers} buffers per parameter",
                              "resume from an intact checkpoint")
        self.step = int(state["step"])
        self._buffers = [[b.clone() for b in row] for row in buffers] if buffers else None


def noise_streamer(strategy) -> CorrelatedNoise | BufferedNoise | None:
    """What turns a step's fresh draws into its correlated noise: BLT's buffers for a
    :class:`BltStrategy`, banded MF's history for banded coefficients (more than one), or
    None (DP-SGD's independent noise) for None or a single coefficient."""
    if strategy is None:
        return None
    if isinstance(strategy, BltStrategy):
        return BufferedNoise(strategy)
    return CorrelatedNoise(strategy) if len(strategy) > 1 else None
