"""Following a layer output shared by all samples to the ops that broadcast it over the batch.

A layer fed a shared input (GPT-2's position ids [1, T], nanoGPT's ``arange(T)``, T5's
relative-position buckets) has its output gradient summed over the samples by the
broadcast that follows, unless the engine keeps samples apart. During a consumer probe,
:class:`ConsumerCheck` follows each such output through the ops that keep it shared (its
*chain*) to the ops that combine it with other tensors (*consumers*); comparing two probes
establishes each consumer result's batch axis (:func:`consumers`). A consumer that is not a
broadcast over the batch makes the engine refuse the module.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from dpclip.torch_compat import tree_flatten


_BROADCASTING = {
    "add", "sub", "mul", "div", "true_divide", "subtract", "multiply", "divide", "where",
    "maximum", "minimum", "addcmul", "addcdiv", "masked_fill", "lerp", "pow",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
    "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__pow__",
    "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_",
}
_MATMUL = {"matmul", "__matmul__", "__rmatmul__"}
#: consumers that broadcast with no other tensor: the batch comes from their sizes (``repeat``
#: where it equals ``expand``, factors above 1 on axes of size 1 (peft's prompts), or tiles one
#: axis of size s by the batch: B·s rows, batch-outer (DeBERTa-v2's [H, 2k, d] table over B·H));
#: ``expand_as(x)`` is ``expand(x.shape)`` (XLM's positions, GPT-NeoX-Japanese's attention bias)
_EXPANDS = {"expand", "expand_as", "broadcast_to", "repeat"}
_SDPA = "scaled_dot_product_attention"   # a consumer when the tensor is its attn_mask
EVENTS = _BROADCASTING | _MATMUL | _EXPANDS | {_SDPA}
#: ops that keep a shared tensor shared (no other tensor involved): the chain before a broadcast
CHAIN = {
    "to", "contiguous", "clone", "float", "double", "half", "bfloat16", "detach", "permute",
    "unsqueeze", "squeeze", "transpose", "t", "view", "reshape", "flatten", "unflatten",
    "movedim", "narrow", "select", "__getitem__", "neg", "__neg__", "tanh", "sigmoid", "exp", "T", "mT",
} | _BROADCASTING
_DETACH = {"detach", "detach_"}
_SHAPE_READS = {"shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "__len__",
                "stride", "__iter__", "unbind", "tolist", "item"}


def func_name(func) -> str:
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
    rows: int = 1              # c ≥ 2: that axis holds the batch merged with c positions (Swin's B·nW windows)


def _sdpa_shape(args: tuple, kwargs: dict, t: Tensor) -> tuple | None:
    """The [..., L, S] scores that sdpa broadcasts its ``attn_mask`` ``t`` to (None: ``t``
    is not the mask)."""
    q = args[0] if args else kwargs.get("query")
    k = args[1] if len(args) > 1 else kwargs.get("key")
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if mask is not t or not isinstance(q, Tensor) or not isinstance(k, Tensor):
        return None
    return (*q.shape[:-1], k.shape[-2])


def repeat_factors(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The factors of a ``t.repeat(...)`` call (``repeat(B, 1, 1)`` or ``repeat((B, 1, 1))``)."""
    factors = args[1:] if len(args) > 1 else kwargs.get("repeats", ())
    if len(factors) == 1 and isinstance(factors[0], (tuple, list, torch.Size)):
        factors = tuple(factors[0])
    return tuple(int(f) for f in factors)


