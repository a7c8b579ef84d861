"""Which axis of each captured tensor is the batch: established by observation, never by a size.

The engine's one contract on the model's inputs: the batch size B of a forward is dim 0 of
the model's first tensor input. Inside the model, a layer's input may hold the batch in
any axis ([T, B, d] sequence-first), merged with positions ([B·T, d], OPT's MLP), or not at
all (positions ``arange(T)`` shared by every sample, a learned query): a size equal to B
proves nothing (T == B), so the engine *probes* instead (docs/engine.md, "The batch axis").

**Probe.** The first time the model runs under the engine, and whenever a later call of a
book-kept module no longer fits what was established, the model's forward runs twice more
with the book-keeping off and the RNG state forked and restored: on the first two samples
of the batch and on three (row 0 repeated where B < 3; one and two samples where B = 1; the
model's tensor inputs of leading size B are resized, or, should that fail, the first one
alone). Each call of each book-kept module (in call order) records the shapes of the
tensors it receives and returns. Per tensor, comparing the two probes (p = 2 -> p' = 3):

- one axis whose size went p -> p': the batch axis;
- one axis whose size went c·p -> c·p' (c ≥ 2): the batch merged with c positions; accepted
  when the second probe's rows are those of a batch-outer [p, c] ordering (compared by a
  random projection of each row), and unflattened to [B, c, ...] by position-wise rules;
- no axis moved: shared by every sample (:attr:`Layout.dim` None);
- anything else (several axes moving, an axis moving out of proportion, a change of rank):
  an error, raised when a rule needs that tensor.

A shared input of a layer (GPT-2's position ids [1, T], nanoGPT's ``arange(T)``) has its
output expanded over the batch so that its output gradient stays per-sample. That is exact
only if every op consuming the expanded output would have broadcast it over the batch
anyway; a second pair of probes runs the forward with those outputs expanded and checks
each consumer (:class:`ConsumerCheck`). Where one is not such a broadcast (``lin(q)[0]``,
T5's ``permute`` of its relative position bias), the call is refused before any noise.

The answers are cached per (module, call ordinal within the forward), so a probe runs once,
not per step; each later call only checks that its tensors still fit (same rank, the batch
axis of size B).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpclip.errors import EngineError

BATCH_HINT = ("pass the model's inputs with the batch in dim 0 (its first tensor input sets the "
              "batch size) and build shared tensors (positions, masks) inside the forward "
              "or with a leading dimension 1")
BROADCAST_HINT = ("give the module a per-sample input (e.g. pass positions as [B, T]: "
                  "ids.new_tensor(range(T)).expand(B, T)), or freeze the module")


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
    merged: bool = False      # ``dim`` holds the batch merged with positions, batch outer
    lead1: bool = False       # shared, with size 1 in dim 0 (expanded there)
    error: str | None = None  # why no batch axis could be established

    def fits(self, t: Tensor, batch: int) -> bool:
        if t.dim() != self.ndim:
            return False
        if self.dim is None:
            return self.ndim == 0 or (t.shape[0] == 1) == self.lead1
        size = t.shape[self.dim]
        return size > 0 and size % batch == 0 if self.merged else size == batch


@dataclass(frozen=True)
class CallLayout:
    """The layouts of one call of a book-kept module (its tensors in tree order)."""

    inputs: tuple[Layout, ...] | None           # None: the batch in dim 0 of every tensor
    outputs: tuple[Layout, ...] | None = None
    refusal: str | None = None                  # why the call cannot be book-kept exactly
    #: a shared input whose output reaches the batch through a chain of ops: its consumers
    consumers: tuple["Consumer", ...] | None = None

    def fits(self, leaves: list[Tensor], batch: int) -> bool:
        if self.inputs is None:
            return True
        return len(leaves) == len(self.inputs) and all(
            lay.fits(t, batch) for lay, t in zip(self.inputs, leaves))

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


def _same(y: Tensor) -> Tensor:
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
                          f"{tuple(t.shape)} cannot be established: {lay.error}", BATCH_HINT)
    k = lay.dim
    if k == 0 and not lay.merged:
        return t, _same
    if k is None:
        return expand_shared(t, shared_lead1(lay, t, feature_dims), batch), _same
    if feature_dims is None or k >= t.dim() - feature_dims:
        kind = "merged with positions " if lay.merged else ""
        raise EngineError(
            f"module {label} gets the batch {kind}in axis {k} of its input of shape "
            f"{tuple(t.shape)}; its rule needs the batch in axis 0",
            "put the batch first for this module (e.g. batch_first=True), or register a rule "
            "that accepts this layout")
    if lay.merged:
        return (t.unflatten(k, (batch, -1)).movedim(k, 0),
                lambda y: y.movedim(0, k).flatten(k, k + 1))
    return t.movedim(k, 0), lambda y: y.movedim(0, k)


# ----------------------------------------------------------------------- probing


@dataclass
class _Seen:
    shape: tuple[int, ...]
    sums: dict[int, Tensor]   # per-row fingerprints along each axis of size c·batch, c ≥ 2


def _fingerprint(t: Tensor, k: int) -> Tensor:
    """One number per row of axis ``k``: a fixed random projection of the row (plain sums
    vanish on normalised rows)."""
    flat = t.detach().movedim(k, 0).reshape(t.shape[k], -1).to(torch.float64)
    weights = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(20250),
                          dtype=torch.float64).to(flat.device)
    return (flat @ weights).cpu()


def _seen(t: Tensor, batch: int, rows: bool = True) -> _Seen:
    sums = {}
    for k, size in enumerate(t.shape):
        if rows and size > batch and size % batch == 0:
            try:
                with torch.no_grad():
                    sums[k] = _fingerprint(t, k)
            except (RuntimeError, TypeError):  # a dtype with no float64 view: not comparable
                pass
    return _Seen(tuple(t.shape), sums)


class Probe:
    """One probing forward: per (unit, call ordinal), what each call received and returned.

    ``expand`` (key -> function of (args, kwargs, orig) returning the output) replaces a
    call's output by its batch-expanded version, as the engine will (consumer probes)."""

    def __init__(self, batch: int, expand: dict | None = None, check: "ConsumerCheck | None" = None):
        self.batch = batch
        self.expand = expand or {}
        self.check = check
        self.ordinals: dict[int, int] = {}
        self.calls: dict[tuple[int, int], tuple[list[_Seen], list[_Seen]]] = {}

    def call(self, unit, orig: Callable, args: tuple, kwargs: dict):
        n = self.ordinals.get(id(unit), 0)
        self.ordinals[id(unit)] = n + 1
        key = (id(unit), n)
        if self.check is not None:   # consumer probe: the checks, not the shapes, are wanted
            expander = self.expand.get(key)
            return orig(*args, **kwargs) if expander is None else expander(args, kwargs, orig)
        ins = [_seen(t, self.batch) for t in call_leaves(args, kwargs)]
        out = orig(*args, **kwargs)
        # merged batch·position axes are accepted in inputs only: outputs need no fingerprints
        self.calls[key] = (ins, [_seen(t, self.batch, rows=False) for t in tensor_leaves(out)])
        return out


