"""What is established about the batch of one tensor, and of one module call.

A :class:`Layout` says where one tensor holds the batch (an axis, an axis merged with
positions, or nowhere: shared by every sample); a :class:`CallLayout` gathers those of one
call of a book-kept module. :func:`to_batch_first` hands a rule its input with the batch in
axis 0 (moved, unflattened, or expanded over the batch) and the map back for its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from dpclip.errors import EngineError
from dpclip.torch_compat import tree_flatten

BATCH_HINT = ("pass the model's inputs with the batch in dim 0 (its first tensor input sets the "
              "batch size) and build shared tensors (positions, masks) inside the forward "
              "or with a leading dimension 1")
#: a forward that fails on fewer samples than its batch: a layout the probes cannot cut, or an
#: operation that needs the other samples (it mixes them)
CUT_BATCH_HINT = (BATCH_HINT + "; if they are, the forward needs the rest of the batch to run (topk, kthvalue or "
                  "sort along the batch, routing with a capacity over the batch's tokens, vmap or jacrev over the "
                  "batch): it mixes samples, so compute each sample's output from that sample alone")
#: a forward that fails on fewer samples while some of its inputs have no dim 0 of size B: the
#: probes passed those whole, as a packing of every sample's rows (a vision-language model's patches)
PACKED_HINT = ("give every input of the model the batch in dim 0: one that packs the samples' rows into "
               "one axis (a vision-language model's pixel_values, every image's patches as [sum of patches, d]) "
               "goes in batch-first ([B, patches, d]) and is flattened inside the forward, by a module "
               "wrapping the model (docs/supported-models.md, \"Vision-language models\"); " + CUT_BATCH_HINT)
EQUAL_ROWS_HINT = ("rows equal for every token cannot be told apart by sample (a top-1 router renormalised "
                   "to weight 1 gives every token the weight 1): route each token to two experts or more, "
                   "or freeze the layers that read them (requires_grad_(False))")
BROADCAST_HINT = ("give the module a per-sample input (e.g. pass positions as [B, T]: "
                  "ids.new_tensor(range(T)).expand(B, T)), or freeze the module; and call the model with the "
                  "batch in dim 0 of its first tensor input (sequence-first [T, B, ...] inputs are read as T "
                  "samples: transpose them before the call, back inside the forward if it needs them so)")


def tensor_leaves(tree) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


def call_leaves(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors of a module call, in the order layouts are recorded."""
    if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
        return [args[0]]
    return tensor_leaves((args, kwargs))


@dataclass(frozen=True)
class Layout:
    """Where the batch is in one tensor of a module call."""

    ndim: int
    dim: int | None = None    # the batch axis; None: shared by every sample
    merged: bool = False      # ``dim`` holds the batch merged with positions: [outer, B, rows] flattened
    #: merged: the blocks outside the batch (1: [B, T] flattened, OPT's tokens; c: [c, B], views
    #: concatenated on the batch; E: [E, B, T], Llama 4's experts taking every token once each)
    outer: int = 1
    lead1: bool = False       # shared, with size 1 in dim 0 (expanded there)
    error: str | None = None  # why no batch axis could be established
    expand_rows: int = 1      # a shared output its consumers broadcast over B·c rows: c (Swin's windows)
    hint: str = BATCH_HINT    # what to do about ``error``

    def fits(self, t: Tensor, batch: int) -> bool:
        if t.dim() != self.ndim:
            return False
        if self.dim is None:
            return self.ndim == 0 or (t.shape[0] == 1) == self.lead1
        size = t.shape[self.dim]
        return size > 0 and size % (batch * self.outer) == 0 if self.merged else size == batch