def _repeat_broadcasts(args: tuple, kwargs: dict, t: Tensor) -> bool:
    """``t.repeat(*factors)`` is an ``expand`` of its result's shape (every factor above 1 on an
    axis of size 1 or a new leading axis) but for at most one axis of size above 1 it tiles
    (whether by the batch, the probes tell)."""
    factors = repeat_factors(args, kwargs)
    sizes = (1,) * (len(factors) - t.dim()) + tuple(t.shape)
    return len(factors) >= t.dim() and sum(f != 1 and s != 1 for f, s in zip(factors, sizes)) <= 1


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
        self.dead: set[tuple] = set()          # keys whose output (or a chain of it) was detached
        self.feeds: dict[tuple, set] = {}      # key -> keys of the layers its output is the input of

    def track(self, t: Tensor, key: tuple, chain: int = 0) -> None:
        self.tracked[id(t)] = (t, key, chain)
        self.events.setdefault(key, [])

    def hit(self, t) -> tuple | None:
        """``(tensor, key, chain length)`` if ``t`` itself is tracked, else None."""
        entry = self.tracked.get(id(t)) if isinstance(t, Tensor) else None
        return entry if entry is not None and entry[0] is t else None

    def fail(self, key: tuple, why: str) -> None:
        self.failures.setdefault(key, why)

    def feeding(self, x, key: tuple):
        """``x`` is the input of the layer call ``key`` (itself followed): if it is a followed
        output, record that it feeds ``key`` and stop following it inside that call."""
        hit = self.hit(x)
        if hit is None:
            return nullcontext()
        self.feeds.setdefault(hit[1], set()).add(key)
        return _untracked(self, x)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.tracked:
                for hit in filter(None, map(self.hit, tree_flatten((args, kwargs))[0])):
                    self.fail(hit[1], f"`{func_name(func)}` fails on its output")
            raise
        if self.tracked:
            flat = tree_flatten((args, kwargs))[0]
            hits = [h for h in map(self.hit, flat) if h is not None]
            if hits:
                self._check(func, args, kwargs, flat, hits, out)
        return out

    def _check(self, func, args: tuple, kwargs: dict, flat: list, hits: list, out) -> None:
        name, key = func_name(func), hits[0][1]
        if self.hit(out) is not None:          # returned itself (.to() on its own device)
            return
        if not isinstance(out, Tensor):
            if name in _SHAPE_READS:
                self.shape_read.add(key)
            if isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out):
                self.fail(key, f"its output is split by `{name}`")
            return
        others = [t for t in flat if isinstance(t, Tensor) and self.hit(t) is None]
        if name in _DETACH and len(hits) == 1:   # no gradient flows on from here
            self.dead.add(key)
            return
        if len(hits) > 1:
            self.fail(key, f"its output meets another shared tensor in `{name}`")
        elif not others and name in CHAIN:
            self.track(out, key, hits[0][2] + 1)
        elif name == "repeat" and not _repeat_broadcasts(args, kwargs, hits[0][0]):
            self.fail(key, "its output is tiled by `repeat` over several axes of size above 1")
        elif name in EVENTS:
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


@contextmanager
def _untracked(check: ConsumerCheck, x: Tensor):
    entry = check.tracked.pop(id(x))
    try:
        yield
    finally:
        check.tracked[id(x)] = entry


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
        rows = res_a[moved[0]] // batch if len(moved) == 1 else 0
        if len(moved) != 1 or rows < 1 or res_a[moved[0]] != rows * batch or res_b[moved[0]] != rows * new:
            return None, False, f"`{name}` does not broadcast its output over the batch", set()
        r = moved[0]
        j = r - (len(res_a) - len(shape))
        matrix = name in _MATMUL or name == _SDPA
        tiled = name == "repeat" and j >= 0 and rows > 1 and shape[j] == rows   # B·s rows, batch-outer
        if (j >= 0 and shape[j] != 1 and not tiled) or (matrix and (len(shape) < 2 or r >= len(res_a) - 2)):
            return None, False, f"`{name}` does not broadcast its output over the batch", set()
        out.append(Consumer(name, r, j, rows))
        # expanding the output itself would make `repeat` tile an already batched tensor
        simple = simple and chain == 0 and j == simple_aligned and name not in _MATMUL and name != "repeat"
        if rows > 1 and not simple and not tiled:   # merged rows: by expanding the output itself only
            return None, False, (f"`{name}` broadcasts it over the batch merged with {rows} positions after "
                                 "other ops, which the probes do not follow"), set()
    return tuple(out), simple, None, unfollowed


def dead_ends(checks: list, verdicts: dict) -> set:
    """The followed outputs whose every use ends in ``.detach()`` in both probes, directly or
    through layers fed only by them that end so too (DoRA: ``lora_B(lora_A(eye)).T``, detached)."""
    a, b = checks
    alone = {k for k, v in verdicts.items() if v[2] is None and v[0] == () and k in a.dead and k in b.dead}
    alone |= {k for k, v in verdicts.items() if v[2] is None and v[0] == () and k not in a.dead
              and k not in b.dead and (a.feeds.get(k) or b.feeds.get(k))}   # only fed to other layers
    dead, changed = set(), True
    while changed:
        changed = False
        for k in alone - dead:
            fed = a.feeds.get(k, set()) | b.feeds.get(k, set())
            if fed <= dead and (fed or (k in a.dead and k in b.dead)):
                dead.add(k)
                changed = True
    return dead
