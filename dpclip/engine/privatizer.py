"""The end of a private step: the step's clipped sums noised into ``p.grad``, and its report (docs/engine.md).

    p.grad = (Σ over ranks of Σ_i c_i G_i + N(0, (σ_g·S·w_k)²)) / B

with B the EXPECTED batch size (the sums already carry the 1/B, :mod:`dpclip.engine.accumulator`)
and the noise std of group k from :mod:`dpclip.engine.noise`. The threshold policy releases its
statistics after the noise. One privatizer per parallel mode (docs/distributed.md), chosen once
when the engine is built (:func:`privatizer_for`):

- :class:`Privatizer`: one process: it draws the noise, nothing is summed;
- :class:`RanksPrivatizer`: ranks sharing each logical batch (data-parallel): the one rank that
  draws noise adds it before the sums are summed over ranks (:mod:`dpclip.engine.reducer`);
- :class:`ShardsPrivatizer`: a sharded (FSDP) model: the sums are reduce-scattered, and each rank
  noises its own rows of each parameter from its own stream (each coordinate once);
- :class:`StagePrivatizer`: one stage of a pipeline: the noise std runs over all the pipeline's
  groups, and the released statistics are every stage's (:class:`~dpclip.engine.reducer.StageLink`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from dpclip.accounting import gradient_step_event
from dpclip.engine.accumulator import StepAccumulator
from dpclip.engine.noise import NoiseSource, add_step_noise, effective_noise_multiplier, stage_noise_stds
from dpclip.engine.policies import ThresholdPolicy
from dpclip.engine.reducer import Reducer, StageLink, sum_counts
from dpclip.engine.report import StepReport
from dpclip.errors import EngineError


class Privatizer:
    """Noise for the step's sums in one process (module doc).

    ``params``: the engine's parameters (the engine's own list: a sharded model's parameters
    replace their entries); ``group_of[j]``: parameter j's group; ``padding_rows``: the
    embedding rows that get no gradient, nor noise (:func:`~dpclip.engine.groups.untied_padding_rows`);
    ``noise``, ``correlation``: the generators and, for banded MF or BLT, the correlation across
    steps; ``allocation``, ``sizes``: the noise allocation over the groups and their sizes d_k;
    ``device``: the engine's (the policy draws its statistics' noise there).
    """

    def __init__(self, params: list[Tensor], group_of: list[int], padding_rows: dict[int, int],
                 noise: NoiseSource, correlation, *, gradient_noise_multiplier: float, allocation: str,
                 sizes: Tensor, expected_batch_size: int, device: torch.device):
        self.params, self.group_of, self.padding_rows = params, group_of, padding_rows
        self.noise, self.correlation = noise, correlation
        self.gradient_noise_multiplier, self.allocation = gradient_noise_multiplier, allocation
        self.sizes, self.expected_batch_size, self.device = sizes, expected_batch_size, device

    #: why the correlated noise's history holds a draw no release carried (every later release refused).
    lost_noise: str | None = None

    @contextmanager
    def all_or_nothing(self, policy: ThresholdPolicy, step: StepAccumulator) -> Iterator[None]:
        """A release inside that raises (an out-of-memory in a noise draw, a Ctrl-C, a refusal) leaves
        nothing of its step for the next: its sums, the policy's observations and any threshold its
        statistic moved (:meth:`ThresholdPolicy.roll_back`), the noisy gradient in ``p.grad``. What
        is held costs no host synchronisation (issue 54). The correlated noise's history cannot be
        taken back without a copy of the model per step: once it holds an unreleased draw, every
        later release is refused until a checkpoint is loaded (``DPEngine.load_state_dict``)."""
        held, grads = policy.held(), [p.grad for p in self.params]
        correlated = None if self.correlation is None else self.correlation.step
        try:
            if self.lost_noise is not None:
                raise EngineError(f"this engine's correlated noise holds the draw of a step that was never released "
                                  f"({self.lost_noise}): a later step's noise would be correlated with it, which the "
                                  "accounting of banded MF or BLT does not cover", "load the engine's state from "
                                  "the checkpoint before that step (engine.load_state_dict)")
            yield
        except BaseException as exc:
            for p, grad in zip(self.params, grads):
                p.grad = grad
            step.reset()
            policy.roll_back(held)
            if correlated is not None and self.correlation.step != correlated:
                self.lost_noise = f"{type(exc).__name__} after its noise was drawn"
            raise

    def release(self, policy: ThresholdPolicy, step: StepAccumulator, *, sample_rate: float | None,
                counts_clipped: bool, group_names: list[str]) -> StepReport:
        """Noise the step's sums into ``p.grad``; the policy releases; the step's report (its
        ``certificate`` left to the engine). Group k's summed clipped gradient gets
        N(0, (σ_g·S·w_k)²), then ``p.grad = (sum + noise) / B``."""
        thresholds = policy.thresholds().detach().clone()
        std = self.noise_stds(policy.sensitivity_thresholds())
        batch = self.expected_batch_size
        std_grad = (std / batch).tolist()  # one device sync per step, not one per parameter
        if not all(math.isfinite(v) for v in std_grad):
            raise EngineError("the noise's standard deviation is not finite: a clipping threshold is too large "
                              "(or grew without bound) for the gradient's dtype; nothing of this step is released",
                              "lower clipping.threshold (value, or the quantile policy's lr and initial value)")
        self.write_gradients(step, std_grad)
        aux = list(policy.release(self.noise.generator(self.device)) or [])
        sigma_eff = effective_noise_multiplier(self.gradient_noise_multiplier, self.releases(aux))
        # The accounting package builds the event, so engine and plan agree exactly.
        event = gradient_step_event(sample_rate if sample_rate is not None else 1.0, sigma_eff)
        return StepReport(
            group_names=group_names,
            thresholds=thresholds,
            norm_quantiles=step.norm_quantiles(),
            clip_fraction=step.clip_fraction(counts_clipped),
            nonfinite=step.nonfinite,
            noise_std_sum=std.detach(),
            noise_std_grad=std.detach() / batch,
            gradient_noise_multiplier=self.gradient_noise_multiplier,
            noise_multiplier=sigma_eff,
            aux_releases=aux,
            policy_summary=policy.summary(),
            dp_event=None if self.correlation is not None else event,   # not the step's charge (report.py)
            participation_event=event,
            samples_seen=step.samples,
            expected_batch_size=batch,
        )

    def noise_stds(self, thresholds: Tensor) -> Tensor:
        """σ_g·S·w_k per group, the std of the noise on its summed clipped gradient."""
        return stage_noise_stds(self.gradient_noise_multiplier, thresholds, self.allocation, self.sizes)

    def releases(self, aux: list) -> list:
        """The statistics released this step by every process (here: this one's)."""
        return aux

    def write_gradients(self, step: StepAccumulator, std_grad: list[float]) -> None:
        """``p.grad`` = the step's sums (over ranks) plus the noise, each in its parameter's dtype;
        ``std_grad[k]``: group k's noise std over B."""
        grads = self.summed(step)
        if self.gradient_noise_multiplier > 0 and self.draws_noise:
            add_step_noise(self.noise, grads, [std_grad[k] for k in self.group_of], self.correlation)
        for idx, row in self.padding_rows.items():
            start = self.first_row(idx)
            if 0 <= row - start < grads[idx].shape[0]:
                grads[idx][row - start] = 0
        self.combine(grads, step)
        for p, grad in zip(self.params, grads):
            p.grad = self.as_grad(grad.to(p.dtype), p)

    # What the parallel modes change (module doc).

    draws_noise = True

    def summed(self, step: StepAccumulator) -> list[Tensor]:
        """What this process noises: the step's sums, whole."""
        return step.whole_sums()

    def first_row(self, idx: int) -> int:
        """Parameter ``idx``'s first row in what :meth:`summed` gave."""
        return 0

    def combine(self, grads: list[Tensor], step: StepAccumulator) -> None:
        """After the noise: the sums over ranks, in place."""

    def as_grad(self, grad: Tensor, param: Tensor) -> Tensor:
        return grad


class RanksPrivatizer(Privatizer):
    """Ranks sharing each logical batch: Σ over ranks of (clipped_r/B), plus the one rank's noise/B;
    the step's counts summed over ranks too (a diagnostic of the whole logical batch)."""

    def __init__(self, reducer: Reducer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reducer = reducer

    @property
    def draws_noise(self) -> bool:
        return self.reducer.draws_noise

    def combine(self, grads: list[Tensor], step: StepAccumulator) -> None:
        self.reducer.sum_(grads)
        step.clipped, step.nonfinite, step.samples = sum_counts(self.reducer, step.clipped, step.nonfinite,
                                                                step.samples)


class ShardsPrivatizer(Privatizer):
    """A sharded model: Σ over ranks of (clipped_r/B), this rank's shard of each parameter only,
    noised here from this rank's own stream (each coordinate once); ``p.grad`` a shard like the
    parameter (``reducer``: :class:`dpclip.distributed.sharded.ShardReducer`)."""

    def __init__(self, reducer: Reducer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reducer = reducer

    def summed(self, step: StepAccumulator) -> list[Tensor]:
        grads = step.whole_sums()
        step.sums = [None] * len(self.params)  # the reducer frees each whole sum once it is sent
        return self.reducer.sum_shards(grads, self.params)

    def first_row(self, idx: int) -> int:
        return self.reducer.shard_start(self.params[idx])

    def combine(self, grads: list[Tensor], step: StepAccumulator) -> None:
        step.clipped, step.nonfinite, step.samples = sum_counts(self.reducer, step.clipped, step.nonfinite,
                                                                step.samples)

    def as_grad(self, grad: Tensor, param: Tensor) -> Tensor:
        return self.reducer.as_grad(grad, param)


class StagePrivatizer(Privatizer):
    """One stage of a pipeline (docs/distributed.md, "Pipeline stages"): per device, the noise std's
    S runs over all the pipeline's groups (:func:`~dpclip.engine.noise.stage_noise_stds`; the
    stages' group sizes gathered once, kept in ``gathered``) and σ_eff over every stage's releases;
    a flat stage clips at the one threshold, so its noise and releases are its own."""

    def __init__(self, stage: StageLink, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage = stage
        self.gathered: dict = {}

    def noise_stds(self, thresholds: Tensor) -> Tensor:
        return stage_noise_stds(self.gradient_noise_multiplier, thresholds, self.allocation, self.sizes,
                                self.stage, self.gathered)

    def releases(self, aux: list) -> list:
        return aux if self.stage.flat else self.stage.gather_releases(aux)


def privatizer_for(reducer: Reducer | None, stage: StageLink | None, *args, **kwargs) -> Privatizer:
    """The privatizer of the engine's parallel mode: ``reducer`` (ranks; sharded where it says
    ``shards``), ``stage`` (a pipeline's), or neither (one process). The arguments after them are
    :class:`Privatizer`'s."""
    if reducer is not None and stage is not None:
        raise EngineError("an engine takes a reducer (ranks sharing a batch) or a stage (of a pipeline), not both",
                          "pipeline stages are one process each (training.parallel: pipeline)")
    if stage is not None:
        return StagePrivatizer(stage, *args, **kwargs)
    if reducer is None:
        return Privatizer(*args, **kwargs)
    if getattr(reducer, "shards", False):
        return ShardsPrivatizer(reducer, *args, **kwargs)
    return RanksPrivatizer(reducer, *args, **kwargs)
