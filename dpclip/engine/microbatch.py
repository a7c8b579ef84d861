"""One micro-batch of a private step: uses in, group norms, clip factors, clipped sums out.

In backward order, each layer's uses arrive from the book-keeping; when all uses of a
parameter have arrived its per-sample norm² is added to its group; when all parameters
of a group are done, the group is *finalized*: clip factors, clipped sums, and its stash
is freed (groupwise-clipping paper Alg. 1 and §6: finer groups release memory earlier;
docs/engine.md, "Groups and early finalization"). :class:`DPEngine` builds the
:class:`StepContext` once and hands every micro-batch what it needs explicitly.

Two classes, one per half: :class:`MicroBatchNorms` takes the uses in and makes each group's
norm² (certified in float64 where its terms cancel); :class:`MicroBatch` adds the clip factors
and the clipped sums, finalizing a group once its norm² is complete.

Length: over 400 lines, because a group's norm², its certification, its clip factors and
its sums are one protocol over the same per-group state (pending, stashed, read back,
waiting to be finalized together), and the module's constants are what tests and benchmarks
patch; the arithmetic itself is in :mod:`dpclip.engine.groupwise`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dpclip.engine.bookkeeping import StashMeter
from dpclip.engine.bookkept_ops import AWAITING_RECOMPUTE, TWICE
from dpclip.engine.cancellation import cancellation_bound, certified_rows, stacked_cancellation_flags
from dpclip.engine.factors import (Dense, GramCache, Use, clipped_sum, early_instance, param_norm_sq,
                                   sqrt_or_zero, zero_samples)
from dpclip.engine.groupwise import (chunk_clip, clip_factors, concatenated_norm_sq, describe_path,
                                     nonfinite_norms, sliced_sums, stacked_columns, thresholds_of)
from dpclip.engine.precision import LOW_PRECISION, engine_math, widened
from dpclip.engine.streamed import streamable, streamed_clip
from dpclip.errors import EngineError


# Groups whose last use arrived are finalized this many at a time (all at once: one read of
# the device for their checks, one clip of their norms [b, K'] instead of K'). On a GPU a
# group's own work is a dozen small kernels and a wait, and the host bounds a small step;
# holding a few groups' stash a little longer costs little there. On the CPU each group
# still goes at once, which keeps layer-wise clipping's memory lowest.
FINALIZE_BATCH = {"cpu": 1}
FINALIZE_BATCH_DEFAULT = 4

# A parameter's instantiated per-sample gradient of at most this many elements per sample
# is normed in one concatenation with its group's others: GPT-2 small's 98 biases and
# LayerNorm weights cost three kernels a group instead of two each (docs/performance.md).
# Larger ones, say a fallback module's whole weight, are normed alone: the copy stays small.
DENSE_BATCH_MAX_NUMEL = 1 << 16


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


class MicroBatchNorms:
    """The first half of a micro-batch (:class:`MicroBatch`): the uses of its backward in, its
    per-sample norms² group by group out, certified where terms cancel.

    ``pending[j]`` counts the forward calls of parameter j whose backward has not
    arrived; ``group_left[k]`` counts group k's parameters with uses still pending. When
    the last one is done, :meth:`_group_complete` is called with k. Each parameter's uses
    become its ``parts`` (the stash its clipped sum is made from later) and a term of its
    group's norm² [b]; the stash is metered in ``meter``.
    """

    def __init__(self, ctx: StepContext, batch: int, pending: list[int]):
        self.ctx = ctx
        self.batch = batch
        self.pending = pending
        k = len(ctx.members)
        self.uses: list[list[Use]] = [[] for _ in pending]
        self.parts: list[list[Use] | None] = [None] * len(pending)
        self.group_left = [0] * k
        for idx, n in enumerate(pending):
            if n > 0:
                self.group_left[ctx.group_of[idx]] += 1
        # Group k's norm² [b]: its parameters' terms, summed when first read (one stack and
        # one sum for a group of many parameters, not one add per parameter: on a GPU each
        # is a kernel launch, and the host's launches bound a small step; docs/layer-rules.md, "Work per group").
        self.sq_terms: list[list[Tensor]] = [[] for _ in range(k)]
        # Small instantiated gradients (biases, a norm's affine): (index, G [b, ...]) per group,
        # normed together in one concatenation when the group's norm² is first read, and
        # clipped and summed from it in one product (MicroBatch._dense_sums).
        self.dense_terms: list[list[tuple[int, Tensor]]] = [[] for _ in range(k)]
        self.dense_flat: list[tuple[Tensor, list[int]] | None] = [None] * k
        self.streamed: set[int] = set()   # parameters whose G_i are instantiated at finalization
        # Cancellation (dpclip.engine.cancellation): per parameter read from factors, what
        # its check needs (norm² [b], atoms' D [b], the bound's factor), checked for the
        # whole group at once when it is certified; after certification the flagged rows'
        # float64 parts (rows, parts).
        self.checks: dict[int, tuple[Tensor, Tensor, float]] = {}
        self.exact: dict[int, tuple[Tensor, list[Use]]] = {}
        self.paths: dict[int, str] = {}   # how each parameter's norm was computed (debugging)
        self.meter = ctx.meter
        # Layers that read one input (Llama's q, k, v) ghost-norm it with one Gram.
        self.gram_cache = GramCache()
        # The certificate's rows (MicroBatch.watch), and for each the groups recomputed in float64 for it.
        self.witness_rows: list[int] = []
        self.cancelling: dict[int, set[int]] = {}

    def _group_complete(self, k: int) -> None:
        """Group k's last parameter is done (its norm² is complete)."""
        raise NotImplementedError

    def deliver(self, idx: int, use: Use, recomputed: bool = False) -> None:
        """One use of parameter ``idx``; ``recomputed``: from a call gradient checkpointing made in
        the backward, a use only where the forward's call ran without gradients (reentrant)."""
        if recomputed and self.pending[idx] < AWAITING_RECOMPUTE:
            raise EngineError(f"parameter {self.ctx.names[idx]} received {TWICE[0]}", TWICE[1])
        if self.pending[idx] <= 0:
            raise EngineError(f"parameter {self.ctx.names[idx]} was used more "
                              "often in the backward than in the forward",
                              "call engine.backward once after each forward")
        if self.pending[idx] > 1 and not self.ctx.transient[idx]:
            # more uses to come (a tied weight): a G_i no larger than its factors replaces
            # them now, instead of the factors waiting for the last use (docs/layer-rules.md)
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
        elif self._batchable(uses):   # its norm with the group's other small ones (_group_norm_sq)
            grad = widened(uses[0].grad, e.norm_dtype)
            self.meter.add(Dense(grad).tensors())
            self.meter.remove(uses[0].tensors())
            self.parts[idx] = [Dense(grad)]
            self.dense_terms[k].append((idx, grad))
            self.paths[idx] = "instantiated"
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
            self.paths[idx] = describe_path(parts, e.norm_method, e.transient[idx])
            norm_sq = norm_sq.to(e.device)
            bound = cancellation_bound(parts, norm_sq.dtype)
            if bound is not None:
                self.checks[idx] = (norm_sq, atoms_sq.to(e.device), bound)
            self.sq_terms[k].append(norm_sq)
        self.group_left[k] -= 1
        if self.group_left[k] == 0:
            self._group_complete(k)

    def _batchable(self, uses: list[Use]) -> bool:
        """One instantiated use, small, in the norm dtype once widened, on the engine's device:
        normed in one concatenation with its group's others (exact: the same sum of squares)."""
        if len(uses) != 1 or not isinstance(uses[0], Dense):
            return False
        grad, norm_dtype = uses[0].grad, self.ctx.norm_dtype
        dtype = norm_dtype if grad.dtype in LOW_PRECISION else grad.dtype   # as widened() gives it
        return (dtype == norm_dtype and grad.device == self.ctx.device
                and math.prod(grad.shape[1:]) <= DENSE_BATCH_MAX_NUMEL)

    def _group_norm_sq(self, k: int) -> Tensor | None:
        """Group k's norm² [b] so far (its terms summed and kept as one), or None."""
        dense = self.dense_terms[k]
        if dense:
            flat, sq = concatenated_norm_sq([grad for _, grad in dense])
            if len(dense) > 1:
                self.meter.add([flat])
            self.sq_terms[k].append(sq)
            self.dense_flat[k] = (flat, [idx for idx, _ in dense])
            dense.clear()
        terms = self.sq_terms[k]
        if len(terms) > 1:
            terms[:] = [terms[0] + terms[1] if len(terms) == 2 else torch.stack(terms).sum(0)]
        return terms[0] if terms else None

    def _certify(self, groups: list[int], also: Tensor | None = None) -> tuple[bool, float | None]:
        """Recompute in float64 the flagged samples of the parameters of ``groups``, and raise
        their groups' norms² to the certified bound (:func:`~dpclip.engine.cancellation.certified_rows`).

        One read from the device for all of them: whether any parameter read from factors has
        a flagged sample, and, if given, the 0-dim tensor ``also`` (a caller's check, read in
        the same transfer: a GPU step waits once per finalization, not twice). Returns (whether
        a norm² was raised, ``also``'s value)."""
        e = self.ctx
        checked = [idx for k in groups for idx in e.members[k] if idx in self.checks]
        if not checked and also is None:
            return False, None
        probes: list[Tensor] = []
        if checked:
            entries = [self.checks.pop(idx) for idx in checked]
            param_sq, atoms_sq = (torch.stack([entry[j] for entry in entries]) if len(entries) > 1
                                  else entries[0][j].unsqueeze(0) for j in (0, 1))   # [P, b]
            flags = stacked_cancellation_flags(param_sq, atoms_sq, [entry[2] for entry in entries])
            probes.append(flags.any(dim=1).to(e.norm_dtype))
        if also is not None:
            probes.append(also.to(e.norm_dtype).reshape(1))
        values = (torch.cat(probes) if len(probes) > 1 else probes[0]).tolist()
        raised = False
        for j, idx in enumerate(checked):
            if not values[j]:
                continue
            rows = flags[j].nonzero().squeeze(1)
            for r in set(rows.tolist()) & set(self.witness_rows):
                self.cancelling.setdefault(r, set()).add(e.group_of[idx])
            upper, parts64 = certified_rows(self.parts[idx], rows.to(e.params[idx].device),
                                            e.params[idx].shape, e.norm_method)
            # rounding the float64 bound to the norm dtype must not lower it
            upper = (upper * (1 + 4 * torch.finfo(e.norm_dtype).eps)).to(e.norm_dtype).to(e.device)
            raise_by = torch.zeros_like(param_sq[j]).index_put_((rows,), upper - param_sq[j][rows])
            self.sq_terms[e.group_of[idx]].append(raise_by)
            for part in parts64:
                self.meter.add(part.tensors())
            self.exact[idx] = (rows, parts64)
            self.paths[idx] += f" + float64 for {rows.numel()} cancelling sample(s)"
            raised = True
        return raised, (values[-1] if also is not None else None)

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
        for k, batched in enumerate(self.dense_flat):
            if batched is not None and len(batched[1]) > 1:
                self.meter.remove([batched[0]])
        self.dense_terms = [[] for _ in self.dense_terms]
        self.dense_flat = [None] * len(self.dense_flat)
        self.streamed.clear()


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
        self.row_weights = None if row_weights is None else row_weights.to(ctx.device, ctx.norm_dtype)
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
            out.sums[idx] = total if out.sums[idx] is None else out.sums[idx].add_(total)
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
            if out.sums[idx] is None:
                out.sums[idx] = total
            else:
                out.sums[idx].add_(total)
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
            out.sums[idx] = total if out.sums[idx] is None else out.sums[idx].add_(total)
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
