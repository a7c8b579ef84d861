"""One micro-batch of a private step: uses in, group norms, clip factors, clipped sums out.

In backward order, each layer's uses arrive from the book-keeping; when all uses of a
parameter have arrived its per-sample norm² is added to its group; when all parameters
of a group are done, the group is *finalized*: clip factors, clipped sums, and its stash
is freed (groupwise-clipping paper Alg. 1 and §6: finer groups release memory earlier;
docs/engine.md, "Groups and early finalization"). :class:`DPEngine` builds the
:class:`StepContext` once and hands every micro-batch what it needs explicitly.

Two classes, one per half: :class:`~dpclip.engine.group_norms.MicroBatchNorms` takes the uses
in and makes each group's norm² (certified in float64 where its terms cancel); :class:`MicroBatch`
here adds the clip factors and the clipped sums, finalizing a group once its norm² is complete.
The arithmetic itself is in :mod:`dpclip.engine.groupwise`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dpclip.engine.factors import clipped_sum, sqrt_or_zero, zero_samples
from dpclip.engine.group_norms import MicroBatchNorms, StepContext
from dpclip.engine.groupwise import (chunk_clip, clip_factors, nonfinite_norms, sliced_sums, stacked_columns,
                                     thresholds_of, weights_toward_zero)
from dpclip.engine.precision import engine_math
from dpclip.engine.streamed import streamed_clip
from dpclip.engine.sums import running_sum
from dpclip.errors import EngineError

__all__ = ["FINALIZE_BATCH", "MicroBatch", "StepContext", "StepTotals"]


# Groups whose last use arrived are finalized this many at a time (all at once: one read of
# the device for their checks, one clip of their norms [b, K'] instead of K'). On a GPU a
# group's own work is a dozen small kernels and a wait, and the host bounds a small step;
# holding a few groups' stash a little longer costs little there. On the CPU each group
# still goes at once, which keeps layer-wise clipping's memory lowest.
FINALIZE_BATCH = {"cpu": 1}
FINALIZE_BATCH_DEFAULT = 4


@dataclass
class StepTotals:
    """The step's accumulators across micro-batches: clipped sums per parameter, and per
    group the count of clipped and of non-finite samples (tensors updated in place)."""

    sums: list[Tensor | None]
    clipped: Tensor
    nonfinite: Tensor


class MicroBatch(MicroBatchNorms):
    """One engine.backward: pending uses per parameter, group norms (:class:`MicroBatchNorms`),
    then finalization: clip factors and clipped sums.

    ``thresholds`` [K] are the policy's; ``per_sample_thresholds`` (norms [b, K] ->
    thresholds [b, K] or None) is given for a per-sample policy, which needs all K norms
    of a sample first: every group is then finalized at the end. Results are added into
    ``totals`` (the step's accumulators, owned by the engine).
    """

    def __init__(self, ctx: StepContext, totals: StepTotals, batch: int, pending: list[int],
                 thresholds: Tensor, per_sample_thresholds: Callable | None = None,
                 loss_scale: float = 1.0, row_weights: Tensor | None = None, sum_scale: float = 1.0):
        super().__init__(ctx, batch, pending)
        # The sums are wanted as Σ_i c_i G_i / B (``p.grad`` before noise, B the expected batch
        # size): the 1/B rides on the clip factors, B numbers, instead of a pass over every
        # gradient coordinate at the end of the step.
        self.sum_scale = None if sum_scale == 1.0 else float(sum_scale)
        # Per-row weights on the clip factors (a person's records weigh 1 together under
        # user-level privacy, docs/users.md): each row's clipped gradient is scaled by its
        # weight, so the sum moves by at most Σ weights · C when those rows go.
        self.row_weights = None if row_weights is None else weights_toward_zero(row_weights, ctx.norm_dtype, ctx.device)
        # The backward was seeded with loss_scale (float16): every norm it gives is
        # loss_scale times the sample's, so norms and clip factors are divided by it before
        # anything compares them with a threshold (docs/engine.md, "Mixed precision").
        if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale > 0):
            raise EngineError(f"loss_scale must be a positive finite number, got {loss_scale!r}",
                              "use a power of two such as 1024")
        self.unscale = None if loss_scale == 1.0 else 1.0 / loss_scale
        self.totals = totals
        k = len(ctx.members)
        self.norms: list[Tensor | None] = [None] * k
        self.done = [False] * k
        self.ready: list[int] = []   # groups complete but not yet finalized (FINALIZE_BATCH)
        self.finalize_batch = FINALIZE_BATCH.get(ctx.device.type, FINALIZE_BATCH_DEFAULT)
        self.thresholds = thresholds
        self.per_sample_thresholds = per_sample_thresholds
        self.defer = per_sample_thresholds is not None or ctx.exchange_norm_sq is not None
        # The certificate's rows (dpclip.engine.certificate): for each, the engine's own clipped
        # sum with every clip factor but that row's set to 0, per parameter (its *witness*), and
        # the thresholds the rows were clipped at ([K], or [b, K] for a per-sample policy).
        self.witness: dict[int, dict[int, Tensor]] = {}
        self.used_thresholds: Tensor | None = None

    def watch(self, rows: list[int]) -> None:
        """Keep a witness sum for each of ``rows`` (the certificate's checked samples)."""
        self.witness_rows = list(rows)
        self.witness = {r: {} for r in rows}

    def _witness(self, idx: int, sum_of: Callable[[Tensor], Tensor], factors: Tensor) -> None:
        """Witness sums of parameter ``idx``: ``sum_of`` (the clipped-sum code just used) run
        once per watched row with the other rows' factors zeroed."""
        for r in self.witness_rows:
            masked = torch.zeros_like(factors)
            masked[r] = factors[r]
            self.witness[r][idx] = sum_of(masked).detach().clone()

    def _group_complete(self, k: int) -> None:
        """Finalize group k now, or once FINALIZE_BATCH groups are complete; a per-sample policy or
        a flat pipeline stage (``defer``) finalizes every group at the end (:meth:`finish`)."""
        if self.defer:
            return
        if any(member in self.streamed for member in self.ctx.members[k]):
            self._finalize(k, self.thresholds[k])   # its G_i are formed now, chunk by chunk
        else:
            self.ready.append(k)
            if len(self.ready) >= self.finalize_batch:
                self._finalize_ready()

    def _finalize(self, k: int, threshold: Tensor) -> None:
        """Finalize group k alone (a group with streamed parameters: their G_i are formed here,
        a chunk of samples at a time, :func:`~dpclip.engine.streamed.streamed_clip`)."""
        e, out = self.ctx, self.totals
        streamed = [idx for idx in e.members[k] if idx in self.streamed]
        if not streamed:
            self._finalize_groups([k], threshold.unsqueeze(-1))
            return
        self._certify([k])
        sq = self._group_norm_sq(k)
        unscale = self.unscale
        base = sq if sq is not None else torch.zeros(self.batch, device=e.device, dtype=e.norm_dtype)
        bundles = [self.parts[idx][0] for idx in streamed]
        clip = chunk_clip(e.clip, threshold, self.row_weights, unscale, self.sum_scale)
        shapes = [e.params[idx].shape for idx in streamed]
        for r in self.witness_rows:   # before the sums: streamed_clip may free nothing, but keep the order plain
            _, witnessed = streamed_clip(bundles, shapes, base, _only_row(clip, r))
            for idx, total in zip(streamed, witnessed):
                self.witness[r][idx] = total.detach().clone()
        norms, sums = streamed_clip(bundles, shapes, base, clip, self.meter)
        for idx, total in zip(streamed, sums):
            self.meter.remove(self.parts[idx][0].tensors())
            self.parts[idx] = None
            self.streamed.discard(idx)
            out.sums[idx] = running_sum(out.sums[idx], total)
        if unscale is not None:
            norms = norms * unscale
        norms, keep = self._nonfinite(norms.unsqueeze(1), [k], None)
        factors = self._factors(norms, threshold.unsqueeze(-1), keep)
        self._group_sums(k, factors[:, 0], None if keep is None else keep[:, 0], norms[:, 0])

    def _finalize_ready(self) -> None:
        """Finalize the groups waiting in ``ready`` together (:data:`FINALIZE_BATCH`)."""
        groups, self.ready = sorted(self.ready), []
        if groups:
            self._finalize_groups(groups, thresholds_of(self.thresholds, groups))

    def _finalize_groups(self, groups: list[int], thresholds: Tensor) -> None:
        """Finalize ``groups`` (none with streamed parameters) at once: their norms [b, K'],
        one certification read, one clip; ``thresholds`` [K'] or per sample [b, K']."""
        e = self.ctx
        def stacked():
            return stacked_columns([self._group_norm_sq(k) for k in groups], self.batch, e.device, e.norm_dtype)
        sq = stacked()   # [b, K']
        # Σ norm² is finite iff every norm² is (or it overflows: nonfinite_norms' slow path
        # then finds nothing to drop); read with the cancellation check's flags
        raised, total_sq = self._certify(groups, sq.sum())
        if raised:
            sq = stacked()
        norms = sqrt_or_zero(sq)
        if self.unscale is not None:
            norms = norms * self.unscale
        norms, keep = self._nonfinite(norms, groups, None if raised else total_sq)
        factors = self._factors(norms, thresholds, keep)
        for j, k in enumerate(groups):
            self._group_sums(k, factors[:, j], None if keep is None else keep[:, j], norms[:, j])

    def _nonfinite(self, norms: Tensor, groups: list[int], total_sq: float | None) -> tuple[Tensor, Tensor | None]:
        """:func:`~dpclip.engine.groupwise.nonfinite_norms`, the dropped samples counted per group."""
        norms, keep = nonfinite_norms(norms, total_sq)
        if keep is not None:
            for j, k in enumerate(groups):
                self.totals.nonfinite[k] += (~keep[:, j]).sum()
        return norms, keep

    def _factors(self, norms: Tensor, thresholds: Tensor, keep: Tensor | None) -> Tensor:
        return clip_factors(self.ctx.clip, norms, thresholds, keep, self.row_weights, self.unscale,
                            self.sum_scale)

    def _group_sums(self, k: int, factors: Tensor, keep: Tensor | None, norms: Tensor) -> None:
        """Σ_i c_i G_i of group k's parameters (``factors`` [b]) into the step's sums; its stash freed."""
        e, out = self.ctx, self.totals
        self._dense_sums(k, factors, keep)
        for idx in e.members[k]:
            parts, self.parts[idx] = self.parts[idx], None
            if not parts:
                continue
            p = e.params[idx]
            exact = self.exact.pop(idx, None)
            keep_rows = keep
            if exact is not None:  # the flagged rows are summed from their float64 parts
                kept = torch.ones(self.batch, dtype=torch.bool, device=e.device).index_fill_(0, exact[0], False)
                keep_rows = kept if keep is None else keep & kept
            summed = parts if keep_rows is None else zero_samples(parts, keep_rows.to(p.device))

            def sum_of(c: Tensor, summed=summed, exact=exact, p=p) -> Tensor:
                total = clipped_sum(summed, c.to(p.device), p.shape)
                if exact is not None:
                    rows, parts64 = exact
                    total = total + clipped_sum(parts64, c[rows].to(p.device, torch.float64),
                                                p.shape).to(total.dtype)
                return total
            if self.witness_rows:
                self._witness(idx, sum_of, factors)
            total = sum_of(factors)
            if exact is not None:
                rows, parts64 = exact
                for part in parts64:
                    self.meter.remove(part.tensors())
            for part in parts:
                self.meter.remove(part.tensors())
            out.sums[idx] = running_sum(out.sums[idx], total)
        self.norms[k] = norms   # the clipped ones are counted for all groups at once (_finish)
        self.done[k] = True

    def _dense_sums(self, k: int, factors: Tensor, keep: Tensor | None) -> None:
        """Σ_i c_i G_i of group k's small instantiated gradients, from their concatenation
        (:meth:`_group_norm_sq`; :func:`~dpclip.engine.groupwise.sliced_sums`)."""
        batched, self.dense_flat[k] = self.dense_flat[k], None
        if batched is None:
            return
        flat, indices = batched
        out = self.totals
        shapes = [self.ctx.params[idx].shape for idx in indices]
        for r in self.witness_rows:
            masked = torch.zeros_like(factors)
            masked[r] = factors[r]
            for idx, total in zip(indices, sliced_sums(flat, shapes, masked, keep)):
                self.witness[r][idx] = total.detach().clone()
        totals = sliced_sums(flat, shapes, factors, keep)
        for idx, total in zip(indices, totals):
            out.sums[idx] = running_sum(out.sums[idx], total)
            for part in self.parts[idx]:
                self.meter.remove(part.tensors())
            self.parts[idx] = None
        if len(indices) > 1:
            self.meter.remove([flat])

    def finish(self) -> Tensor:
        """Finalize what the backward did not reach; return the norms [b, K]. Without gradients,
        as inside the backward: a reentrant recomputation's saved tensors still record them."""
        with engine_math((self.ctx.device.type,)), torch.no_grad():   # float32 math even inside autocast
            return self._finish()

    def _finish(self) -> Tensor:
        e = self.ctx
        for idx, n in enumerate(self.pending):
            if n > 0:  # some call's output never reached the loss: its gradient is zero
                self.pending[idx] = 0
                self._param_done(idx)
        if self.defer:
            self._certify(list(range(len(e.members))))   # every group's checks: one read
            norm_sq = [self._group_norm_sq(k) for k in range(len(e.members))]
            norm_sq = torch.stack([s if s is not None else
                                   torch.zeros(self.batch, device=e.device, dtype=e.norm_dtype)
                                   for s in norm_sq], dim=1)
            if e.exchange_norm_sq is not None:
                norm_sq = e.exchange_norm_sq(norm_sq)
                self.sq_terms = [[column] for column in norm_sq.unbind(dim=1)]
            norms = sqrt_or_zero(norm_sq)
            if self.unscale is not None:
                norms = norms * self.unscale
            if not math.isfinite(float(norms.sum())):   # NaN reads as +inf to the policy
                norms = torch.where(torch.isfinite(norms), norms, math.inf)
            per_sample = None if self.per_sample_thresholds is None else self.per_sample_thresholds(norms)
            self.used_thresholds = self.thresholds if per_sample is None else per_sample
            for k in range(len(e.members)):
                self._finalize(k, self.thresholds[k] if per_sample is None else per_sample[:, k])
        else:
            per_sample = None
            self.used_thresholds = self.thresholds
            self._finalize_ready()
            for k in range(len(e.members)):
                if not self.done[k]:
                    self._finalize(k, self.thresholds[k])
        norms = torch.stack(self.norms, dim=1)
        if e.count_clipped:   # each group's count against the threshold it was clipped at
            self.totals.clipped += (norms > (self.thresholds if per_sample is None else per_sample)).sum(0)
        return norms

    def discard(self) -> None:
        self.witness.clear()
        super().discard()
        self.ready = []


def _only_row(clip: Callable[[Tensor, slice], Tensor], row: int) -> Callable[[Tensor, slice], Tensor]:
    """A streamed group's clip (:func:`~dpclip.engine.groupwise.chunk_clip`) with every factor but
    ``row``'s set to 0: the certificate's witness of that row."""
    def factors_of(chunk_norms: Tensor, rows: slice) -> Tensor:
        factors = clip(chunk_norms, rows)
        index = torch.arange(rows.start, rows.start + factors.shape[0], device=factors.device)
        return torch.where(index == row, factors, 0)
    return factors_of
