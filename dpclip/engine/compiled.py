"""The compiled micro-batch: forward, book-kept backward and clip as one torch.compile graph.

The eager engine (:mod:`dpclip.engine.bookkeeping`, :mod:`dpclip.engine.microbatch`) hands each
layer's (input, output gradient) from custom autograd functions' backwards to Python state, which
``torch.compile`` cannot trace. :class:`CompiledMicroBatch` computes the same numbers as one pure
function of (rows, loss seed, thresholds, row weights), compiled with ``fullgraph=True``
(docs/compiled.md):

1. the forward: each book-kept module runs its layer rule's ``call`` with a :class:`ProbedSite` whose
   ``op`` computes ``rule.forward`` under autograd, keeps the input and the output and returns a
   copy of the output; a module without a layer rule (a custom RMSNorm) runs its own forward,
   kept the same way;
2. the backward: ``torch.autograd.grad(losses, outputs, seed)``: each call's output gradient, the
   book-keeping's one backward (no parameter's gradient is formed: none is asked for). The
   module's caller gets the copy, so a later in-place change of it (``h += x``, ``relu_``) does
   not move the gradient read at the output kept;
3. per parameter its uses (``rule.uses``; a per-sample ``vjp`` under ``vmap`` for a torch.func
   module), its norm² over every use with all cross terms (:func:`~dpclip.engine.factors.param_norm_sq`),
   the group norms, the clip factors (the engine's clip function) and the clipped sums
   (:func:`~dpclip.engine.factors.clipped_sum`), and one flag: a sample whose norm the
   cancellation check cannot vouch for (:mod:`dpclip.engine.cancellation`), or a non-finite norm.

Outside the graph, one read of the device: a flagged micro-batch is thrown away and redone by the
eager engine (which recomputes the flagged rows in float64 and drops non-finite ones), the graph's
random draws and writes of saved buffers undone first (:func:`saved_state`); otherwise its
sums, clipped counts and norms go into the engine's step as an eager micro-batch's would.

Verify, don't infer: the first compiled micro-batch of each batch shape, and the first through
each graph torch.compile compiles again (a guard changed), is also run by the eager engine, whose attribution the certificate checks against the samples' own gradients
(docs/certificate.md); the compiled sums and norms must equal the eager ones within float32's
rounding, or the step is refused before any noise (:meth:`CompiledMicroBatch.verified`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from dpclip.engine.cancellation import CANCELLATION_TOLERANCE, cancellation_bound
from dpclip.engine.certificate.replay import set_rng
from dpclip.engine.compiled_forward import COMPILE_OFF, HINT, Recorder, per_sample_vjp, probed_forward
from dpclip.engine.factors import Use, clipped_sum, param_norm_sq, sqrt_or_zero
from dpclip.engine.groupwise import clip_factors, weights_toward_zero
from dpclip.errors import EngineError
from dpclip.torch_compat import (COMPILED_SHAPES_LIMIT, compile_fullgraph, compiled_graphs, graph_breaks,
                                 recompile_limit_hit, saved_buffers)

def supported(engine) -> str | None:
    """Why ``engine``'s steps cannot be compiled (None: they can)."""
    keeper = engine.book_keeper
    if engine.policy.per_sample:
        return "its threshold policy sets a threshold per sample"
    for unit in keeper.units:
        if unit.derived:
            return f"module {unit.label} is parametrized"
    return None