@dataclass(frozen=True)
class CallLayout:
    """The layouts of one call of a book-kept module (its tensors in tree order)."""

    inputs: tuple[Layout, ...] | None           # None: the batch in dim 0 of every tensor
    outputs: tuple[Layout, ...] | None = None
    refusal: str | None = None                  # why the call cannot be book-kept exactly
    hint: str | None = None                     # the refusal's hint (None: BROADCAST_HINT)
    #: a shared input whose output reaches the batch through a chain of ops: its consumers
    consumers: tuple | None = None  # of consumers.Consumer
    #: a shared input whose output reaches no gradient (only ``.detach()``ed, DoRA's weight norm):
    #: the call runs as plain PyTorch, and a gradient reaching its parameters anyway is refused as stray
    dead: bool = False

    def fits(self, leaves: list[Tensor], batch: int, ragged: frozenset[int] = frozenset()) -> bool:
        """Every tensor still fits its layout, except the ``ragged`` ones (indices the rule
        splits into samples itself: :meth:`~dpclip.engine.layers.LayerRule.ragged_inputs`)."""
        if self.inputs is None:
            return True
        return len(leaves) == len(self.inputs) and all(
            i in ragged or lay.fits(t, batch) for i, (lay, t) in enumerate(zip(self.inputs, leaves)))

    def input(self, i: int, t: Tensor) -> Layout:
        return Layout(t.dim(), 0) if self.inputs is None else self.inputs[i]


#: a rule's own call of a child module (MultiheadAttention's out_proj): batch first by construction
BATCH_FIRST = CallLayout(None)


def expand_shared(t: Tensor, lead1: bool, batch: int) -> Tensor:
    """A shared tensor over the batch: its leading 1 expanded, or a batch axis prepended."""
    return t.expand(batch, *t.shape[1:]) if lead1 else t.expand(batch, *t.shape)


def shared_lead1(lay: Layout, t: Tensor, feature_dims: int | None) -> bool:
    """Expand the leading 1 (GPT-2's [1, T] positions) unless it is a feature axis."""
    return lay.lead1 and t.dim() > (feature_dims or 0)


def same_batch(y: Tensor) -> Tensor:
    return y


def to_batch_first(t: Tensor, lay: Layout, batch: int, feature_dims: int | None,
                   label: str) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``t`` with the batch in dim 0, and the map that puts the output back in ``t``'s layout.

    ``feature_dims``: None for a rule that needs the batch in dim 0 itself; an int f for a
    position-wise rule (each position of the leading dims independent, f trailing feature
    axes), which may have the batch moved to the front from any leading axis or unflattened
    from a merged batch·position axis."""
    if lay.error is not None:
        raise EngineError(f"module {label}: the batch axis of its input of shape "
                          f"{tuple(t.shape)} cannot be established: {lay.error}", lay.hint)
    k = lay.dim
    if k == 0 and not lay.merged:
        return t, same_batch
    if k is None:
        return expand_shared(t, shared_lead1(lay, t, feature_dims), batch), same_batch
    if feature_dims is None or k >= t.dim() - feature_dims:
        kind = "merged with positions " if lay.merged else ""
        raise EngineError(
            f"module {label} gets the batch {kind}in axis {k} of its input of shape "
            f"{tuple(t.shape)}; its rule needs the batch in axis 0",
            "put the batch first for this module (e.g. batch_first=True), or register a rule "
            "that accepts this layout")
    if lay.merged and lay.outer > 1:   # rows [block 0 of every sample, block 1 of every sample, ...]
        o = lay.outer
        # contiguous: a strided bf16 matmul may accumulate otherwise than the module's own
        return (t.unflatten(k, (o, batch, -1)).movedim(k + 1, 0).flatten(k + 1, k + 2).contiguous(),
                lambda y: y.unflatten(k + 1, (o, -1)).movedim(0, k + 1).flatten(k, k + 2))
    if lay.merged:
        return (t.unflatten(k, (batch, -1)).movedim(k, 0),
                lambda y: y.movedim(0, k).flatten(k, k + 1))
    return t.movedim(k, 0), lambda y: y.movedim(0, k)


def check_batch(label: str, forward_batch: int, batch: int) -> None:
    """The per-sample losses of engine.backward must be the forward's batch."""
    if forward_batch != batch:
        raise EngineError(
            f"the forward that called module {label} had a batch of {forward_batch} samples "
            f"(leading dimension {forward_batch} of the model's first tensor input), but "
            f"engine.backward got {batch} per-sample losses",
            "pass the model's inputs with the batch in dim 0 (batch_first=True) and give one "
            "loss per sample (reduction='none')")


