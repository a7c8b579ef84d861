"""The batch of the model's forward in progress, the established layouts, and when to probe.

The answers are cached per (module, call ordinal within the forward), so probes run once,
not per step; each later call only checks that its tensors still fit (same rank, the batch
axis of size B). A call that does not fit, or one the probes never saw (a loop running
longer), probes again once in that forward.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Callable, Iterator

import torch
from torch import Tensor

from dpclip.engine.batch_axis.consumers import ConsumerCheck, consumers, dead_ends
from dpclip.engine.batch_axis.layout import (BATCH_FIRST, BATCH_HINT, BROADCAST_HINT, CallLayout, cut_batch_refusal,
                                             Layout, call_leaves, shared_lead1, shared_output_refusal,
                                             tensor_leaves, unprobed_call_refusal)
from dpclip.engine.batch_axis.probe import (NEEDS_ROWS, Probe, compare, forked_rng, nothing_saved, resized,
                                            untouched_buffers)
from dpclip.engine.batch_axis.site import SiteBatch
from dpclip.engine.precision import autocast_restore, autocast_snapshot
from dpclip.errors import EngineError
from dpclip.torch_compat import forward_hooks_silenced, func_transform_active


class BatchAxes:
    """The batch of the model's forward in progress and the established layouts.

    ``units``: the book-kept units (``module``, ``rule``, ``label``); ``plain()``: a context
    in which their forwards pass through (the probes run in it); ``device_types()``: where
    the model's parameters live (default: read off the model)."""

    def __init__(self, model: torch.nn.Module, units: list, plain: Callable,
                 device_types: Callable[[], set[str]] | None = None,
                 on_probed: Callable[..., bool] | None = None):
        self.model = model
        self.on_probed = on_probed          # (units called, parameter reads, at start[, feeders]): units changed?
        self.device_types = device_types or (lambda: {p.device.type for p in model.parameters()})
        self.units = {id(u): u for u in units}
        self.plain = plain
        self.layouts: dict[tuple[int, int], CallLayout] = {}
        self.probe: Probe | None = None     # while probing: the forwards only record
        self.idle = False                   # a compiled micro-batch's forward: no axis to establish
        self.batch: int | None = None       # B of the model's forward in progress
        self.inputs: tuple | None = None    # that forward's (args, kwargs), for the probes
        self.ordinals: dict[int, int] = {}
        self.depth = 0                      # model forwards in progress
        self.children = 0                   # inside a rule that calls children batch first
        self.reprobed = False
        self.keep_saved = False             # probes keep their saved tensors (a forward differentiates)
        self.probes = 0                     # probing forwards run so far (tests, docs)
        self.sealed: str | None = None      # why no probe may run any more (a sharded model)
        self.at_start = False               # probing before any module of the forward has run
        self.first = True                   # no forward probed at its start yet
        self.autocast_at_entry = None       # autocast as the forward in progress found it
        self.grad_at_entry = self.transform_at_entry = False   # it records gradients; began in a torch.func transform
        # this forward's shared outputs the engine expanded over the batch (note_expanded)
        self.expanded: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    # ---------------------------------------------------------------- hooks

    def pre_hook(self, module, args, kwargs):
        if self.probe is not None or self.idle:
            return None
        self.depth += 1
        if self.depth == 1:
            leaves = tensor_leaves((args, kwargs))
            self.batch = leaves[0].shape[0] if leaves and leaves[0].dim() > 0 else None
            self.inputs, self.ordinals = (args, kwargs), {}
            self.expanded.clear()
            self.reprobed = False
            self.autocast_at_entry, self.grad_at_entry = autocast_snapshot(self.device_types()), torch.is_grad_enabled()
            self.transform_at_entry = func_transform_active() is not None
            if self.first and self.batch and self.sealed is None and torch.is_grad_enabled():
                self.at_start, self.first = True, False   # the first forward: probed before any module runs
                try:
                    self.establish()
                finally:
                    self.at_start = False
        return None

    def post_hook(self, module, args, kwargs, output):
        if self.probe is not None or self.idle:
            return None
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.inputs = None
            if self.reprobed:   # a probe re-entered this forward (dpclip.engine.precision.autocast_restore)
                autocast_restore(self.autocast_at_entry)
        return None

    @contextmanager
    def children_batch_first(self) -> Iterator[None]:
        self.children += 1
        try:
            yield
        finally:
            self.children -= 1

    # ------------------------------------------------------------- per call

    def enter(self, unit, site: SiteBatch, args: tuple, kwargs: dict) -> None:
        """Give ``site`` (the unit's capture) this call's tensors and established layout."""
        leaves = call_leaves(args, kwargs)
        layout = self.layout(unit, leaves)
        if layout.refusal is not None:
            raise EngineError(f"module {unit.label} {layout.refusal}", layout.hint or BROADCAST_HINT)
        site.set_call(layout, leaves)

    def in_grad_forward(self) -> bool:   # a forward of the model that records gradients, in progress
        return self.depth > 0 and bool(self.batch) and self.grad_at_entry

    def skip(self, unit) -> None:   # a call not book-kept, in its place among the probes' calls
        self.ordinals[id(unit)] = self.ordinals.get(id(unit), 0) + 1

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
        lay = self._per_sample_expansions(self.layouts.get(key), leaves)
        ragged = unit.rule.ragged_inputs(unit.module, leaves)
        if lay is None or not lay.fits(leaves, self.batch, ragged):
            if not self.reprobed:
                self.establish()
                lay = self._per_sample_expansions(self.layouts.get(key), leaves)
            if lay is None or not lay.fits(leaves, self.batch, ragged):
                raise unprobed_call_refusal(unit, n, leaves)
        return lay

    def note_expanded(self, t: Tensor) -> None:
        """``t`` is a shared output the engine expanded over the batch (a copy per sample, each
        with its own output gradient), so a module called with it gets it per sample."""
        self.expanded[id(t)] = t

    def _per_sample_expansions(self, lay: CallLayout | None, leaves: list[Tensor]) -> CallLayout | None:
        """``lay`` with the batch in axis 0 of each input the probes saw shared and the engine
        has since expanded over the batch (BEiT's shared relative position bias, fed to every layer)."""
        if lay is None or lay.inputs is None or not self.expanded or len(leaves) != len(lay.inputs):
            return lay
        inputs = tuple(Layout(t.dim(), 0) if l.dim is None and l.error is None and self.expanded.get(id(t)) is t
                       and t.dim() == l.ndim and t.dim() > 0 and t.shape[0] == self.batch else l
                       for l, t in zip(lay.inputs, leaves))
        return lay if inputs == lay.inputs else replace(lay, inputs=inputs)

    def recomputed_layout(self, unit, leaves: list[Tensor], batch: int) -> CallLayout:
        """The layout of a call of ``unit`` that gradient checkpointing recomputes in the backward
        (no forward of the model in progress; no probe can run there): the one layout of this
        module's calls in the forward that the tensors fit. None or two different ones that fit
        are refused: a guess would decide which rows are which sample."""
        if self.children:
            return BATCH_FIRST
        ragged = unit.rule.ragged_inputs(unit.module, leaves)
        fitting = []
        for (uid, _), lay in sorted(self.layouts.items(), key=lambda kv: kv[0][1]):
            if uid == id(unit) and lay.fits(leaves, batch, ragged) and lay not in fitting:
                fitting.append(lay)
        if len(fitting) != 1:
            why = "no call of it in the forward had" if not fitting else "several of its calls in the forward had, laid out differently"
            raise EngineError(f"module {unit.label} was recomputed in the backward (gradient checkpointing) with inputs "
                              f"of shapes {[tuple(t.shape) for t in leaves]}, which {why}, so its batch axis cannot be told",
                              "checkpoint whole blocks that the model calls the same way each time, or turn checkpointing off")
        if fitting[0].refusal is not None:
            raise EngineError(f"module {unit.label} {fitting[0].refusal}", fitting[0].hint or BROADCAST_HINT)
        return fitting[0]

    # --------------------------------------------------------------- probes

    def _run(self, probe: Probe, args: tuple, kwargs: dict, check: ConsumerCheck | None = None):
        devices = sorted({p.device.index or 0 for p in self.model.parameters()
                          if p.device.type == "cuda"})
        self.probe = probe
        self.probes += 1
        try:
            # the model's forward hooks (a hook collecting activations, a counter) do not see a probe
            with self.plain(), forked_rng(devices), untouched_buffers(self.model), forward_hooks_silenced(self.model), \
                    nullcontext() if self.keep_saved else nothing_saved(), \
                    probe.reading() if check is None else nullcontext():
                if check is None:
                    return self.model(*args, **kwargs)
                with check:
                    out = self.model(*args, **kwargs)
                for t in tensor_leaves(out):
                    hit = check.hit(t)
                    if hit is not None:
                        check.fail(hit[1], "it is returned by the model unchanged")
                return out
        finally:
            self.probe = None

    def _probe_pair(self, sizes: tuple[int, int], inputs: list) -> list[Probe]:
        """The two probes, saving nothing for a backward; where that fails, once more with the saved
        tensors kept, for good: a forward that differentiates inside itself (``torch.autograd.grad``
        of an energy, ``torch.func.grad``) needs them, and the book-kept forward judges it."""
        try:
            probes = [Probe(size) for size in sizes]
            for probe, (a, k) in zip(probes, inputs):
                self._run(probe, a, k)
            return probes
        except EngineError:
            raise
        except Exception:
            if self.keep_saved:
                raise
            self.keep_saved = True
            try:
                return self._probe_pair(sizes, inputs)
            except Exception:
                self.keep_saved = False
                raise

    def establish(self) -> None:
        """Probe the model's forward in progress and merge the layouts found into the cache.

        The probes run on the first two samples and on three (row 0 repeated if B < 3; one
        and two samples if B = 1): cheap whatever B is, and what they establish is the
        structure (which axis), checked against B at every call."""
        if self.sealed is not None:
            raise EngineError(f"the batch axes must be probed again, and {self.sealed}", BATCH_HINT)
        self.reprobed = True
        args, kwargs = self.inputs
        batch = self.batch
        sizes = (1, 2) if batch == 1 else (2, 3)
        errors = []
        for first_only in (False, True):    # every input of leading size B, or the first only
            inputs = [resized(args, kwargs, batch, size, first_only) for size in sizes]
            try:
                probes = self._probe_pair(sizes, inputs)
                break
            except EngineError:
                raise
            except Exception as exc:  # the resized inputs do not fit the model: try the next
                errors.append(exc)
        else:
            raise cut_batch_refusal(args, kwargs, batch, sizes, errors[-1]) from errors[-1]
        layouts = compare(*probes)
        rows = {(key, i): (lay.dim,) for key, call in layouts.items()
                for i, lay in enumerate(call.inputs) if lay.error == NEEDS_ROWS}
        rows.update({(key, "out", i): (lay.dim,) for key, call in layouts.items()   # the torch.func rule's
                     for i, lay in enumerate(call.outputs) if lay.error == NEEDS_ROWS})   # per-sample rows
        if rows:   # merged axes: one more pair, fingerprinting their rows (OPT)
            probes = [Probe(size, rows=rows) for size in sizes]
            for probe, (a, k) in zip(probes, inputs):
                self._run(probe, a, k)
            layouts = compare(*probes)
        if self.on_probed is not None:
            reads: dict[int, set[int]] = {}
            for probe in probes:
                for param, modules in probe.reads.items():
                    reads.setdefault(param, set()).update(modules)
            if self.on_probed({u for probe in probes for u in probe.ordinals}, reads, self.at_start):
                return self.establish()   # new units (a reader of its own): their calls are probed too
        expand = expanders(layouts, self.units)
        feeders = follow_shared_outputs(layouts, expand, sizes, inputs, self.units, self._run) if expand else set()
        if feeders and self.on_probed is not None and self.on_probed(set(), {}, self.at_start, feeders):
            return self.establish()   # shared feeders taken by an enclosing torch.func unit: probed again
        self.layouts.update(layouts)