def _close(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return False
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * max(scale, 1.0)))


def _same_samples(a: Tensor, b: Tensor, batch: int, new: int, c: int, outer: bool) -> bool:
    """Whether per-row fingerprints ``a`` (``batch`` samples) and ``b`` (``new`` samples, the
    same first ones) agree on their common samples, read as a [B, c] (outer) or [c, B] order."""
    va = a.view(batch, c) if outer else a.view(c, batch).t()
    vb = b.view(new, c) if outer else b.view(c, new).t()
    m = min(batch, new)
    return _close(va[:m].contiguous(), vb[:m].contiguous())


def _layout(x: _Seen, y: _Seen, batch: int, new: int) -> Layout:
    n = len(x.shape)
    if len(y.shape) != n:
        return Layout(n, error=f"its rank changes with the batch size ({x.shape} with {batch} "
                               f"samples, {y.shape} with {new})")
    moved = [k for k in range(n) if x.shape[k] != y.shape[k]]
    if not moved:
        return Layout(n, lead1=n >= 1 and x.shape[0] == 1)
    if len(moved) > 1:
        return Layout(n, error=f"axes {moved} all change with the batch size ({x.shape} with "
                               f"{batch} samples, {y.shape} with {new}): it mixes samples")
    k = moved[0]
    if x.shape[k] == batch and y.shape[k] == new:
        return Layout(n, k)
    c = x.shape[k] // batch
    if x.shape[k] % batch == 0 and c >= 2 and y.shape[k] == c * new:
        a, b = x.sums.get(k), y.sums.get(k)
        if (a is not None and b is not None and _same_samples(a, b, batch, new, c, True)
                and not _same_samples(a, b, batch, new, c, False)):
            return Layout(n, k, merged=True)
        return Layout(n, error=f"axis {k} holds the batch merged with {c} positions, but not "
                               "batch-outer ([B, T] flattened) as far as the probe can tell")
    return Layout(n, error=f"axis {k} changes with the batch size out of proportion "
                           f"({x.shape[k]} with {batch} samples, {y.shape[k]} with {new})")


