"""What one private step did: :class:`StepReport`, returned by ``DPEngine.privatize``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import dp_accounting
import torch
from torch import Tensor

from dpclip.engine.policies import AuxRelease

QUANTILES = {"min": 0.0, "median": 0.5, "p90": 0.9, "max": 1.0}


def norm_quantiles(norms: list[Tensor], groups: int, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """The :data:`QUANTILES` per group of the step's per-sample group norms (``norms``: one
    [b, K] tensor a micro-batch); NaN when the step had no example (a sharded run's padded
    rank). Non-finite norms are counted apart (``nonfinite``) and skipped here."""
    whole = torch.cat(norms) if norms else None
    if whole is None or whole.shape[0] == 0:
        nan = torch.full((groups,), float("nan"), device=device, dtype=dtype)
        return {k: nan for k in QUANTILES}
    qs = torch.tensor(list(QUANTILES.values()), device=whole.device, dtype=whole.dtype)
    if math.isfinite(float(whole.sum())):
        values = torch.quantile(whole, qs, dim=0)
    else:  # as NaN, nanquantile skips them
        values = torch.nanquantile(torch.where(torch.isfinite(whole), whole, math.nan), qs, dim=0)
    return {k: values[j] for j, k in enumerate(QUANTILES)}


class LazyQuantiles(Mapping):
    """:func:`norm_quantiles` computed on first read. Most steps' reports are never read
    for them (the Python API, benchmarks), and the computation is a sort and, on a GPU, a
    wait for the device: a host cost of every step otherwise (docs/performance.md)."""

    def __init__(self, norms: list[Tensor], groups: int, device: torch.device, dtype: torch.dtype):
        self._args: tuple | None = (list(norms), groups, device, dtype)
        self._values: dict[str, Tensor] | None = None

    def _computed(self) -> dict[str, Tensor]:
        if self._values is None:
            self._values = norm_quantiles(*self._args)
            self._args = None   # the norms are let go once read
        return self._values

    def __getitem__(self, key: str) -> Tensor:
        return self._computed()[key]

    def __iter__(self):
        return iter(QUANTILES)

    def __len__(self) -> int:
        return len(QUANTILES)

    def __repr__(self) -> str:
        return repr(self._computed())


@dataclass
class StepReport:
    """What one ``privatize()`` did. Tensors have one entry per group.

    ``norm_quantiles``, ``clip_fraction`` and ``nonfinite`` are computed from the private
    batch WITHOUT noise: they are diagnostics for the caller's own logs, not releasable
    statistics (not covered by ε). ``nonfinite`` counts, per group, the samples whose group
    norm was inf or NaN: they contributed exactly zero to that group's sum and count as
    clipped; ``norm_quantiles`` are over the finite norms only.
    ``noise_std_sum`` is the std of the Gaussian added to group k's *summed* clipped
    gradient; ``noise_std_grad`` = noise_std_sum / expected_batch_size is its std in
    ``p.grad``. ``samples_seen`` is for logs only: the engine never normalises by it.
    ``participation_event`` is the step's release as one mechanism (one participation, with
    correlated noise under the cyclic sampling a plan assumes); ``dp_event`` is the same where the
    step is a mechanism of its own, and None with correlated noise (``noise_correlation``): its
    steps are not independent, so composing one event per step is not their accounting.
    """

    group_names: list[str]
    thresholds: Tensor
    norm_quantiles: Mapping[str, Tensor]   # computed on first read (LazyQuantiles)
    clip_fraction: Tensor | None
    nonfinite: Tensor
    noise_std_sum: Tensor
    noise_std_grad: Tensor
    gradient_noise_multiplier: float
    noise_multiplier: float
    aux_releases: list[AuxRelease]
    policy_summary: dict
    dp_event: dp_accounting.DpEvent | None
    samples_seen: int
    expected_batch_size: int
    # What the certificate verified in this step (docs/certificate.md), or None
    # when no check ran since the last report: the step, the rows checked, the mode (alone, batch,
    # eval), and ``before`` for the check on rows of its own before training (sharding, a pipeline cut).
    certificate: object = None
    participation_event: dp_accounting.DpEvent | None = None

    def to_dict(self) -> dict:
        """Plain Python values (for JSON logs)."""
        def lst(t):
            return None if t is None else t.detach().cpu().tolist()
        return {
            "group_names": list(self.group_names),
            "thresholds": lst(self.thresholds),
            "norm_quantiles": {k: lst(v) for k, v in self.norm_quantiles.items()},
            "clip_fraction": lst(self.clip_fraction),
            "nonfinite": lst(self.nonfinite),
            "noise_std_sum": lst(self.noise_std_sum),
            "noise_std_grad": lst(self.noise_std_grad),
            "gradient_noise_multiplier": self.gradient_noise_multiplier,
            "noise_multiplier": self.noise_multiplier,
            "aux_releases": [tuple(a) for a in self.aux_releases],
            "policy_summary": self.policy_summary,
            "samples_seen": self.samples_seen,
            "expected_batch_size": self.expected_batch_size,
            "certificate": None if self.certificate is None else {
                "rows": self.certificate.rows, "mode": self.certificate.mode,
                **({"before": self.certificate.before} if self.certificate.before else {})},
        }


@dataclass
class ClipDebug:
    """What ``DPEngine.debug_clipped()`` hands back: for tests and debugging only.

    Computed from the private batch WITHOUT noise: never log, release or train on it (not
    covered by ε). ``sums``: Σ_i c_i g_i per parameter name, not divided by the batch size;
    ``norms``: per-sample group norms [n, K] (the norms the clip factors were computed
    from); ``paths``: how each parameter's per-sample norm was computed ("ghost",
    "instantiated", "instantiated (streamed)", "... + float64 for k cancelling sample(s)")."""

    group_names: list[str]
    sums: dict[str, Tensor]
    norms: Tensor
    paths: dict[str, str]