class CompiledMicroBatch:
    """The micro-batches of ``engine``'s steps through one compiled graph (module doc).

    ``loss_fn(model, rows) -> [b]`` per-sample losses, as :class:`~dpclip.train.step.PrivateStep`
    takes it. ``backend``: torch.compile's (``"inductor"``; the tests trace with ``"aot_eager"``,
    which generates no code; ``None`` runs :meth:`clip` uncompiled, for tests of what surrounds it)."""

    def __init__(self, engine, model: nn.Module, loss_fn: Callable, *, backend: str | None = "inductor"):
        why = supported(engine)
        if why is not None:
            raise EngineError(f"the private step cannot be compiled: {why}", HINT)
        self.engine, self.model, self.loss_fn = engine, model, loss_fn
        self.recorder = Recorder()
        self.forwards = {id(unit): probed_forward(self.recorder, unit) for unit in engine.book_keeper.units}
        self.context = engine.step_accumulator.context
        # On a GPU the graph is also a CUDA graph (one launch); its outputs live in buffers the next
        # call overwrites, so everything kept past a call is copied (:meth:`__call__`).
        self.compiled = self.clip if backend is None else compile_fullgraph(
            self.clip, backend, cuda_graphs=self.context.device.type == "cuda")
        self.verified: set[tuple] = set()

    def __call__(self, rows: dict[str, Tensor], samples: int, row_weights: Tensor | None = None) -> Tensor:
        """One micro-batch into the engine's step: ``rows`` (the batch in dim 0 of each tensor), of which
        the first ``samples`` are examples and the rest padding (loss weight 0); ``row_weights``: the
        examples' user-level weights. Returns the examples' losses [samples]."""
        engine, ctx = self.engine, self.context
        engine.refuse_changed_parameters()   # as the engine's own backward does (a layer unfrozen since)
        batch = _batch_of(rows)
        seed = (torch.arange(batch, device=ctx.device) < samples).to(ctx.params[0].dtype)
        weights = None if row_weights is None else _padded(weights_toward_zero(row_weights, ctx.norm_dtype, ctx.device),
                                                           batch)
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in rows.items() if isinstance(t, Tensor))
        if key not in self.verified or engine.certificate.due():
            return self._verified_by_engine(rows, samples, row_weights, seed, weights, key)
        state, graphs, written = random_state(self.model), compiled_graphs(), saved_state(self.model,
                                                                                     engine.forward_written_state)
        sums, norms, clipped, suspect, losses = self.graph(rows, seed, weights)
        recompiled = compiled_graphs() != graphs
        if recompiled or bool(suspect):   # (the one read of the device)
            # the engine redoes this micro-batch: the graph's run leaves nothing, neither its random draws
            # nor its writes of saved buffers (a forward counter would count it, and the suspect flag is
            # the rows' own: the saved state would tell which micro-batches were redone)
            set_rng(state)
            restore_state(self.model, written)
            if not recompiled:   # rows it cannot vouch for: the engine recomputes them (float64, non-finite ones)
                return self._by_engine(rows, samples, row_weights)
            # a new graph for a shape already verified (a guard changed: a flag the forward reads)
            # is checked against the engine, as a new shape's, before anything of it is used; torch.compile
            # keeps it cached, so until a check passes the shape is unchecked (a refused graph stays refused)
            self.verified.discard(key)
            engine.certificate.force()
            return self._verified_by_engine(rows, samples, row_weights, seed, weights, key)
        kept = norms[:samples].clone()   # a CUDA graph's output buffers are overwritten by its next call
        engine.step_accumulator.add(sums, kept, clipped)
        engine.policy.observe(kept) if weights is None else engine.policy.observe(kept, weights[:samples])
        return losses[:samples].clone()

    def graph(self, rows: dict[str, Tensor], seed: Tensor, weights: Tensor | None) -> tuple:
        """:meth:`clip` compiled, on ``rows``; what torch.compile cannot take (a first call traces, a
        changed guard traces again) is refused with a hint, before anything of the step is released."""
        try:
            with self.probed():
                return self.compiled(rows, seed, self.engine.thresholds, weights)
        except EngineError:
            raise
        except Exception as exc:
            if recompile_limit_hit(exc):
                raise EngineError(f"the compiled step has compiled {COMPILED_SHAPES_LIMIT} batch shapes, torch.compile's "
                                  "limit for one function; nothing of this step was released",
                                  "pad batches to a few lengths (each shape compiles again), or "
                                  f"{COMPILE_OFF} (docs/compiled.md)") from exc
            self._own_refusal(rows, seed, weights)
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise EngineError(f"torch.compile could not compile this model's micro-batch ({type(exc).__name__}: "
                              f"{first}); nothing of this step was released",
                              f"{COMPILE_OFF}: the engine trains it eagerly (docs/compiled.md, \"What is "
                              "refused\")") from exc

    def _own_refusal(self, rows: dict[str, Tensor], seed: Tensor, weights: Tensor | None) -> None:
        """Raise the compiled step's own refusal, if any, of ``rows``: inside a trace, dynamo reports
        an EngineError as a failure to trace; :meth:`clip` run uncompiled raises it as it is."""
        try:
            with self.probed():
                self.clip(rows, seed, self.engine.thresholds, weights)
        except EngineError:
            raise
        except Exception:   # noqa: BLE001  (not ours: the caller reports torch.compile's)
            return

    def graph_breaks(self, rows: dict[str, Tensor], samples: int) -> tuple[int, int, list[tuple[str, str, int]]]:
        """(graphs, breaks, [(reason, file, line)]) of tracing :meth:`clip` on ``rows`` as it is compiled
        (:func:`~dpclip.torch_compat.graph_breaks`); one graph and no break: ``fullgraph=True`` holds."""
        ctx = self.context
        seed = (torch.arange(_batch_of(rows), device=ctx.device) < samples).to(ctx.params[0].dtype)
        with self.probed():
            return graph_breaks(self.clip, rows, seed, self.engine.thresholds, None, autograd_traced=True)

    def _by_engine(self, rows: dict[str, Tensor], samples: int, row_weights: Tensor | None) -> Tensor:
        """The micro-batch through the eager engine (book-keeping, certificate, float64 rows)."""
        batch = _batch_of(rows)
        losses = self.loss_fn(self.model, rows)
        self.engine.backward(losses, samples=None if samples == batch else samples,
                             row_weights=None if row_weights is None else _padded(row_weights, batch))
        return losses.detach()[:samples]

    def _verified_by_engine(self, rows, samples, row_weights, seed, weights, key) -> Tensor:
        """The eager engine's micro-batch goes into the step; the compiled one, on the same rows and
        random state (dropout), must equal it within rounding before this shape is compiled from
        now on; else refused, nothing of the step released."""
        engine = self.engine
        state, before = random_state(self.model), saved_state(self.model)
        step = engine.step_accumulator
        sums_before = [None if s is None else s.clone() for s in step.sums]
        losses = self._by_engine(rows, samples, row_weights)
        after = random_state(self.model)
        eager_sums = [s if before is None or s is None else s - before
                      for s, before in zip(step.sums, sums_before)]
        eager_norms = step.norms[-1]
        written = saved_state(self.model)   # as the engine's forward left it
        set_rng(state)
        restore_state(self.model, before)   # the graph's forward starts where the engine's did
        try:
            sums, norms, _, suspect, _ = self.graph(rows, seed, weights)
        finally:
            set_rng(after)
            restore_state(self.model, written)   # and the model's state is the engine's forward's alone
        if bool(suspect):   # the engine recomputed some rows in float64: compare on another batch
            return losses
        gap, where = disagreement(sums, norms[:samples], eager_sums, eager_norms, self.context, engine.thresholds,
                                  1.0 / engine.expected_batch_size)
        if not gap <= AGREEMENT:
            raise EngineError(f"the compiled micro-batch differs from the engine's on the same rows: {where} by "
                              f"{gap:.2e} relative; "
                              "nothing of this step was released", f"{COMPILE_OFF}, and report the "
                              "model with `dpclip --debug` output (docs/compiled.md)")
        self.verified.add(key)
        return losses

    @contextmanager
    def probed(self) -> Iterator[None]:
        """Each book-kept module runs its probed forward (the engine's routing and checks wait)."""
        units = self.engine.book_keeper.units
        routed = [unit.module.__dict__.get("forward") for unit in units]
        for unit in units:
            unit.module.forward = self.forwards[id(unit)]
        try:
            with hooks_idle(self.engine):
                yield
        finally:
            for unit, forward in zip(units, routed):
                if forward is None:
                    del unit.module.__dict__["forward"]
                else:
                    unit.module.forward = forward

    def clip(self, rows: dict[str, Tensor], seed: Tensor, thresholds: Tensor,
             row_weights: Tensor | None) -> tuple[list[Tensor | None], Tensor, Tensor, Tensor, Tensor]:
        """The function compiled: (clipped sums Σ_i c_i G_i / B per parameter (None: unused),
        norms [b, K], clipped samples per group [K], suspect (0-dim bool), losses [b])."""
        ctx, recorder = self.context, self.recorder
        recorder.calls = []
        recorder.batch = seed.shape[0]
        losses = self.loss_fn(self.model, rows)
        # The calls leave the recorder before the graph ends: a tensor still held by it would be
        # one more output of the graph, and those requiring gradients would make it differentiable.
        calls, recorder.calls = recorder.calls, []
        grads = torch.autograd.grad(losses, [call.output for call in calls], seed, allow_unused=True)
        with torch.no_grad():
            uses: list[list[Use]] = [[] for _ in ctx.params]
            for call, grad in zip(calls, grads):
                if grad is None:   # the call's output never reached the loss
                    continue
                unit = call.unit
                if call.rule is None:
                    got = per_sample_vjp(unit.module, {n: p.detach() for n, p, _ in unit.params}, call.x,
                                          grad, recorder)
                else:
                    got = call.rule.uses(unit.module, call.x, grad, call.info)
                for name, _, idx in unit.params:
                    if name in call.names:
                        uses[idx].append(got[name])
            return self._clipped(uses, seed, thresholds, row_weights) + (losses.detach(),)

    def _clipped(self, uses: list[list[Use]], seed: Tensor, thresholds: Tensor, row_weights: Tensor | None):
        ctx = self.context
        batch = seed.shape[0]
        parts: list[list[Use] | None] = [None] * len(ctx.params)
        group_sq = [torch.zeros(batch, dtype=ctx.norm_dtype, device=ctx.device) for _ in ctx.members]
        suspect = torch.zeros((), dtype=torch.bool, device=ctx.device)
        for idx, param_uses in enumerate(uses):
            if not param_uses:
                continue
            p = ctx.params[idx]
            sq, parts[idx], atoms = param_norm_sq(param_uses, p.shape, ctx.norm_method, ctx.norm_dtype,
                                                  with_atoms=True)
            bound = cancellation_bound(parts[idx], sq.dtype)
            if bound is not None:
                suspect = suspect | (sq * CANCELLATION_TOLERANCE < bound * atoms).any()
            group_sq[ctx.group_of[idx]] = group_sq[ctx.group_of[idx]] + sq.to(ctx.device)
        norms = sqrt_or_zero(torch.stack(group_sq, dim=1))
        suspect = suspect | ~torch.isfinite(norms).all()
        factors = clip_factors(ctx.clip, norms, thresholds, None, row_weights, None, 1.0 / self.engine.expected_batch_size)
        sums = [None if part is None else clipped_sum(part, factors[:, ctx.group_of[idx]].to(ctx.params[idx].device),
                                                      ctx.params[idx].shape)
                for idx, part in enumerate(parts)]
        clipped = (norms > thresholds).sum(0).to(ctx.norm_dtype)
        return sums, norms, clipped, suspect


