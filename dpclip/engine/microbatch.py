"""One micro-batch of a private step: uses in, group norms, clip factors, clipped sums out.

In backward order, each layer's uses arrive from the book-keeping; when all uses of a
parameter have arrived its per-sample norm² is added to its group; when all parameters
of a group are done, the group is *finalized*: clip factors, clipped sums, and its stash
is freed (groupwise-clipping paper Alg. 1 and §6: finer groups release memory earlier;
docs/engine.md, "Groups and early finalization"). :class:`DPEngine` builds the
:class:`StepContext` once and hands every micro-batch what it needs explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dpclip.engine.bookkeeping import StashMeter
from dpclip.engine.cancellation import cancellation_flags, certified_rows
from dpclip.engine.factors import (Dense, GramCache, Use, choose_ghost, clipped_sum, early_instance,
                                   param_norm_sq, sqrt_or_zero, zero_samples)
from dpclip.engine.precision import engine_math
from dpclip.engine.streamed import streamable, streamed_clip
from dpclip.errors import EngineError


@dataclass(frozen=True)
class StepContext:
    """What a micro-batch needs from the engine, fixed when the engine is built.

    Per parameter j: ``params[j]``, ``names[j]``, its group ``group_of[j]`` and whether
    its group is finalized as soon as its own backward is done (``transient[j]``).
    ``members[k]``: group k's parameter indices. ``clip(norms, thresholds)``: the clip
    function's factors. ``count_clipped``: whether "clipped" means anything (not for AUTO).
    """

    params: list[Tensor]
    names: list[str]
    group_of: list[int]
    members: list[list[int]]
    transient: list[bool]
    norm_method: str
    clip: Callable[[Tensor, Tensor], Tensor]
    count_clipped: bool
    norm_dtype: torch.dtype
    device: torch.device
    meter: StashMeter
    # Pipeline stage with one flat threshold: per-sample norms² [b, K] summed over the stages
    # before any clip factor (docs/distributed.md); None: norms are this process's own.
    exchange_norm_sq: Callable[[Tensor], Tensor] | None = None


@dataclass
class StepTotals:
    """The step's accumulators across micro-batches: clipped sums per parameter, and per
    group the count of clipped and of non-finite samples (tensors updated in place)."""

    sums: list[Tensor | None]
    clipped: Tensor
    nonfinite: Tensor


class MicroBatch:
    """One engine.backward: pending uses per parameter, group norms, finalization.

    ``pending[j]`` counts the forward calls of parameter j whose backward has not
    arrived; ``group_left[k]`` counts group k's parameters with uses still pending.
    ``thresholds`` [K] are the policy's; ``per_sample_thresholds`` (norms [b, K] ->
    thresholds [b, K] or None) is given for a per-sample policy, which needs all K norms
    of a sample first: every group is then finalized at the end. Results are added into
    ``totals`` (the step's accumulators, owned by the engine).
    """

    def __init__(self, ctx: StepContext, totals: StepTotals, batch: int, pending: list[int],
                 thresholds: Tensor, per_sample_thresholds: Callable | None = None,
                 loss_scale: float = 1.0, row_weights: Tensor | None = None, sum_scale: float = 1.0):
        self.ctx = ctx
        # The sums are wanted as Σ_i c_i G_i / B (``p.grad`` before noise, B the expected batch
        # size): the 1/B rides on the clip factors, B numbers, instead of a pass over every
        # gradient coordinate at the end of the step.
        self.sum_scale = None if sum_scale == 1.0 else float(sum_scale)
        # Per-row weights on the clip factors (a person's records weigh 1 together under
        # user-level privacy, docs/users.md): each row's clipped gradient is scaled by its
        # weight, so the sum moves by at most Σ weights · C when those rows go.
        self.row_weights = None if row_weights is None else row_weights.to(ctx.device, ctx.norm_dtype)
        # The backward was seeded with loss_scale (float16): every norm it gives is
        # loss_scale times the sample's, so norms and clip factors are divided by it before
        # anything compares them with a threshold (docs/engine.md, "Mixed precision").
        if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale > 0):
            raise EngineError(f"loss_scale must be a positive finite number, got {loss_scale!r}",
                              "use a power of two such as 1024")
        self.unscale = None if loss_scale == 1.0 else 1.0 / loss_scale
        self.totals = totals
        self.batch = batch
        self.pending = pending
        k = len(ctx.members)
        self.uses: list[list[Use]] = [[] for _ in pending]
        self.parts: list[list[Use] | None] = [None] * len(pending)
        self.group_left = [0] * k
        for idx, n in enumerate(pending):
            if n > 0:
                self.group_left[ctx.group_of[idx]] += 1
        self.norm_sq: list[Tensor | None] = [None] * k
        self.norms: list[Tensor | None] = [None] * k
        self.streamed: set[int] = set()   # parameters whose G_i are instantiated at finalization
        # Cancellation (dpclip.engine.cancellation): per parameter read from factors, the
        # samples whose norm² the working precision cannot vouch for, its norm² [b], and
        # after certification the flagged rows' float64 parts (rows, parts).
        self.flags: list[Tensor | None] = [None] * len(pending)
        self.param_sq: list[Tensor | None] = [None] * len(pending)
        self.exact: dict[int, tuple[Tensor, list[Use]]] = {}
        self.paths: dict[int, str] = {}   # how each parameter's norm was computed (debugging)
        self.done = [False] * k
        self.thresholds = thresholds
        self.per_sample_thresholds = per_sample_thresholds
        self.defer = per_sample_thresholds is not None or ctx.exchange_norm_sq is not None
        self.meter = ctx.meter
        # Layers that read one input (Llama's q, k, v) ghost-norm it with one Gram.
        self.gram_cache = GramCache()

    def deliver(self, idx: int, use: Use) -> None:
        if self.pending[idx] <= 0:
            raise EngineError(f"parameter {self.ctx.names[idx]} was used more "
                              "often in the backward than in the forward",
                              "call engine.backward once after each forward")
        if self.pending[idx] > 1 and not self.ctx.transient[idx]:
            # more uses to come (a tied weight): a G_i no larger than its factors replaces
            # them now, instead of the factors waiting for the last use (docs/engine.md)
            use = early_instance(use, self.ctx.params[idx].shape, self.ctx.norm_method)
        self.uses[idx].append(use)
        self.meter.add(use.tensors())
        self.pending[idx] -= 1
        if self.pending[idx] == 0:
            self._param_done(idx)

    def _param_done(self, idx: int) -> None:
        e = self.ctx
        k = e.group_of[idx]
        uses, self.uses[idx] = self.uses[idx], []
        bundle = streamable(uses, e.norm_method) if e.transient[idx] else None
        if bundle is not None:  # instantiated chunk by chunk when the group is finalized
            self.meter.add(bundle.tensors())
            for use in uses:
                self.meter.remove(use.tensors())
            self.parts[idx] = [bundle]
            self.streamed.add(idx)
            self.paths[idx] = "instantiated (streamed)"
        elif uses:
            p = e.params[idx]
            norm_sq, parts, atoms_sq = param_norm_sq(uses, p.shape, e.norm_method, e.norm_dtype,
                                                     transient=e.transient[idx], with_atoms=True,
                                                     gram_cache=self.gram_cache)
            for part in parts:
                self.meter.add(part.tensors())
            for use in uses:
                self.meter.remove(use.tensors())
            self.parts[idx] = parts
            self.paths[idx] = self._path(parts, e.transient[idx])
            flags = cancellation_flags(parts, norm_sq, atoms_sq)
            if flags is not None:
                self.flags[idx], self.param_sq[idx] = flags.to(e.device), norm_sq.to(e.device)
            norm_sq = norm_sq.to(e.device)
            self.norm_sq[k] = norm_sq if self.norm_sq[k] is None else self.norm_sq[k] + norm_sq
        self.group_left[k] -= 1
        if self.group_left[k] == 0 and not self.defer:
            self._finalize(k, self.thresholds[k])

    def _path(self, parts: list[Use], transient: bool) -> str:
        def one(part: Use) -> str:
            if isinstance(part, Dense):
                return "instantiated"
            kind = "ids " if part.is_ids else ""
            if choose_ghost(part, self.ctx.norm_method, transient):
                return kind + "ghost"
            return kind + "instantiated norm, factor sum"
        return " + ".join(one(p) for p in parts)

    def _certify(self, k: int, also: Tensor | None = None) -> tuple[bool, float | None]:
        """Recompute in float64 the flagged samples of group k's parameters, and raise the
        group's norm² to the certified bound (:func:`~dpclip.engine.cancellation.certified_rows`).

        One read from the device for the group: whether any parameter read from factors has
        a flagged sample, and, if given, the 0-dim tensor ``also`` (a caller's check, read in
        the same transfer: a GPU step waits once per group, not twice). Returns (whether a
        norm² was raised, ``also``'s value)."""
        e = self.ctx
        flagged = [(idx, self.flags[idx]) for idx in e.members[k] if self.flags[idx] is not None]
        if not flagged and also is None:
            return False, None
        probes = [f.any().to(e.norm_dtype) for _, f in flagged]
        if also is not None:
            probes.append(also.to(e.norm_dtype))
        values = torch.stack(probes).tolist()
        raised = False
        for (idx, flags), hit in zip(flagged, values):
            self.flags[idx] = None
            param_sq, self.param_sq[idx] = self.param_sq[idx], None
            if not hit:
                continue
            rows = flags.nonzero().squeeze(1)
            upper, parts64 = certified_rows(self.parts[idx], rows.to(e.params[idx].device),
                                            e.params[idx].shape, e.norm_method)
            # rounding the float64 bound to the norm dtype must not lower it
            upper = (upper * (1 + 4 * torch.finfo(e.norm_dtype).eps)).to(e.norm_dtype).to(e.device)
            raise_by = torch.zeros_like(param_sq).index_put_((rows,), upper - param_sq[rows])
            self.norm_sq[k] = self.norm_sq[k] + raise_by
            for part in parts64:
                self.meter.add(part.tensors())
            self.exact[idx] = (rows, parts64)
            self.paths[idx] += f" + float64 for {rows.numel()} cancelling sample(s)"
            raised = True
        return raised, (values[-1] if also is not None else None)

    def _finalize(self, k: int, threshold: Tensor) -> None:
        e, out = self.ctx, self.totals
        sq = self.norm_sq[k]
        streamed = [idx for idx in e.members[k] if idx in self.streamed]
        # Σ_i norm²_i is finite iff every norm² is (or it overflows: the slow path below
        # then finds nothing to drop); read with the cancellation check's flags
        raised, total_sq = self._certify(k, sq.sum() if sq is not None and not streamed else None)
        sq = self.norm_sq[k]
        unscale = self.unscale
        if streamed:
            base = sq if sq is not None else torch.zeros(self.batch, device=e.device,
                                                         dtype=e.norm_dtype)
            bundles = [self.parts[idx][0] for idx in streamed]
            weights = self.row_weights
            # the chunks' G_i are scaled by the loss scale: unscaled norms in, factors that also
            # unscale out; and the sums carry 1/B
            to_sum = (unscale or 1.0) * (self.sum_scale or 1.0)

            def clip(chunk_norms, rows):
                factors = e.clip(chunk_norms if unscale is None else chunk_norms * unscale, threshold)
                if weights is not None:
                    factors = factors * weights[rows]
                return factors if to_sum == 1.0 else factors * to_sum
            norms, sums = streamed_clip(bundles, [e.params[idx].shape for idx in streamed], base,
                                        clip, self.meter)
            for idx, total in zip(streamed, sums):
                self.meter.remove(self.parts[idx][0].tensors())
                self.parts[idx] = None
                self.streamed.discard(idx)
                out.sums[idx] = total if out.sums[idx] is None else out.sums[idx].add_(total)
        else:
            norms = (sqrt_or_zero(sq) if sq is not None else
                     torch.zeros(self.batch, device=e.device, dtype=e.norm_dtype))
        if unscale is not None:
            norms = norms * unscale
        keep = None
        # A sample with a non-finite norm would put 0·inf = NaN into the sum: one example
        # could change the release without bound. It contributes zero instead, and reads
        # as +inf (clipped, above every threshold) to the policy. The norms are ≥ 0, so
        # their sum is finite unless one is not (or it overflows: then the slow path finds
        # nothing to drop); one reduction per group is ~4x cheaper than isfinite().all().
        if not math.isfinite(total_sq if total_sq is not None and not raised else float(norms.sum())):
            finite = torch.isfinite(norms)
            if not bool(finite.all()):
                keep = finite
                norms = torch.where(keep, norms, math.inf)
                out.nonfinite[k] += (~keep).sum()
        factors = e.clip(norms, threshold)
        if self.row_weights is not None:
            factors = factors * self.row_weights
        if keep is not None:
            factors = torch.where(keep, factors, 0)
        if unscale is not None:   # the parts hold the scaled gradient
            factors = factors * unscale
        if self.sum_scale is not None:
            factors = factors * self.sum_scale
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
            total = clipped_sum(summed, factors.to(p.device), p.shape)
            if exact is not None:
                rows, parts64 = exact
                total = total + clipped_sum(parts64, factors[rows].to(p.device, torch.float64),
                                            p.shape).to(total.dtype)
                for part in parts64:
                    self.meter.remove(part.tensors())
            for part in parts:
                self.meter.remove(part.tensors())
            if out.sums[idx] is None:
                out.sums[idx] = total
            else:
                out.sums[idx].add_(total)
        if e.count_clipped:
            out.clipped[k] += (norms > threshold).sum()
        self.norms[k] = norms
        self.done[k] = True

    def finish(self) -> Tensor:
        """Finalize what the backward did not reach; return the norms [b, K]."""
        with engine_math((self.ctx.device.type,)):   # float32 math even inside an autocast region
            return self._finish()

    def _finish(self) -> Tensor:
        e = self.ctx
        for idx, n in enumerate(self.pending):
            if n > 0:  # some call's output never reached the loss: its gradient is zero
                self.pending[idx] = 0
                self._param_done(idx)
        if self.defer:
            for k in range(len(e.members)):
                self._certify(k)
            norm_sq = torch.stack([s if s is not None else
                                   torch.zeros(self.batch, device=e.device, dtype=e.norm_dtype)
                                   for s in self.norm_sq], dim=1)
            if e.exchange_norm_sq is not None:
                norm_sq = e.exchange_norm_sq(norm_sq)
                self.norm_sq = list(norm_sq.unbind(dim=1))
            norms = sqrt_or_zero(norm_sq)
            if self.unscale is not None:
                norms = norms * self.unscale
            if not math.isfinite(float(norms.sum())):   # NaN reads as +inf to the policy
                norms = torch.where(torch.isfinite(norms), norms, math.inf)
            per_sample = None if self.per_sample_thresholds is None else self.per_sample_thresholds(norms)
            for k in range(len(e.members)):
                self._finalize(k, self.thresholds[k] if per_sample is None else per_sample[:, k])
        else:
            for k in range(len(e.members)):
                if not self.done[k]:
                    self._finalize(k, self.thresholds[k])
        return torch.stack(self.norms, dim=1)

    def discard(self) -> None:
        """Release the stash after a failed backward."""
        for uses in self.uses:
            for use in uses:
                self.meter.remove(use.tensors())
        for parts in self.parts:
            for part in parts or ():
                self.meter.remove(part.tensors())
        for _, parts64 in self.exact.values():
            for part in parts64:
                self.meter.remove(part.tensors())
        self.exact.clear()
        self.uses = [[] for _ in self.pending]
        self.parts = [None] * len(self.pending)
        self.streamed.clear()
