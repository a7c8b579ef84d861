"""The batch-axis part of the capture a layer rule's ``call`` gets (bookkept_ops' ``Site``).

``layout_of(t)``: the established layout of a tensor the module was called with;
``batch_first(t, feature_dims)``: that tensor with the batch in axis 0 and the map back;
``chained(rule, x)``: the output for a shared input broadcast after a chain of ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpclip.engine.batch_axis.chained import ChainState, Chained
from dpclip.engine.batch_axis.layout import (CallLayout, Layout, same_batch, expand_shared,
                                             shared_lead1, to_batch_first)
from dpclip.errors import EngineError


class SiteBatch:
    """The base of the capture (bookkept_ops' ``Site``), which provides ``module``, ``label``,
    ``op`` and ``bypass``. ``axes``: the model's
    :class:`~dpclip.engine.batch_axis.state.BatchAxes`. ``layout`` and the call's tensors are
    those of the call in progress, set by :meth:`set_call` before the rule's ``call``
    (:meth:`~dpclip.engine.batch_axis.state.BatchAxes.enter`, or a recomputation's layout)."""

    def __init__(self, axes):   # a BatchAxes (state.py, which imports this module)
        self._axes = axes
        self.layout: CallLayout | None = None
        self._leaves: list[Tensor] = []

    def set_call(self, layout: CallLayout | None, leaves: list[Tensor]) -> None:
        """The call in progress: its established layout and the tensors it was called with
        (:func:`~dpclip.engine.batch_axis.call_leaves`)."""
        self.layout, self._leaves = layout, leaves

    def current_call(self) -> tuple[CallLayout | None, list[Tensor]]:
        """``(layout, tensors)`` of the call in progress, to be set back (:meth:`set_call`)
        when a call that interrupts it ends."""
        return self.layout, self._leaves

    def children_batch_first(self):
        """Calls of child modules inside get the batch in dim 0 of every tensor (a rule
        that calls a child itself with batch-first tensors: MultiheadAttention's out_proj;
        the probes, which run the module's own forward, never see those calls)."""
        return self._axes.children_batch_first()

    @property
    def batch_size(self) -> int:
        """B of the model's forward in progress (dim 0 of the model's first tensor input)."""
        return self._axes.batch

    @property
    def batch_hint(self) -> int | None:   # the former name, kept for rules written against it
        return self._axes.batch

    def note_expanded(self, t: Tensor) -> None:
        """``t``, a shared output this call expanded over the batch, is per sample from now on."""
        self._axes.note_expanded(t)

    def layout_of(self, t: Tensor) -> Layout:
        """The established batch layout of ``t``, a tensor this call received."""
        for i, leaf in enumerate(self._leaves):
            if leaf is t:
                return self.layout.input(i, t)
        raise EngineError(f"module {self.label}: its rule asked for the batch layout of a tensor "
                          "the module was not called with", "pass the call's own input tensors")

    def batch_first(self, t: Tensor, feature_dims: int | None = None):
        """``(t with the batch in dim 0, map putting an output back in t's layout)``
        (:func:`dpclip.engine.batch_axis.to_batch_first`)."""
        lay = self.layout_of(t)
        if lay.dim == 0 and not lay.merged:      # the common case: nothing to move
            return t, same_batch
        return to_batch_first(t, lay, self.batch_size, feature_dims, self.label)

    def chained(self, rule, x: Tensor) -> Tensor:
        """The output for a shared input ``x`` whose probed consumers broadcast it over the
        batch after a chain of ops: plain values now; the book-kept call on ``x`` expanded
        over the batch runs at the first consumer (:class:`~dpclip.engine.batch_axis.Chained`)."""
        module, batch = self.module, self.batch_size
        lead1 = shared_lead1(self.layout_of(x), x, rule.feature_dims(module))
        with torch.no_grad(), self.bypass():
            y = module(x)

        def materialize() -> Tensor:     # [B, *y.shape]: sample i's copy of the output
            a, info = rule.prepare(module, expand_shared(x, lead1, batch), batch)
            out = self.op(rule, a, info)
            return out.unsqueeze(1) if lead1 else out

        return Chained.wrap(y, ChainState(self.label, batch, self.layout.consumers, materialize))
