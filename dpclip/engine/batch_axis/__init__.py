"""Which axis of each captured tensor is the batch: established by observation, never by a size.

The engine's one contract on the model's inputs: the batch size B of a forward is dim 0 of
the model's first tensor input. Inside the model, a layer's input may hold the batch in
any axis ([T, B, d] sequence-first), merged with positions ([B·T, d], OPT's MLP), or not at
all (positions ``arange(T)`` shared by every sample, a learned query): a size equal to B
proves nothing (T == B), so the engine *probes* instead (docs/layer-rules.md, "The batch axis").

- :mod:`.layout`: what is established per tensor (:class:`Layout`) and call
  (:class:`CallLayout`), and how a rule gets its input with the batch first;
- :mod:`.probe`: the probe forwards, and how their shapes give the layouts;
- :mod:`.consumers`: following a shared layer output to the ops that broadcast it over the
  batch (or refusing it);
- :mod:`.chained`: at run time, a shared output broadcast only after a chain of ops (T5);
- :mod:`.state`: the forward in progress, the cache, when to probe;
- :mod:`.site`: what a layer rule's capture offers about the batch.
"""

from dpclip.engine.batch_axis.chained import ChainState, Chained
from dpclip.engine.batch_axis.consumers import Consumer, ConsumerCheck
from dpclip.engine.batch_axis.layout import (BATCH_FIRST, BATCH_HINT, BROADCAST_HINT, CallLayout,
                                             Layout, same_batch, call_leaves, check_batch, expand_shared,
                                             shared_lead1, tensor_leaves, to_batch_first)
from dpclip.engine.batch_axis.probe import Probe, compare, resized
from dpclip.engine.batch_axis.site import SiteBatch
from dpclip.engine.batch_axis.state import BatchAxes

__all__ = ["BATCH_FIRST", "BATCH_HINT", "BROADCAST_HINT", "BatchAxes", "CallLayout", "ChainState",
           "Consumer", "ConsumerCheck", "Layout", "Probe", "call_leaves", "compare", "expand_shared",
           "resized", "shared_lead1", "SiteBatch", "check_batch", "tensor_leaves", "to_batch_first", "Chained", "same_batch"]