def compare(a: Probe, b: Probe) -> dict[tuple[int, int], CallLayout]:
    """Layouts of the calls both probes made alike (same number of tensors in and out)."""
    out = {}
    for key, (ins, outs) in a.calls.items():
        got = b.calls.get(key)
        if got is None or len(got[0]) != len(ins) or len(got[1]) != len(outs):
            continue
        out[key] = CallLayout(
            tuple(_layout(x, y, a.batch, b.batch) for x, y in zip(ins, got[0])),
            tuple(_layout(x, y, a.batch, b.batch) for x, y in zip(outs, got[1])))
    return out


def resized(args: tuple, kwargs: dict, batch: int, new: int, first_only: bool):
    """The model's inputs with the batch resized to ``new`` rows (detached)."""
    leaves, spec = tree_flatten((args, kwargs))
    seen_first = False
    out = []
    for t in leaves:
        if isinstance(t, Tensor):
            t = t.detach()
            if (not (first_only and seen_first)) and t.dim() >= 1 and t.shape[0] == batch:
                t = t[:new] if new <= batch else torch.cat([t, t[:new - batch]])
            seen_first = True
        out.append(t)
    return tree_unflatten(out, spec)


@contextmanager
def forked_rng(devices: list) -> Iterator[None]:
    """The probes draw nothing from the caller's RNG streams (dropout in the model)."""
    with torch.random.fork_rng(devices=devices):
        yield


# -------------------------------------------------------------- consumer check

_BROADCASTING = {
    "add", "sub", "mul", "div", "true_divide", "subtract", "multiply", "divide", "where",
    "maximum", "minimum", "addcmul", "addcdiv", "masked_fill", "lerp", "pow",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
    "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__pow__",
    "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_",
}
_MATMUL = {"matmul", "__matmul__", "__rmatmul__"}
#: consumers that broadcast with no other tensor: the batch comes from their sizes
_EXPANDS = {"expand", "broadcast_to"}
_SDPA = "scaled_dot_product_attention"   # a consumer when the tensor is its attn_mask
_EVENTS = _BROADCASTING | _MATMUL | _EXPANDS | {_SDPA}
#: ops that keep a shared tensor shared (no other tensor involved): the chain before a broadcast
_CHAIN = {
    "to", "contiguous", "clone", "float", "double", "half", "bfloat16", "detach", "permute",
    "unsqueeze", "squeeze", "transpose", "t", "view", "reshape", "flatten", "unflatten",
    "movedim", "narrow", "select", "__getitem__", "neg", "__neg__", "tanh", "sigmoid", "exp",
} | _BROADCASTING
_SHAPE_READS = {"shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "__len__",
                "stride", "__iter__", "unbind", "tolist", "item"}


def _name(func) -> str:
    name = getattr(func, "__name__", "") or repr(func)
    if name == "__get__":   # a property getter: name the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