@contextmanager
def hooks_idle(engine) -> Iterator[None]:
    """The model's forwards inside leave the engine's model-level hooks alone (the batch axes',
    the certificate's): the book-kept modules run their probed forwards instead."""
    axes, certificate = engine.book_keeper.axes, engine.certificate
    axes.idle = certificate.idle = True
    try:
        yield
    finally:
        axes.idle = certificate.idle = False


#: relative difference between a compiled and an eager micro-batch's sums and norms beyond which the
#: compiled one is refused: float32's rounding of the same sums in another order is ~1e-7 relative
#: (measured 1e-7 to 3e-7 on the tiny GPT-2, Llama and BERT, tests/engine/test_compiled.py)
AGREEMENT = 1e-4


def disagreement(sums: list[Tensor | None], norms: Tensor, eager_sums: list[Tensor | None], eager_norms: Tensor,
                 ctx, thresholds: Tensor, sum_scale: float) -> tuple[float, str]:
    """The largest relative difference between a compiled micro-batch and the engine's, and where.

    A norm is compared with the largest norm; a parameter's clipped sum with its size plus the
    sum of its group's clipped sizes, sum_scale·Σ_i c_i·norm_i (its samples' terms may cancel in
    the sum, but each is rounded at its own size: a sum that is 0 but for rounding, as an attention
    key bias's, is compared at the size of what was rounded)."""
    scale = eager_norms.abs().max().clamp_min(torch.finfo(eager_norms.dtype).tiny)
    gap = ((norms.to(eager_norms.dtype) - eager_norms).abs().max() / scale).item() if norms.numel() else 0.0
    worst = (gap, "the per-sample norms")
    clipped_size = (ctx.clip(eager_norms, thresholds) * eager_norms).sum(0) * sum_scale   # [K]
    for name, group, total, eager in zip(ctx.names, ctx.group_of, sums, eager_sums):
        if total is None and eager is None:
            continue
        if total is None or eager is None:   # no use of the parameter on one side: its sum is 0 there
            total, eager = (torch.zeros_like(eager) if total is None else total,
                            torch.zeros_like(total) if eager is None else eager)
        size = (eager.norm() + clipped_size[group].to(eager.dtype)).clamp_min(torch.finfo(eager.dtype).tiny)
        gap = ((total - eager).norm() / size).item()
        if not gap <= worst[0]:   # NaN included
            worst = (gap, f"parameter {name}'s clipped sum")
    return worst


