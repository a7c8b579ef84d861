"""At run time: a shared layer output broadcast over the batch only after a chain of ops.

T5's relative position bias: the bias Embedding gets shared [T, T] buckets, ``permute`` and
``unsqueeze`` keep its output shared, each layer's attention adds it to its scores (or takes
it as sdpa's mask). :class:`Chained` carries the output's plain values; at each consumer the
probes established, the layer runs book-kept on its input expanded over the batch (once per
forward), the chain is replayed per sample (vmap), and the consumer gets the result with the
batch where the probe found it: the same values, an output gradient per sample.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dpclip.engine.batch_axis.consumers import CHAIN, EVENTS, Consumer, func_name, repeat_factors
from dpclip.engine.batch_axis.layout import BROADCAST_HINT
from dpclip.errors import EngineError
from dpclip.torch_compat import tree_flatten, tree_unflatten


class Chained(Tensor):
    """At run time: the output of a layer fed a shared input, whose probed consumers broadcast
    it over the batch only after a chain of ops (T5's relative position bias: ``permute``,
    ``unsqueeze``, then added to each layer's attention scores). It carries the output's
    plain values; the chain's ops extend it; at each consumer the layer runs book-kept on its
    input expanded over the batch (once per forward), the chain is replayed per sample on
    that ([B, ...] via vmap) and the consumer gets it with the batch where the probe found
    the broadcast: the same values, and an output gradient per sample."""

    _dp_state: "ChainState"
    _dp_chain: tuple

    @staticmethod
    def wrap(value: Tensor, state: "ChainState", chain: tuple = ()) -> "Chained":
        t = value.as_subclass(Chained)
        t._dp_state, t._dp_chain = state, chain
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        mine = [i for i, t in enumerate(flat) if isinstance(t, Chained)]
        name = func_name(func)
        with torch.DisableTorchFunctionSubclass():
            if not mine:
                return func(*args, **kwargs)
            me = flat[mine[0]]
            state = me._dp_state
            if len(mine) > 1:
                raise EngineError(f"module {state.label}: its output meets another shared "
                                  f"tensor in `{name}`", BROADCAST_HINT)
            others = [t for i, t in enumerate(flat) if i != mine[0] and isinstance(t, Tensor)]
            i = mine[0]

            def link(y, func=func, flat=flat, spec=spec, i=i):
                leaves = list(flat)
                leaves[i] = y
                a, k = tree_unflatten(leaves, spec)
                return func(*a, **k)

            if name.endswith("_") and not name.startswith("_") and flat[0] is me:
                # changed in place (DeBERTa's ``pos_query_layer /= scale``; the probes see the tensor
                # itself come back): the per-sample replay does it too, if it is an op the chain knows
                if name[:-1] not in EVENTS | CHAIN:
                    raise EngineError(f"module {state.label}: its output is changed in place by `{name}`, "
                                      "which the engine does not replay per sample", BROADCAST_HINT)
                func(*args, **kwargs)
                me._dp_chain = me._dp_chain + (link,)
                return me
            if not others and name in CHAIN:   # still shared: one more link of the chain
                out = func(*args, **kwargs)
                if out is me or not isinstance(out, Tensor):
                    return out
                return Chained.wrap(out, state, me._dp_chain + (link,))
            if name not in EVENTS:
                out = func(*args, **kwargs)
                if isinstance(out, Tensor) and out is not me:
                    raise EngineError(f"module {state.label}: its output is consumed by `{name}`, "
                                      "which the probe forwards did not see", BROADCAST_HINT)
                return out                      # a metadata read (the unexpanded shape)
            event = state.next_event(name)
            if event.result_batch is None:      # the other operands are shared too: a link
                return Chained.wrap(func(*args, **kwargs), state, me._dp_chain + (link,))
            # a consumer: the chained output with the batch where the probe found it
            leaves = list(flat)
            leaves[i] = state.batched(me._dp_chain, tuple(me.shape), event)
            if name == "repeat":   # probed to broadcast: the batched tensor, laid out as repeat's
                factors = repeat_factors(args, kwargs)
                sizes = (1,) * (len(factors) - me.dim()) + tuple(me.shape)
                return leaves[i].expand([f * n for f, n in zip(factors, sizes)]).contiguous()
            a, k = tree_unflatten(leaves, spec)
            return func(*a, **k)


class ChainState:
    """One chained output in one forward: its consumers so far and the book-kept output."""

    def __init__(self, label: str, batch: int, consumers: tuple[Consumer, ...],
                 materialize: Callable[[], Tensor]):
        self.label, self.batch, self.expected = label, batch, consumers
        self.materialize = materialize
        self.seen = 0
        self.output: Tensor | None = None

    def next_event(self, name: str) -> Consumer:
        if self.seen >= len(self.expected) or self.expected[self.seen].name != name:
            raise EngineError(f"module {self.label}: its output reaches `{name}`, not the op the "
                              "probe forwards saw there", BROADCAST_HINT)
        self.seen += 1
        return self.expected[self.seen - 1]

    def batched(self, chain: tuple, shape: tuple, event: Consumer) -> Tensor:
        """The chained tensor (``shape``) per sample, with the batch in ``event``'s axis."""
        if self.output is None:
            self.output = self.materialize()          # [B, ...]: book-kept, per-sample grads

        def replay(y):
            for link in chain:
                y = link(y)
            return y

        per_sample = torch.func.vmap(replay)(self.output) if chain else self.output  # [B, *shape]
        j = event.aligned
        if j >= 0 and event.rows > 1:   # `repeat` tiling axis j (size rows) by the batch: B·rows, batch-outer
            return per_sample.movedim(0, j).flatten(j, j + 1)
        if j >= 0:
            return per_sample.movedim(0, j).squeeze(j + 1)
        return per_sample.reshape(self.batch, *([1] * (-j - 1)), *shape)