@dataclass(frozen=True)
class Consumer:
    """An op that combines a shared output (after its chain of ops) with other tensors: it
    broadcasts it over the batch, or (``result_batch`` None) the others are shared too and
    the result is one more link of the chain (T5's ``where(causal_mask, bias, min)``)."""

    name: str
    result_batch: int | None   # the batch axis of the op's result
    aligned: int = 0           # the axis of the chained tensor facing it (< 0: none, prepended)


def _sdpa_shape(args: tuple, kwargs: dict, t: Tensor) -> tuple | None:
    """The [..., L, S] scores that sdpa broadcasts its ``attn_mask`` ``t`` to (None: ``t``
    is not the mask)."""
    q = args[0] if args else kwargs.get("query")
    k = args[1] if len(args) > 1 else kwargs.get("key")
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if mask is not t or not isinstance(q, Tensor) or not isinstance(k, Tensor):
        return None
    return (*q.shape[:-1], k.shape[-2])


class ConsumerCheck(TorchFunctionMode):
    """During a consumer probe: follows each tracked output (a layer's output shared by all
    samples) through the ops that keep it shared (its *chain*: views, ``.to()``, elementwise
    ops with constants) to the ops that combine it with other tensors (*consumers*), which
    must broadcast it (elementwise ops, matmul); anything else is a failure."""

    def __init__(self, links: set | frozenset = frozenset()):
        super().__init__()
        self.tracked: dict[int, tuple[Tensor, tuple, int]] = {}   # id -> (tensor, key, chain length)
        self.events: dict[tuple, list[tuple[str, tuple, tuple, int]]] = {}
        self.failures: dict[tuple, str] = {}
        self.shape_read: set[tuple] = set()
        self.links = links    # (key, event index): events whose result stays shared (a link)

    def track(self, t: Tensor, key: tuple, chain: int = 0) -> None:
        self.tracked[id(t)] = (t, key, chain)
        self.events.setdefault(key, [])

    def _hit(self, t) -> tuple | None:
        entry = self.tracked.get(id(t)) if isinstance(t, Tensor) else None
        return entry if entry is not None and entry[0] is t else None

    def fail(self, key: tuple, why: str) -> None:
        self.failures.setdefault(key, why)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.tracked:
                for hit in filter(None, map(self._hit, tree_flatten((args, kwargs))[0])):
                    self.fail(hit[1], f"`{_name(func)}` fails on its output")
            raise
        if self.tracked:
            flat = tree_flatten((args, kwargs))[0]
            hits = [h for h in map(self._hit, flat) if h is not None]
            if hits:
                self._check(func, args, kwargs, flat, hits, out)
        return out

    def _check(self, func, args: tuple, kwargs: dict, flat: list, hits: list, out) -> None:
        name, key = _name(func), hits[0][1]
        if self._hit(out) is not None:          # returned itself (.to() on its own device)
            return
        if not isinstance(out, Tensor):
            if name in _SHAPE_READS:
                self.shape_read.add(key)
            if isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out):
                self.fail(key, f"its output is split by `{name}`")
            return
        others = [t for t in flat if isinstance(t, Tensor) and self._hit(t) is None]
        if len(hits) > 1:
            self.fail(key, f"its output meets another shared tensor in `{name}`")
        elif not others and name in _CHAIN:
            self.track(out, key, hits[0][2] + 1)
        elif name in _EVENTS:
            result = tuple(out.shape)
            if name == _SDPA:
                result = _sdpa_shape(args, kwargs, hits[0][0])
                if result is None:
                    self.fail(key, "its output is a query, key or value of attention")
                    return
            events = self.events[key]
            if (key, len(events)) in self.links:     # the others are shared too: still shared
                self.track(out, key, hits[0][2] + 1)
            events.append((name, result, tuple(hits[0][0].shape), hits[0][2]))
        else:
            self.fail(key, f"its output is consumed by `{name}`, which is not a broadcast over "
                           "the batch")