def cut_batch_refusal(args: tuple, kwargs: dict, batch: int, sizes: tuple[int, int], exc: Exception) -> EngineError:
    """The refusal of a forward that fails on ``sizes`` of its ``batch`` samples (``exc``), naming
    the tensor inputs that have no dim 0 of size ``batch`` (the probes passed them whole)."""
    message = (f"the model's forward fails when the engine probes it with {sizes[0]} and {sizes[1]} of its "
               f"{batch} samples ({type(exc).__name__}: {exc}), so the batch axis of its layers cannot be established")
    named = [(f"input {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    whole = [f"{name} {tuple(t.shape)}" for name, value in named for t in tree_flatten(value)[0]
             if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] != batch]
    if not whole:
        return EngineError(message, CUT_BATCH_HINT)
    return EngineError(f"{message}; inputs whose dim 0 is not the batch size {batch} went to the probes whole: "
                       f"{', '.join(whole)}", PACKED_HINT)


def unprobed_call_refusal(unit, n: int, leaves: list[Tensor]) -> EngineError:
    """The refusal of call #``n + 1`` of ``unit`` that no probe forward laid out alike. When the unit
    is a whole module book-kept per sample (torch.func) only because it holds trainable parameters
    directly beside its layers (wav2vec2 / UniSpeech's ``masked_spec_embed``, used by SpecAugment
    only), it names them: frozen, the layers inside are book-kept one by one."""
    message = (f"module {unit.label}: its call #{n + 1} in this forward (inputs of shapes "
               f"{[tuple(t.shape) for t in leaves]}) does not match the probe forwards of the model, so its batch "
               "axis cannot be established (does the model's control flow depend on the batch size, or are its "
               "shared inputs not broadcast-compatible?)")
    own = [name for name, _, _ in unit.params]
    if not (unit.is_fallback and own and any(True for _ in unit.module.children())):
        return EngineError(message, BATCH_HINT)
    where = f"{unit.name}." if unit.name else ""
    return EngineError(
        f"{message}; it is book-kept whole, per sample (torch.func), only because it holds the trainable "
        f"parameter(s) {', '.join(own)} directly beside its layers",
        f"if {', '.join(own)} is not trained by this forward (wav2vec2 / UniSpeech's masked_spec_embed is used only "
        "by SpecAugment, mask_time_prob > 0, which draws its masks outside torch), freeze it: "
        + " and ".join(f"`model.{where}{name}.requires_grad_(False)`" for name in own)
        + " (its layers are then book-kept one by one); otherwise " + BATCH_HINT)


def shared_output_refusal(why: str, returned: list[str], unit_name: str) -> dict:
    """The refusal (and hint) of a call whose shared output reaches the batch in a way the engine
    cannot follow (``why``): a shared input's output, or, when the module returns parameters of its
    own unchanged (``returned``: GPT-NeoX-Japanese's attention returns ``dense_bias``, which the
    layer expands after the residual), those parameters, named with the fix."""
    if not returned:
        return {"refusal": f"is fed a tensor shared by all samples, and {why}"}
    names = ", ".join(returned)
    where = f"{unit_name}." if unit_name else ""
    return {"refusal": f"returns its own parameter(s) {names} unchanged (shared by all samples), and {why}",
            "hint": f"add {names} to the output inside the module's forward (x + self.{returned[0]}) rather than "
                    f"returning it for the caller to broadcast, or freeze it: "
                    + " and ".join(f"`model.{where}{n}.requires_grad_(False)`" for n in returned)}
