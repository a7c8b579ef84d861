"""The step's accumulator: what the micro-batches of one private step add up to (docs/engine.md).

Between two ``privatize`` calls each micro-batch (:class:`~dpclip.engine.microbatch.MicroBatch`)
adds its clipped per-sample gradients into the step's sums, Σ_i c_i G_i / B per parameter (B the
expected batch size), and counts per group its clipped and its non-finite samples; the step keeps
its per-sample group norms [b, K] and each parameter's norm path for the report.
:class:`~dpclip.engine.engine.DPEngine` composes one :class:`StepAccumulator`; the privatizer
(:mod:`dpclip.engine.privatizer`) turns its sums into ``p.grad``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from dpclip.engine.bookkeeping import Bookkeeper
from dpclip.engine.microbatch import MicroBatch, StepContext, StepTotals
from dpclip.engine.policies import ThresholdPolicy
from dpclip.engine.report import ClipDebug, LazyQuantiles
from dpclip.engine.sums import released_sum, running_sum
from dpclip.errors import DpclipError, EngineError, raised_on_private_batch


#: the stray gradients of a model wrapped in DistributedDataParallel after the engine was built (its
#: reducer writes autograd's raw gradients into p.grad): the hint where a process group exists
WRAPPED_HINT = ("; or, if the model was wrapped in DistributedDataParallel after the engine was built (accelerate's "
                "prepare), call the model unwrapped: dpclip sums the clipped gradients over the ranks itself")


class StepAccumulator:
    """The accumulators of the step in progress, and its micro-batches awaiting their clip.

    ``sums[j]``: parameter j's Σ_i c_i G_i / B so far (None: nothing yet); ``clipped`` [K] and
    ``nonfinite`` [K]: per group, the samples clipped and those whose norm was not finite;
    ``samples``: the examples seen (padding excluded); ``norms``: each micro-batch's per-sample
    group norms [b, K]; ``paths``: how each parameter's norm was computed (by name);
    ``captured``: micro-batches whose backward is done and whose clip is not, oldest first,
    each with its number of examples. ``sum_scale`` is 1/B, carried by the clip factors
    (:class:`~dpclip.engine.microbatch.MicroBatch`).
    """

    def __init__(self, context: StepContext, keeper: Bookkeeper, sum_scale: float):
        self.context, self.keeper, self.sum_scale = context, keeper, sum_scale
        self.reset()

    def reset(self) -> None:
        """Empty: the next step starts."""
        ctx, groups = self.context, len(self.context.members)
        self.sums: list[Tensor | None] = [None] * len(ctx.params)
        self.norms: list[Tensor] = []
        self.clipped = torch.zeros(groups, device=ctx.device, dtype=ctx.norm_dtype)
        self.nonfinite = torch.zeros(groups, device=ctx.device, dtype=torch.long)
        self.samples = 0
        self.paths: dict[str, str] = {}
        self.captured: list[tuple[MicroBatch, int]] = []

    # ------------------------------------------------------------ micro-batches

    def micro_batch(self, policy: ThresholdPolicy, totals: StepTotals, batch_size: int, counts: list[int],
                    loss_scale: float, row_weights: Tensor | None, dry: bool = False) -> MicroBatch:
        """A micro-batch adding into ``totals`` at the policy's thresholds now (``dry``: the certificate's,
        thrown away: per-sample thresholds that leave the policy's step alone)."""
        per_sample = None
        if policy.per_sample:
            per_sample = policy.dry_per_sample_thresholds if dry else policy.per_sample_thresholds
        return MicroBatch(self.context, totals, batch_size, counts, policy.thresholds(), per_sample, loss_scale,
                          row_weights, sum_scale=self.sum_scale)

    @contextmanager
    def capture(self, policy: ThresholdPolicy, batch_size: int, samples: int, generation: int | None,
                loss_scale: float, row_weights: Tensor | None, watch: list[int] | None) -> Iterator[None]:
        """The backward inside is one micro-batch of the step (``DPEngine.capture``); after it, the
        micro-batch waits in ``captured`` for :meth:`finish`."""
        if not 0 <= samples <= batch_size:
            raise EngineError(f"engine.capture({batch_size}, samples={samples}): samples must be in "
                              "[0, batch_size]", None)
        if row_weights is not None and (row_weights.shape != (batch_size,) or not bool(
                ((row_weights >= 0) & (row_weights <= 1)).all())):
            raise EngineError(f"row_weights must be {batch_size} numbers in [0, 1], got shape "
                              f"{tuple(row_weights.shape)}", "pass dpclip.data.user_sampler.user_weights of the "
                              "batch's users, one weight per row")
        counts, generation = self.keeper.take_forward_counts(generation)
        micro = self.micro_batch(policy, StepTotals(self.sums, self.clipped, self.nonfinite), batch_size, counts,
                                 loss_scale, row_weights)
        if watch:
            micro.watch(watch)
        with self.collecting(micro, batch_size, generation):
            yield
        self.captured.append((micro, samples))

    @contextmanager
    def collecting(self, micro: MicroBatch, batch_size: int, generation: int) -> Iterator[None]:
        """The backward inside delivers its uses into ``micro``; ``p.grad`` is left as the caller had
        it, and a gradient that reached it outside the engine's hooks is refused."""
        params = self.context.params
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with self.keeper.backward_scope(batch_size, generation, micro.deliver):
                yield
            stray = [i for i, p in enumerate(params) if p.grad is not None]
            if stray:
                raise EngineError(
                    "parameters received gradients outside the engine's hooks: "
                    + ", ".join(self.context.names[i] + (f" [alias {note}]" if (
                        note := self.keeper.alias_note(i)) else "") for i in stray)
                    + " (a module reads them without calling their owner, e.g. `other.weight` "
                    "inside a custom forward, or `self.bias` where `self.child.bias` is the same "
                    "tensor)", "call the owning module, or tie the parameter to a module that uses it"
                    + (WRAPPED_HINT if torch.distributed.is_available() and torch.distributed.is_initialized() else ""))
        except BaseException as exc:
            micro.discard()
            if isinstance(exc, DpclipError):   # its shapes show the realised batch size
                raised_on_private_batch(exc)
            raise
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    def add(self, sums: list[Tensor | None], norms: Tensor, clipped: Tensor) -> None:
        """A micro-batch clipped outside the engine's backward (a compiled one,
        :mod:`dpclip.engine.compiled`): its sums Σ_i c_i G_i / B per parameter, its examples' group
        norms [samples, K] and its clipped samples per group [K]."""
        for idx, total in enumerate(sums):
            if total is not None:
                self.sums[idx] = running_sum(self.sums[idx], total.clone() if self.sums[idx] is None else total)
        self.clipped += clipped
        self.norms.append(norms.detach())
        self.samples += norms.shape[0]
        self.paths.update((name, "compiled") for name in self.context.names)

    def oldest(self) -> tuple[MicroBatch, int]:
        """The oldest captured micro-batch and its number of examples, taken out of ``captured``."""
        if not self.captured:
            raise EngineError("engine.finish_micro_batch without a captured backward",
                              "wrap the backward in `with engine.capture(batch_size):` first")
        return self.captured.pop(0)

    @staticmethod
    def finish(micro: MicroBatch) -> Tensor:
        """``micro``'s per-sample norms [b, K], its sums added (its stash released if that fails)."""
        try:
            return micro.finish()
        except BaseException:
            micro.discard()
            raise

    def record(self, micro: MicroBatch, norms: Tensor, samples: int) -> None:
        """A finished micro-batch's norm paths, its examples' norms [samples, K] and their count."""
        for idx, path in micro.paths.items():
            self.paths[self.context.names[idx]] = path
        self.norms.append(norms.detach())
        self.samples += samples

    def dry_micro_batch(self, policy: ThresholdPolicy, losses: Tensor, rows: list[int],
                        row_weights: Tensor | None) -> tuple:
        """The certificate's dry micro-batch (:mod:`dpclip.engine.certificate.dry`): the backward of
        ``losses`` into scratch sums that are thrown away, watching ``rows``; no policy observes it.
        Returns (norms [b, K], witness sums, thresholds used, groups recomputed in float64 per row)."""
        batch = losses.shape[0]
        counts, generation = self.keeper.take_forward_counts()
        scratch = StepTotals([None] * len(self.context.params), torch.zeros_like(self.clipped),
                             torch.zeros_like(self.nonfinite))
        micro = self.micro_batch(policy, scratch, batch, counts, 1.0, row_weights, dry=True)
        micro.watch(rows)
        with self.collecting(micro, batch, generation):
            torch.autograd.backward(losses, torch.ones_like(losses))
        norms = self.finish(micro)
        return norms, micro.witness, micro.used_thresholds, micro.cancelling

    # ------------------------------------------------------------ the step's end

    def whole_sums(self) -> list[Tensor]:
        """Each parameter's Σ_i c_i G_i / B, zeros where no sample reached it (contiguous, for the
        collectives and the noise)."""
        return [torch.zeros(p.shape, dtype=p.dtype, device=p.device) if clipped is None
                else released_sum(clipped, p).contiguous() for p, clipped in zip(self.context.params, self.sums)]

    def clip_fraction(self, counts_clipped: bool) -> Tensor | None:
        """Per group, the fraction of the step's samples clipped; None where "clipped" means
        nothing (AUTO rescales every sample), NaN for a step without samples."""
        if not counts_clipped:
            return None
        if self.samples:
            return self.clipped / self.samples
        return torch.full_like(self.clipped, float("nan"))

    def norm_quantiles(self) -> LazyQuantiles:
        ctx = self.context
        return LazyQuantiles(self.norms, len(ctx.members), ctx.device, ctx.norm_dtype)

    def debug(self, group_names: list[str], expected_batch_size: int) -> ClipDebug:
        """The step's clipped sums without noise (Σ_i c_i G_i, the 1/B undone), its per-sample
        group norms and each parameter's norm path (``DPEngine.debug_clipped``)."""
        ctx = self.context
        sums = {name: torch.zeros(p.shape, dtype=p.dtype, device=p.device) if s is None
                else released_sum(s.detach(), p) * expected_batch_size   # the engine keeps Σ_i c_i G_i / B
                for name, p, s in zip(ctx.names, ctx.params, self.sums)}
        norms = (torch.cat(self.norms) if self.norms else
                 torch.zeros(0, len(ctx.members), device=ctx.device, dtype=ctx.norm_dtype))
        return ClipDebug(group_names, sums, norms, dict(self.paths))
