"""The loss head reads the model through its returned tensors only.

The certificate replays each checked sample's gradient as Jᵀ·cot, with cot the loss's cotangent
on the tensors the model's forward returned (replay.Cotangents). A loss that also reads a tensor
the forward kept elsewhere (``loss + w * model.aux`` with ``self.aux`` set in the forward, a
feature taken out by a forward hook) reaches the model's layers by a path no replay follows: the
engine clips that path's gradient, the certificate never sees it, and a small enough term (a
load-balancing loss over the batch times 1e-4, below the float32 rounding bound) trained with
the samples mixed. The losses' graph is walked once per check, from the losses down to the
returned tensors; it must meet no book-kept layer on the way (one walk of the loss head, not
through the model)."""

from __future__ import annotations

from torch import Tensor

from dpclip.engine.bookkept_ops import Call
from dpclip.engine.certificate.replay import Forward
from dpclip.errors import EngineError


def refuse_reads_past_outputs(losses: Tensor, forwards: list[Forward]) -> None:
    """An EngineError when the losses' graph reaches a book-kept layer of the model other than
    through the gradient edges of the forwards' returned tensors (before any noise)."""
    stop = {(id(e.node), e.output_nr) for f in forwards for e in f.edges}
    todo, seen = [(losses.grad_fn, 0)], set()
    while todo:
        node, nr = todo.pop()
        if node is None or (id(node), nr) in stop or id(node) in seen:
            continue
        seen.add(id(node))
        call = getattr(node, "call", None)
        if isinstance(call, Call):
            raise EngineError(
                f"the per-sample losses read module {call.unit.label} other than through the tensors the "
                "model's forward returned (e.g. an auxiliary loss kept on the model, `loss + model.aux`, "
                "or a feature taken out by a hook): the certificate checks each sample's gradient through "
                "the returned tensors only, and such a term, as a load-balancing loss over the batch, "
                "may mix samples",
                "return from the forward every tensor the loss uses, each sample's from its own rows "
                "(an auxiliary loss averaged over the batch mixes samples: leave it off)")
        todo.extend(node.next_functions)