def _batch_of(rows: dict[str, Tensor]) -> int:
    return next(t.shape[0] for t in rows.values() if isinstance(t, Tensor))


def _padded(weights: Tensor, size: int) -> Tensor:
    """Row weights, 0 for the padding rows after them."""
    return torch.cat([weights, weights.new_zeros(size - len(weights))]) if len(weights) < size else weights


def saved_state(model: nn.Module, names=None) -> dict[str, Tensor]:
    """Copies of ``model``'s persistent buffers (saved with the weights), by name; ``names``: only those
    (the ones its training forward was seen writing, :attr:`~dpclip.engine.DPEngine.forward_written_state`)."""
    if names is not None and not names:
        return {}
    return {name: t.detach().clone() for name, t in _saved_buffers(model) if names is None or name in names}


def restore_state(model: nn.Module, saved: dict[str, Tensor]) -> None:
    """Put :func:`saved_state`'s copies back, in place (a buffer the forward reassigned included)."""
    if not saved:
        return
    with torch.no_grad():
        for name, t in _saved_buffers(model):
            if name in saved:
                t.copy_(saved[name])


def _saved_buffers(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    for prefix, module in model.named_modules(remove_duplicate=False):
        for key, t in saved_buffers(module):
            yield (f"{prefix}.{key}" if prefix else key), t


def random_state(model: nn.Module) -> tuple[Tensor, dict[int, Tensor]]:
    """The CPU generator's state and, for a model on CUDA, its devices' (dropout draws from them)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    return torch.random.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