def follow_shared_outputs(layouts: dict, expand: dict, sizes: tuple, inputs: list, units: dict,
                          run: Callable[..., object]) -> set[int]:
    """More probes follow each shared output to its consumers: expanding the output
    itself is exact (GPT-2's positions), or expanding it at its consumers after its
    chain of ops (T5's bias, layers with the default call only), or it is refused. An
    op whose operands are all shared (a shared mask) continues the chain: the next pair
    of probes follows its result too (at most three pairs). Returns the units refused because
    their output feeds another layer (an enclosing torch.func unit may take them).

    ``layouts`` (updated in place): the probed calls' layouts; ``expand``: :func:`expanders`;
    ``sizes``/``inputs``: the probe pair's sizes and inputs; ``units``: id -> unit;
    ``run(probe, args, kwargs, check=...)``: one probe forward (:class:`BatchAxes`)."""
    links: set = set()
    returned: dict = {}     # (call, output): the name of the unit's own parameter it returns unchanged
    for _ in range(3):
        checks, aligned = [], {}
        for size, (args, kwargs) in zip(sizes, inputs):
            check = ConsumerCheck(frozenset(links))
            try:
                run(Probe(size, {k: tracker(units, k, f, check, aligned, returned)
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
    dead, feeders = dead_ends(checks, verdicts), set()
    for key, (kind, which) in expand.items():
        if kind == "input" and (key, 0) in dead:
            layouts[key] = replace(layouts[key], dead=True)
            continue
        found, why, simple, rows = [], None, True, {}
        for j in which or [0]:
            if (key, j) not in verdicts:
                continue
            cons, ok, why, unfollowed = verdicts[(key, j)]
            fed = checks[0].feeds.get((key, j), set()) | checks[1].feeds.get((key, j), set())
            if why is None and fed:   # (fed to layers whose outputs all end detached: dead, above)
                layers = ", ".join(sorted({units[k[0][0]].label for k in fed if k[0][0] in units}))
                why = f"its output is the input of another layer ({layers}), which is not a broadcast over the batch"
                feeders.add(key[0])
            if why is None and unfollowed:
                why = "its output meets shared tensors through more ops than the probes follow"
            merged = {c.rows for c in cons or () if c.result_batch is not None and c.name != "repeat"}   # (Chained tiles)
            if why is None and (len(merged) > 1 or (merged - {1} and kind != "outputs")):
                why = "its consumers broadcast it over the batch merged with positions in different ways"
            if why is not None:
                break
            found.append(cons)
            simple = simple and ok
            rows[j] = max(merged, default=1)
        lay = layouts[key]
        if why is None and kind == "outputs" and any(c > 1 for c in rows.values()):
            lay = layouts[key] = replace(lay, outputs=tuple(
                replace(o, expand_rows=rows.get(j, 1)) for j, o in enumerate(lay.outputs)))
        if why is None and not simple and kind == "outputs":
            why = ("its output is broadcast over the batch only after other ops, which the "
                   "per-sample fallback cannot follow")
        if why is not None:
            mine = [name for (k, _), name in returned.items() if k == key]
            layouts[key] = replace(lay, **shared_output_refusal(why, mine, units[key[0]].name))
        elif not simple:
            layouts[key] = replace(lay, consumers=found[0])
    return feeders

def expanders(layouts: dict, units: dict) -> dict:
    """Calls whose output the engine expands over the batch: key -> which outputs."""
    out = {}
    for key, lay in layouts.items():
        unit = units.get(key[0])
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

def tracker(units: dict, key, how, check: ConsumerCheck, aligned: dict, returned: dict):
    """The call of ``key`` in a consumer probe: its shared output(s) tracked; ``aligned``
    gets the axis that expanding the output itself would give the batch (0: its leading
    1; -1: prepended); ``returned`` the name of a parameter of the unit an output is."""
    unit = units[key[0]]

    def run(args, kwargs, orig):
        kind, which = how
        leaves = call_leaves(args, kwargs)
        with check.feeding(leaves[0], (key, 0)) if kind == "input" and leaves else nullcontext():
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
            returned.update({(key, j): name for name, p, _ in unit.params if p is t})
            if t.is_floating_point():
                aligned[(key, j)] = 0 if t.dim() >= 1 and t.shape[0] == 1 else -1
                check.track(t, (key, j))
        return out

    return run
