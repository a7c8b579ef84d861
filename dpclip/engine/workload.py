"""What the optimizer does with the noisy gradients, as far as a correlated-noise strategy is
optimised for it (docs/formulas.md, "Banded matrix factorization", "workload")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dpclip.errors import EngineError

# The block length of :meth:`Workload.response`: long enough to amortise each block's Python
# overhead, short enough that its BLOCK×BLOCK momentum matrix is small.
BLOCK = 64


@dataclass(frozen=True)
class Workload:
    """What the optimizer does with the noisy gradients, as far as the strategy is optimised
    for it: SGD's heavy-ball ``momentum`` β (m_t = β m_{t−1} + g_t, step −η m_t) or Nesterov's
    (step −η (g_t + β m_t)), at a constant learning rate. The parameters move by the running sum
    of h * g, h the impulse response of one gradient on the steps: h_j = β^j (heavy ball),
    h_0 = 1 + β and h_j = β^{j+1} (Nesterov); β = 0 is plain SGD, whose workload is the prefix
    sums. Learning-rate schedules and Adam are not modelled (docs/methods.md)."""

    momentum: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise EngineError(f"momentum must be in [0, 1), got {self.momentum!r}", "SGD's momentum β")

    def momentum_matrix(self, size: int) -> Tensor:
        """M[i, j] = β^{i−j} for i >= j: m = M v + β^{i+1}·m_before over a block of ``size``."""
        lag = torch.arange(size, dtype=torch.float64).reshape(-1, 1) - torch.arange(size, dtype=torch.float64)
        return torch.where(lag >= 0, self.momentum ** lag.clamp_min(0), torch.zeros((), dtype=torch.float64))

    def respond(self, block: Tensor, momentum_before: Tensor, matrix: Tensor) -> tuple[Tensor, Tensor]:
        """(h * d over the block, the momentum state at its end), from the block's d and the
        state before it (heavy ball: the response is the momentum itself)."""
        if self.momentum == 0.0:
            return block, momentum_before
        powers = self.momentum ** torch.arange(1, block.numel() + 1, dtype=torch.float64)
        state = matrix[:block.numel(), :block.numel()] @ block + powers * momentum_before
        response = block + self.momentum * state if self.nesterov else state
        return response, state[-1]


    def response(self, d: Tensor) -> Tensor:
        """h * d over a whole (moderate) vector, block by block (:meth:`respond`)."""
        if self.momentum == 0.0:
            return d
        matrix, state, parts = self.momentum_matrix(BLOCK), torch.zeros((), dtype=torch.float64), []
        for lo in range(0, d.numel(), BLOCK):
            part, state = self.respond(d[lo:lo + BLOCK], state, matrix)
            parts.append(part)
        return torch.cat(parts)


SGD = Workload()