def consumers(a: ConsumerCheck, b: ConsumerCheck, key: tuple, batch: int, new: int,
              simple_aligned: int):
    """From the consumer probes with ``batch`` and ``new`` samples: (the events, whether
    expanding the layer's output itself is exact, why not exact at all, the indices of events
    whose result did not move: links whose results the next probes must follow)."""
    why = a.failures.get(key) or b.failures.get(key)
    if why is not None:
        return None, False, why, set()
    ea, eb = a.events.get(key, []), b.events.get(key, [])
    if [e[0] for e in ea] != [e[0] for e in eb]:
        return None, False, "its consumers differ with the batch size", set()
    out, simple, unfollowed = [], key not in a.shape_read and key not in b.shape_read, set()
    for i, ((name, res_a, shape, chain), (_, res_b, _, _)) in enumerate(zip(ea, eb)):
        if res_a == res_b and name not in _EXPANDS:    # all operands shared: a link
            out.append(Consumer(name, None))
            simple = False
            if (key, i) not in a.links:
                unfollowed.add(i)
            continue
        moved = [k for k in range(len(res_a)) if len(res_a) == len(res_b) and res_a[k] != res_b[k]]
        if len(moved) != 1 or res_a[moved[0]] != batch or res_b[moved[0]] != new:
            return None, False, f"`{name}` does not broadcast its output over the batch", set()
        r = moved[0]
        j = r - (len(res_a) - len(shape))
        matrix = name in _MATMUL or name == _SDPA
        if (j >= 0 and shape[j] != 1) or (matrix and (len(shape) < 2 or r >= len(res_a) - 2)):
            return None, False, f"`{name}` does not broadcast its output over the batch", set()
        out.append(Consumer(name, r, j))
        simple = simple and chain == 0 and j == simple_aligned and not matrix
    return tuple(out), simple, None, unfollowed


# ------------------------------------------------------------- chained outputs


class _Chained(Tensor):
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
    def wrap(value: Tensor, state: "ChainState", chain: tuple = ()) -> "_Chained":
        t = value.as_subclass(_Chained)
        t._dp_state, t._dp_chain = state, chain
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        mine = [i for i, t in enumerate(flat) if isinstance(t, _Chained)]
        name = _name(func)
        with torch._C.DisableTorchFunctionSubclass():
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

            if not others and name in _CHAIN:   # still shared: one more link of the chain
                out = func(*args, **kwargs)
                if out is me or not isinstance(out, Tensor):
                    return out
                return _Chained.wrap(out, state, me._dp_chain + (link,))
            if name not in _EVENTS:
                out = func(*args, **kwargs)
                if isinstance(out, Tensor) and out is not me:
                    raise EngineError(f"module {state.label}: its output is consumed by `{name}`, "
                                      "which the probe forwards did not see", BROADCAST_HINT)
                return out                      # a metadata read (the unexpanded shape)
            event = state.next_event(name)
            if event.result_batch is None:      # the other operands are shared too: a link
                return _Chained.wrap(func(*args, **kwargs), state, me._dp_chain + (link,))
            # a consumer: the chained output with the batch where the probe found it
            leaves = list(flat)
            leaves[i] = state.batched(me._dp_chain, tuple(me.shape), event)
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
        if j >= 0:
            return per_sample.movedim(0, j).squeeze(j + 1)
        return per_sample.reshape(self.batch, *([1] * (-j - 1)), *shape)


# ------------------------------------------------------------------ the state


