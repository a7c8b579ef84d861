"""What the engine needs from other processes: ranks sharing a batch, or pipeline stages (docs/distributed.md).

Data-parallel DP-SGD splits a logical batch over W ranks: each rank clips its own examples
(:meth:`DPEngine.backward` is unchanged), and the W clipped sums must become ONE sum with
Gaussian noise of std σ·S added exactly once. The engine does not talk to other processes
itself; it takes a ``reducer`` (``dpclip.distributed`` implements it with torch.distributed)
and calls it between the clipped sum and the update:

- ``draws_noise``: True on exactly one rank. That rank adds the gradient noise (and the
  threshold statistics' noise) to its own contribution before the sum, so the sum over
  ranks holds the noise once: Σ_r clipped_r + N(0, σ²S²) is what one process releases;
- ``sum_(tensors)``: replace every tensor, in place, by its sum over ranks (every rank
  gets the same result);
- ``sum(tensor)``: the sum over ranks of one tensor, as a new tensor;
- ``gather(tensor)``: every rank's 1-d tensor (lengths may differ), concatenated in rank
  order, and where this rank's part starts: discriminative clipping's top-fraction rule
  ranks the norms of the whole logical batch, so every rank must see all of them (they stay
  inside the run's processes, like the examples each rank holds, and are never released).

Single process: no reducer, and the engine's step is exactly the one-process step.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class Reducer(Protocol):
    draws_noise: bool

    def sum_(self, tensors: list[Tensor]) -> None: ...

    def sum(self, tensor: Tensor) -> Tensor: ...

    def gather(self, tensor: Tensor) -> tuple[Tensor, int]: ...


def sum_counts(reducer: Reducer, clipped: Tensor, nonfinite: Tensor, samples: int) -> tuple[Tensor, Tensor, int]:
    """The step's clip counts, non-finite counts and sample count summed over ranks, in one
    collective (diagnostics, not covered by ε: the clip fraction of the whole logical batch)."""
    k = clipped.shape[0]
    counts = torch.cat([clipped.to(torch.float64), nonfinite.to(torch.float64),
                        torch.tensor([float(samples)], device=clipped.device, dtype=torch.float64)])
    counts = reducer.sum(counts)
    return counts[:k].to(clipped.dtype), counts[k:2 * k].round().long(), int(counts[-1].round())


class StageLink(Protocol):
    """What the engine of one pipeline stage needs from the other stages (docs/distributed.md,
    "Pipeline stages"). A stage's engine holds only its own parameters.

    - ``flat``: False for per-device clipping (adaptive-per-layer paper §4, Alg. 2): each stage
      clips its own parameters with its own threshold C_k, and per-sample norms never leave the
      stage. True for one flat (all-layer) threshold over the whole pipeline: every stage's
      per-sample norms² are summed over the stages before anyone clips (``sum_norm_sq``);
    - ``num_groups``, ``offset``: the pipeline's K groups, this stage's first one;
    - ``all_gather(tensor)``: the stages' tensors concatenated in stage order (used for public
      values only: thresholds and group sizes, to scale the noise);
    - ``gather_releases(aux)``: every stage's released statistics (for σ_eff of the step).
    """

    flat: bool
    num_groups: int
    offset: int

    def all_gather(self, tensor: Tensor) -> Tensor: ...

    def gather_releases(self, aux: list) -> list: ...

    def sum_norm_sq(self, norm_sq: Tensor) -> Tensor: ...
