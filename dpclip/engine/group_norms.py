"""The first half of a micro-batch: its backward's uses in, each group's per-sample norm² out.

In backward order, each layer's uses arrive from the book-keeping (:meth:`MicroBatchNorms.deliver`);
when all uses of a parameter have arrived its per-sample norm² becomes a term of its group's; when
all parameters of a group are done, the group is complete and the second half,
:class:`~dpclip.engine.microbatch.MicroBatch`, finalizes it (clip factors, clipped sums). Norms
whose terms cancel are certified in float64 (:mod:`dpclip.engine.cancellation`; docs/engine.md).
:class:`StepContext` is what both halves need from the engine, fixed when the engine is built.
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
from dpclip.engine.factors import Dense, GramCache, Use, early_instance, param_norm_sq
from dpclip.engine.groupwise import concatenated_norm_sq, describe_path
from dpclip.engine.precision import LOW_PRECISION, widened
from dpclip.engine.streamed import streamable
from dpclip.errors import EngineError

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


class MicroBatchNorms:
    """The first half of a micro-batch (:class:`~dpclip.engine.microbatch.MicroBatch`): the uses of
    its backward in, its per-sample norms² group by group out, certified where terms cancel.

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