class BatchAxes:
    """The batch of the model's forward in progress and the established layouts.

    ``units``: the book-kept units (``module``, ``rule``, ``label``); ``plain()``: a context
    in which their forwards pass through (the probes run in it)."""

    def __init__(self, model: torch.nn.Module, units: list, plain: Callable):
        self.model = model
        self.units = {id(u): u for u in units}
        self.plain = plain
        self.layouts: dict[tuple[int, int], CallLayout] = {}
        self.probe: Probe | None = None     # while probing: the forwards only record
        self.batch: int | None = None       # B of the model's forward in progress
        self.inputs: tuple | None = None    # that forward's (args, kwargs), for the probes
        self.ordinals: dict[int, int] = {}
        self.depth = 0                      # model forwards in progress
        self.children = 0                   # inside a rule that calls children batch first
        self.reprobed = False
        self.probes = 0                     # probing forwards run so far (tests, docs)

    # ---------------------------------------------------------------- hooks

    def pre_hook(self, module, args, kwargs):
        if self.probe is not None:
            return None
        self.depth += 1
        if self.depth == 1:
            leaves = tensor_leaves((args, kwargs))
            self.batch = leaves[0].shape[0] if leaves and leaves[0].dim() > 0 else None
            self.inputs = (args, kwargs)
            self.ordinals = {}
            self.reprobed = False
        return None

    def post_hook(self, module, args, kwargs, output):
        if self.probe is not None:
            return None
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.inputs = None
        return None

    @contextmanager
    def children_batch_first(self) -> Iterator[None]:
        self.children += 1
        try:
            yield
        finally:
            self.children -= 1

    # ------------------------------------------------------------- per call

    def layout(self, unit, leaves: list[Tensor]) -> CallLayout:
        """The established layout of this call of ``unit`` (probing first if needed)."""
        if self.children:
            return BATCH_FIRST
        if self.depth == 0 or self.batch is None:
            raise EngineError(
                f"module {unit.label} was called outside a forward of the model the engine "
                f"was built on ({type(self.model).__name__}), or that model's first tensor "
                "input has no batch dimension; its batch axis cannot be established",
                "call the model itself with the batch in dim 0 of its first tensor input")
        n = self.ordinals.get(id(unit), 0)
        self.ordinals[id(unit)] = n + 1
        key = (id(unit), n)
        lay = self.layouts.get(key)
        if lay is None or not lay.fits(leaves, self.batch):
            if not self.reprobed:
                self.establish()
                lay = self.layouts.get(key)
            if lay is None or not lay.fits(leaves, self.batch):
                shapes = [tuple(t.shape) for t in leaves]
                raise EngineError(
                    f"module {unit.label}: its call #{n + 1} in this forward (inputs of shapes "
                    f"{shapes}) does not match the probe forwards of the model, so its batch "
                    "axis cannot be established (does the model's control flow depend on "
                    "the batch size, or are its shared inputs not broadcast-compatible?)",
                    BATCH_HINT)
        return lay

    # --------------------------------------------------------------- probes

    def _run(self, probe: Probe, args: tuple, kwargs: dict, check: ConsumerCheck | None = None):
        devices = sorted({p.device.index or 0 for p in self.model.parameters()
                          if p.device.type == "cuda"})
        self.probe = probe
        self.probes += 1
        try:
            with self.plain(), forked_rng(devices):
                if check is None:
                    return self.model(*args, **kwargs)
                with check:
                    out = self.model(*args, **kwargs)
                for t in tensor_leaves(out):
                    hit = check._hit(t)
                    if hit is not None:
                        check.fail(hit[1], "it is returned by the model unchanged")
                return out
        finally:
            self.probe = None

    def establish(self) -> None:
        """Probe the model's forward in progress and merge the layouts found into the cache.

        The probes run on the first two samples and on three (row 0 repeated if B < 3; one
        and two samples if B = 1): cheap whatever B is, and what they establish is the
        structure (which axis), checked against B at every call."""
        self.reprobed = True
        args, kwargs = self.inputs
        batch = self.batch
        sizes = (1, 2) if batch == 1 else (2, 3)
        errors = []
        for first_only in (False, True):    # every input of leading size B, or the first only
            inputs = [resized(args, kwargs, batch, size, first_only) for size in sizes]
            try:
                probes = [Probe(size) for size in sizes]
                for probe, (a, k) in zip(probes, inputs):
                    self._run(probe, a, k)
                break
            except EngineError:
                raise
            except Exception as exc:  # the resized inputs do not fit the model: try the next
                errors.append(exc)
        else:
            raise EngineError(
                f"the model's forward fails when the engine probes it with {sizes[0]} and "
                f"{sizes[1]} of its {batch} samples ({type(errors[-1]).__name__}: {errors[-1]}), "
                "so the batch axis of its layers cannot be established", BATCH_HINT) from errors[-1]
        layouts = compare(*probes)
        expand = self._expanders(layouts)
        if expand:
            self._check_consumers(layouts, expand, sizes, inputs)
        self.layouts.update(layouts)

    def _check_consumers(self, layouts, expand, sizes, inputs) -> None:
        """More probes follow each shared output to its consumers: expanding the output
        itself is exact (GPT-2's positions), or expanding it at its consumers after its
        chain of ops (T5's bias, layers with the default call only), or it is refused. An
        op whose operands are all shared (a shared mask) continues the chain: the next pair
        of probes follows its result too (at most three pairs)."""
        links: set = set()
        for _ in range(3):
            checks, aligned = [], {}
            for size, (args, kwargs) in zip(sizes, inputs):
                check = ConsumerCheck(frozenset(links))
                try:
                    self._run(Probe(size, {k: self._tracker(k, f, check, aligned)
                                           for k, f in expand.items()}, check), args, kwargs,
                              check=check)
                except Exception as exc:  # the forward failed in a consumer (or elsewhere)
                    if not check.failures:
                        for key, (kind, which) in expand.items():
                            check.fail((key, (which or [0])[0]), "the model's forward fails in "
                                       f"the consumer probe ({type(exc).__name__}: {exc})")
                checks.append(check)
            verdicts, more = {}, set()
            for key, (kind, which) in expand.items():
                for j in which or [0]:
                    if (key, j) in aligned:    # a non-float output: no gradient to keep apart
                        verdict = consumers(checks[0], checks[1], (key, j), *sizes, aligned[(key, j)])
                        verdicts[(key, j)] = verdict
                        more |= {((key, j), i) for i in verdict[3]}
            if not more:
                break
            links |= more
        for key, (kind, which) in expand.items():
            found, why, simple = [], None, True
            for j in which or [0]:
                if (key, j) not in verdicts:
                    continue
                cons, ok, why, unfollowed = verdicts[(key, j)]
                if why is None and unfollowed:
                    why = "its output meets shared tensors through more ops than the probes follow"
                if why is not None:
                    break
                found.append(cons)
                simple = simple and ok
            lay = layouts[key]
            if why is None and not simple and kind == "outputs":
                why = ("its output is broadcast over the batch only after other ops, which the "
                       "per-sample fallback cannot follow")
            if why is not None:
                layouts[key] = replace(lay, refusal=f"is fed a tensor shared by all samples, and {why}")
            elif not simple:
                layouts[key] = replace(lay, consumers=found[0])

    def _expanders(self, layouts: dict) -> dict:
        """Calls whose output the engine expands over the batch: key -> which outputs."""
        out = {}
        for key, lay in layouts.items():
            unit = self.units.get(key[0])
            if unit is None or lay.refusal is not None:
                continue
            rule = unit.rule
            if getattr(rule, "expands_shared_outputs", False):   # the torch.func rule
                which = [i for i, o in enumerate(lay.outputs) if o.dim is None and o.error is None]
                if which:
                    out[key] = ("outputs", which)
            elif getattr(rule, "default_call", False) and lay.inputs and lay.inputs[0].dim is None \
                    and lay.inputs[0].error is None:
                out[key] = ("input", None)
        return out

    def _tracker(self, key, how, check: ConsumerCheck, aligned: dict):
        """The call of ``key`` in a consumer probe: its shared output(s) tracked; ``aligned``
        gets the axis that expanding the output itself would give the batch (0: its leading
        1; -1: prepended)."""
        unit = self.units[key[0]]

        def run(args, kwargs, orig):
            kind, which = how
            out = orig(*args, **kwargs)
            if kind == "input":
                x = call_leaves(args, kwargs)[0]
                lead1 = shared_lead1(Layout(x.dim(), lead1=x.dim() >= 1 and x.shape[0] == 1), x,
                                     unit.rule.feature_dims(unit.module))
                aligned[(key, 0)] = 0 if lead1 else -1
                check.track(out, (key, 0))
                return out
            leaves = tensor_leaves(out)
            for j in which:
                t = leaves[j]
                if t.is_floating_point():
                    aligned[(key, j)] = 0 if t.dim() >= 1 and t.shape[0] == 1 else -1
                    check.track(t, (key, j))
            return out

        return run
