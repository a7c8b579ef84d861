"""DPEngine: the private step (docs/engine.md).

A DPEngine is a composition: book-keeping (per-layer norm rules) + grouping + clip
function + threshold policy + noise allocation. It never owns the optimizer.

    engine = DPEngine(model, clipping={...}, gradient_noise_multiplier=1.0, expected_batch_size=256)
    for micro in logical_batch:
        engine.backward(per_sample_losses)      # one backward; clipped sums accumulate
    report = engine.privatize()                  # p.grad = (Σ clipped + noise) / B
    optimizer.step()

What one micro-batch does (uses in backward order, groups finalized early) is
:mod:`dpclip.engine.microbatch`'s.

Length: about 540 lines (issue 53 splits it): the step's three entry points (backward, capture for pipeline
stages, privatize) share the step's accumulators and the noise source, and the certificate's
check (:mod:`dpclip.engine.certificate`) runs inside the first two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dpclip.accounting import gradient_step_event

from dpclip.engine.bookkeeping import Bookkeeper
from dpclip.engine.certificate import Certificate, CertificateRecord, NotReproducible
from dpclip.engine.certificate.dry import check_before, check_in_eval_mode
from dpclip.engine.clip import make_clip_fn
from dpclip.engine.blt import noise_streamer
from dpclip.engine.groups import (Groups, build_groups, sole_user_groups, trainable_params,
                                  untied_padding_rows)
from dpclip.engine.noise import (NoiseSource, add_step_noise, allocation_weights, effective_noise_multiplier,
                                 stage_noise_stds)
from dpclip.engine.factors import NORM_METHODS
from dpclip.engine.microbatch import MicroBatch, StepContext, StepTotals
from dpclip.engine.policies import PolicyContext, ThresholdPolicy, build_policy
from dpclip.engine.reducer import Reducer, StageLink, sum_counts
from dpclip.engine.report import ClipDebug, LazyQuantiles, StepReport
from dpclip.errors import DpclipError, EngineError, raised_on_private_batch

DEFAULT_CLIPPING = {
    "grouping": "all-layer",
    "fn": "abadi",
    "gamma": 0.01,
    "noise_allocation": "global",
    "threshold": {"kind": "fixed", "value": 1.0},
    "strict": False,
    "norm_method": "auto",
}

class DPEngine:
    """Differentially private gradients for ``model`` (see module doc and docs/engine.md).

    Args:
        model: any ``nn.Module``; build the engine after freezing what should stay frozen.
        clipping: the recipe's ``clipping:`` block as a dict; missing keys take
            :data:`DEFAULT_CLIPPING`.
        gradient_noise_multiplier: σ_g, the gradient's noise multiplier (std / sensitivity).
            With a threshold policy that releases a statistic, the total σ_eff the
            accountant sees is smaller (``report.noise_multiplier``; docs/formulas.md).
        noise_multiplier: the total σ_eff, accepted only where it is σ_g (a threshold
            policy that releases nothing); otherwise an EngineError names
            ``gradient_noise_multiplier`` (the engine does no budget split).
        expected_batch_size: B; ``p.grad`` is divided by it, never by the realised size.
        seed: None (default): the noise generator's whole state comes from OS entropy.
            An int makes the noise reproducible, and so removable by anyone who knows
            the seed: for tests and experiments only (:mod:`dpclip.rng`).
        sample_rate: Poisson rate q; the report's DpEvent is then Poisson-subsampled.
        reducer: ranks sharing each logical batch (sums over ranks, noise once: :mod:`dpclip.engine.reducer`).
        stage: the other stages of a pipeline when ``model`` is one stage of it
            (:class:`~dpclip.engine.reducer.StageLink`; docs/distributed.md, "Pipeline stages").
        noise_correlation: banded matrix factorization's strategy coefficients c (b of them,
            Σc² = 1: :func:`dpclip.engine.correlated.banded_strategy`); the noise of a step is
            then C⁻¹z, correlated with the b - 1 steps before (docs/formulas.md, "Banded matrix
            factorization"); or a BLT strategy (:func:`dpclip.engine.blt.blt_strategy`), whose
            noise is correlated across all steps through k buffers (docs/formulas.md, "BLT");
            None or one coefficient: DP-SGD's independent noise.
        records_per_unit: the most rows one privacy unit has in a step (``row_weights`` at the
            user level: k); a threshold policy whose bound depends on it (the discriminative
            top-fraction rule) noises for it.
        verify_every: the certificate (:mod:`dpclip.engine.certificate`) checks the engine's
            attribution against the samples' own gradients at the first step, on each new shape
            family of the batch and after :meth:`load_state_dict`; N > 0 also every N steps.
    """

    def __init__(self, model: nn.Module, clipping: dict | None = None, *,
                 gradient_noise_multiplier: float | None = None, expected_batch_size: int,
                 seed: int | None = None, noise_multiplier: float | None = None,
                 sample_rate: float | None = None, reducer: Reducer | None = None,
                 stage: StageLink | None = None, noise_correlation: Tensor | None = None,
                 records_per_unit: int = 1, verify_every: int = 0):
        cfg = dict(DEFAULT_CLIPPING)
        unknown = set(clipping or {}) - set(DEFAULT_CLIPPING)
        if unknown:
            raise EngineError(f"unknown clipping keys {sorted(unknown)}",
                              "allowed: " + ", ".join(DEFAULT_CLIPPING))
        cfg.update({k: v for k, v in (clipping or {}).items() if v is not None})
        if cfg["norm_method"] not in NORM_METHODS:
            raise EngineError(f"unknown norm_method {cfg['norm_method']!r}",
                              "use one of: " + ", ".join(NORM_METHODS))
        if not isinstance(expected_batch_size, int) or expected_batch_size < 1:
            raise EngineError(f"expected_batch_size must be a positive integer, got "
                              f"{expected_batch_size!r}", None)
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise EngineError(f"sample_rate must be in (0, 1], got {sample_rate}", None)
        if gradient_noise_multiplier is not None and noise_multiplier is not None:
            raise EngineError("give gradient_noise_multiplier or noise_multiplier, not both",
                              "gradient_noise_multiplier=σ_g is the gradient's noise multiplier")
        sigma_g = gradient_noise_multiplier if noise_multiplier is None else noise_multiplier
        sigma_g = 1.0 if sigma_g is None else sigma_g
        if sigma_g < 0:
            raise EngineError(f"gradient_noise_multiplier must be ≥ 0, got {sigma_g}", None)

        self.model = model
        self.config = cfg
        self.gradient_noise_multiplier = float(sigma_g)
        self.expected_batch_size = expected_batch_size
        self.sample_rate = sample_rate
        self.reducer = reducer
        self.stage = stage
        self._stage_sizes: dict = {}  # a pipeline's group sizes, gathered once (stage_noise_stds)
        self.steps = 0

        params = trainable_params(model)
        self.groups: Groups = build_groups(model, cfg["grouping"], params)
        self._params = [p.param for p in params]
        self._group_of = self.groups.group_of
        self._clip = make_clip_fn(cfg["fn"], float(cfg["gamma"]))
        first = self._params[0]
        self._norm_dtype = torch.promote_types(first.dtype, torch.float32)
        self._device = first.device
        if not isinstance(records_per_unit, int) or records_per_unit < 1:
            raise EngineError(f"records_per_unit must be a positive integer, got {records_per_unit!r}",
                              "1 for example-level privacy; k (max_examples_per_user) at the user level")
        self.policy = build_policy(cfg["threshold"], PolicyContext(
            list(self.groups.names), self.groups.sizes, expected_batch_size,
            self.gradient_noise_multiplier, first.device, self._norm_dtype, records_per_unit))
        if noise_multiplier is not None and type(self.policy).release is not ThresholdPolicy.release:
            raise EngineError("noise_multiplier is the total σ_eff: with a threshold policy that releases a "
                              "statistic it is not the gradient's, and the engine does no budget split",
                              "pass gradient_noise_multiplier=σ_g (dpclip.accounting.split_noise gives it; "
                              "docs/engine.md)")
        self.policy.reducer = reducer
        self._sizes = torch.tensor(self.groups.sizes, device=first.device, dtype=self._norm_dtype)
        allocation_weights(cfg["noise_allocation"], self.policy.thresholds(), self._sizes)
        self.noise = NoiseSource(seed, getattr(reducer, "noise_stream", None))
        self.correlation = noise_streamer(noise_correlation)
        for device in {p.device for p in self._params}:  # made now, so that a step-0 checkpoint holds them
            self.noise.generator(device)

        self._keeper = Bookkeeper(model, {id(p): i for i, p in enumerate(self._params)}, strict=bool(cfg["strict"]))
        self._padding_rows = untied_padding_rows(self._keeper.units)
        self._transient = ([False] * len(self._params) if self.policy.per_sample
                           else sole_user_groups(self._keeper.units, self.groups.members, len(self._params)))
        flat_stage = stage is not None and stage.flat
        if flat_stage:  # nothing can be clipped before the other stages' norms arrive
            self._transient = [False] * len(self._params)
        self._context = StepContext(
            params=self._params, names=[info.name for info in self.groups.params],
            group_of=list(self._group_of), members=[list(m) for m in self.groups.members],
            transient=self._transient, norm_method=cfg["norm_method"], clip=self._clip,
            count_clipped=cfg["fn"] != "auto", norm_dtype=self._norm_dtype,
            device=self._device, meter=self._keeper.stash,
            exchange_norm_sq=stage.sum_norm_sq if flat_stage else None)
        self._keeper.install()
        self.certificate = Certificate(model, self._params, self._context.names, list(self._group_of),
                                       self._clip, self._keeper.plain, lambda: self._keeper._plain > 0,
                                       verify_every, silence=lambda on: setattr(self._keeper, "silent", on))
        if stage is not None:   # a stage's backward starts from the next stage's gradient (capture)
            self.certificate.disabled = "a pipeline stage's backward starts inside the model"
        self._reset_step()

    # --------------------------------------------------------------- properties

    @property
    def group_names(self) -> list[str]:
        return list(self.groups.names)

    @property
    def thresholds(self) -> Tensor:
        return self.policy.thresholds()

    @property
    def stash_bytes(self) -> int:
        """Bytes the engine's stash holds now (activations, output grads, instantiated
        per-sample gradients awaiting their group's clip factors)."""
        return self._keeper.stash.current

    @property
    def stash_bytes_peak(self) -> int:
        """Peak of :attr:`stash_bytes` since construction or :meth:`reset_peak`."""
        return self._keeper.stash.peak

    def reset_peak(self) -> None:
        self._keeper.stash.reset_peak()

    def detach(self) -> None:
        """Give the model its original forwards back (the engine is unusable after)."""
        self._keeper.remove()
        self.certificate.remove()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards and backwards inside run the model's own layers with ordinary autograd,
        outside the book-keeping: unclipped, un-noised gradients land in ``p.grad``, and second
        derivatives work. For public data only (continual pre-training's public gradients, the
        Hessian diagnostics; docs/continual.md)."""
        with self._keeper.plain():
            yield

    def certify(self, run_losses, before: str = "training") -> CertificateRecord:
        """The certificate's check now, on rows of its own: ``run_losses()`` runs the model on a few
        rows and returns their per-sample losses [b]. Their clipped sums are thrown away; a mismatch
        raises EngineError. For a model no step can check (sharded next, or cut into pipeline
        stages: docs/engine.md, "The certificate"); ``before`` names what follows, for the report."""
        try:
            return check_before(self.certificate, self.model, run_losses,
                                lambda losses, rows: self._scratch_micro_batch(losses, rows, None),
                                self.steps, 1.0 / self.expected_batch_size, before)
        except BaseException:   # a refused check leaves no forward behind for the next step
            self.certificate.take(-1)
            self._keeper.take_forward_counts()
            raise

    def adopt_parameters(self, why_sealed: str) -> None:
        """Take the model's parameters as they are now: FSDP's ``fully_shard`` replaced each by
        a sharded one, under the same module and name. No probe may run after (``why_sealed``
        says why, in the refusal that asks for one), and no step can be checked: the whole model
        must have been, by :meth:`certify`."""
        if self.certificate.checks == 0:
            raise EngineError("the model is about to be sharded but the certificate never checked it whole, "
                              "so no step of it could be vouched for",
                              "call engine.certify(lambda: per-sample losses of a few training rows) before "
                              "sharding (docs/distributed.md, \"Sharded training\")")
        adopted = self._keeper.adopt_current_parameters(why_sealed)
        missed = [self.groups.params[i].name for i in range(len(self._params)) if i not in adopted]
        if missed:
            raise EngineError(f"parameters {', '.join(missed[:3])} belong to no book-kept module, so the engine "
                              "cannot follow them when they are sharded", "freeze them, or use training.parallel: data")
        for idx, param in adopted.items():
            self._params[idx] = self.groups.params[idx].param = param
        self.certificate.disabled = why_sealed

    def __enter__(self) -> "DPEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # --------------------------------------------------------------- the step

    def _reset_step(self) -> None:
        self._sums: list[Tensor | None] = [None] * len(self._params)
        self._norms: list[Tensor] = []
        self._clipped = torch.zeros(len(self.groups), device=self._device, dtype=self._norm_dtype)
        self._nonfinite = torch.zeros(len(self.groups), device=self._device, dtype=torch.long)
        self._samples = 0
        self._paths: dict[str, str] = {}
        self._captured: list[tuple[MicroBatch, int]] = []  # awaiting finish_micro_batch, oldest first

    def backward(self, per_sample_losses: Tensor, *, loss_scale: float = 1.0, samples: int | None = None,
                 row_weights: Tensor | None = None) -> None:
        """Backward of one micro-batch: per-sample norms, clipping, clipped sums.

        ``per_sample_losses``: shape [b] (``reduction="none"``, each sample's tokens averaged);
        ``loss_scale``: float16's (docs/engine.md). Runs the backward itself: no ``loss.backward()``.
        ``samples``: only the first ``samples`` rows are examples; the rest are padding whose
        loss weight is 0 (a sharded model's ranks run the same number of backwards, each one a
        collective: docs/distributed.md, "Sharded training").
        ``row_weights``: [b] weights in [0, 1] on the rows' clipped gradients (user-level
        privacy: 1/(records of the row's person in the batch), docs/users.md); the caller
        keeps each person's weights summing to at most 1.
        """
        losses = per_sample_losses
        if not isinstance(losses, Tensor) or losses.dim() != 1:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise EngineError(f"engine.backward needs one loss per sample (shape [b]), got {shape}",
                              "compute the loss with reduction='none' and average each "
                              "sample's tokens yourself")
        forwards = self.certificate.take(losses.shape[0])
        if losses.shape[0] == 0:
            self._keeper.take_forward_counts()
            return
        weights = torch.full_like(losses, loss_scale)
        if samples is not None:
            weights[samples:] = 0
        watch = None
        if forwards and (samples is None or samples > 0):   # the certificate's rows, before the graph is freed
            rows = self.certificate.rows(losses.shape[0] if samples is None else samples)
            watch = (rows, self.certificate.cotangents(losses, rows, forwards), forwards)
        with self.capture(losses.shape[0], samples=samples, loss_scale=loss_scale, row_weights=row_weights,
                          _watch=None if watch is None else watch[0]):
            torch.autograd.backward(losses, weights)
        self.finish_micro_batch(_watch=watch)

    def start_forward(self) -> int:
        """Call before the forward of a micro-batch when earlier micro-batches still wait for their
        backward (pipeline schedules); pass the returned generation to :meth:`capture`."""
        return self._keeper.start_forward()

    @contextmanager
    def capture(self, batch_size: int, samples: int | None = None, generation: int | None = None,
                loss_scale: float = 1.0, row_weights: Tensor | None = None,
                _watch: list[int] | None = None) -> Iterator[None]:
        """The backward of one micro-batch that someone else starts: a pipeline stage's
        backward begins at its output, from the gradient the next stage sent
        (docs/distributed.md, "Pipeline stages"). Inside, the engine collects the uses;
        :meth:`finish_micro_batch` then clips (:meth:`backward` is the two around autograd).

        ``samples``: the first ``samples`` rows are examples and the rest padding (a pipeline
        needs fixed shapes), whose loss weight is 0: they add nothing to the sums, and the
        threshold policy and the counts never see them.
        """
        samples = batch_size if samples is None else samples
        if not 0 <= samples <= batch_size:
            raise EngineError(f"engine.capture({batch_size}, samples={samples}): samples must be in "
                              "[0, batch_size]", None)
        if row_weights is not None and (row_weights.shape != (batch_size,) or not bool(
                ((row_weights >= 0) & (row_weights <= 1)).all())):
            raise EngineError(f"row_weights must be {batch_size} numbers in [0, 1], got shape "
                              f"{tuple(row_weights.shape)}", "pass dpclip.data.user_sampler.user_weights of the "
                              "batch's users, one weight per row")
        counts, generation = self._keeper.take_forward_counts(generation)
        micro = self._micro_batch(StepTotals(self._sums, self._clipped, self._nonfinite), batch_size, counts,
                                  loss_scale, row_weights)
        if _watch:
            micro.watch(_watch)
        with self._collecting(micro, batch_size, generation):
            yield
        self._captured.append((micro, samples))

    def _micro_batch(self, totals: StepTotals, batch_size: int, counts: list[int], loss_scale: float,
                     row_weights: Tensor | None) -> MicroBatch:
        policy = self.policy
        return MicroBatch(self._context, totals, batch_size, counts, policy.thresholds(),
                          policy.per_sample_thresholds if policy.per_sample else None, loss_scale, row_weights,
                          sum_scale=1.0 / self.expected_batch_size)

    @contextmanager
    def _collecting(self, micro: MicroBatch, batch_size: int, generation: int) -> Iterator[None]:
        """The backward inside delivers its uses into ``micro``; ``p.grad`` is left as the caller had
        it, and a gradient that reached it outside the engine's hooks is refused."""
        saved = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        try:
            with self._keeper.backward_scope(batch_size, generation, micro.deliver):
                yield
            stray = [i for i, p in enumerate(self._params) if p.grad is not None]
            if stray:
                raise EngineError(
                    "parameters received gradients outside the engine's hooks: "
                    + ", ".join(self.groups.params[i].name + (f" [alias {note}]" if (
                        note := self._keeper.alias_note(i)) else "") for i in stray)
                    + " (a module reads them without calling their owner, e.g. `other.weight` "
                    "inside a custom forward, or `self.bias` where `self.child.bias` is the same "
                    "tensor)", "call the owning module, or tie the parameter to a module that uses it")
        except BaseException as exc:
            micro.discard()
            if isinstance(exc, DpclipError):   # its shapes show the realised batch size
                raised_on_private_batch(exc)
            raise
        finally:
            for p, g in zip(self._params, saved):
                p.grad = g

    def finish_micro_batch(self, _watch: tuple | None = None) -> None:
        """Clip the oldest micro-batch :meth:`capture` collected: per-sample norms (on a flat
        pipeline, summed over the stages first), clip factors, clipped sums; the policy observes.
        (``_watch``: the certificate's rows, cotangents and forwards, from :meth:`backward`.)"""
        if not self._captured:
            raise EngineError("engine.finish_micro_batch without a captured backward",
                              "wrap the backward in `with engine.capture(batch_size):` first")
        micro, samples = self._captured.pop(0)
        if not self._vouched():
            micro.discard()
            self._refuse_unchecked()
        try:
            norms = micro.finish()
        except BaseException:
            micro.discard()
            raise
        norms = norms[:samples]
        if _watch is not None:   # before the policy observes anything: a refusal stops here
            rows, cots, forwards = _watch
            self.certificate.step = self.steps
            scale = 1.0 / self.expected_batch_size
            try:
                self.certificate.check(self.steps, forwards, rows, cots, norms, micro.witness, micro.used_thresholds,
                                       micro.row_weights, scale, micro.cancelling)
            except NotReproducible:
                check_in_eval_mode(self.certificate, self.model, forwards, rows, cots,
                                   lambda losses, watched: self._scratch_micro_batch(losses, watched, micro.row_weights),
                                   self.steps, scale, micro.row_weights)
            micro.witness.clear()
        for idx, path in micro.paths.items():
            self._paths[self.groups.params[idx].name] = path
        weights = micro.row_weights   # passed only when given: a policy may take the norms alone
        self.policy.observe(norms) if weights is None else self.policy.observe(norms, weights[:samples])
        self._norms.append(norms.detach())
        self._samples += samples

    def _vouched(self) -> bool:
        """False for an engine whose steps cannot be checked and whose model never was, whole."""
        return self.certificate.disabled is None or self.certificate.last is not None

    def _refuse_unchecked(self) -> None:
        raise EngineError(f"this engine's steps cannot be checked ({self.certificate.disabled}) and its "
                          "model was never checked whole", "build pipeline stages with "
                          "dpclip.distributed.pipeline.pipeline_engine, which checks the whole model first")

    def _scratch_micro_batch(self, losses: Tensor, rows: list[int], row_weights: Tensor | None) -> tuple:
        """The certificate's dry micro-batch (:mod:`dpclip.engine.certificate.dry`): the backward of
        ``losses`` into scratch sums that are thrown away, watching ``rows``; no policy observes it.
        Returns (norms [b, K], witness sums, thresholds used, groups recomputed in float64 per row)."""
        batch = losses.shape[0]
        counts, generation = self._keeper.take_forward_counts()
        scratch = StepTotals([None] * len(self._params), torch.zeros_like(self._clipped),
                             torch.zeros_like(self._nonfinite))
        micro = self._micro_batch(scratch, batch, counts, 1.0, row_weights)
        micro.watch(rows)
        with self._collecting(micro, batch, generation):
            torch.autograd.backward(losses, torch.ones_like(losses))
        try:
            norms = micro.finish()
        except BaseException:
            micro.discard()
            raise
        return norms, micro.witness, micro.used_thresholds, micro.cancelling

    def privatize(self) -> StepReport:
        """Noise the accumulated clipped sums, write ``p.grad``, return the report.

        Group k's summed clipped gradient gets N(0, (σ_g·S·w_k)²) (see
        :mod:`dpclip.engine.noise`); then ``p.grad = (sum + noise) / B`` with B the
        EXPECTED batch size. The policy releases its statistics after the noise.
        """
        if self._captured:
            raise EngineError("privatize with a captured micro-batch not finished", "call finish_micro_batch first")
        if not self._vouched():   # nothing of an unchecked model's sums leaves, with noise or not
            self._refuse_unchecked()
        thresholds = self.policy.thresholds().detach().clone()
        std = stage_noise_stds(self.gradient_noise_multiplier, self.policy.sensitivity_thresholds(),
                               self.config["noise_allocation"], self._sizes, self.stage, self._stage_sizes)
        batch = self.expected_batch_size
        std_grad = (std / batch).tolist()  # one device sync per step, not one per parameter
        grads = [torch.zeros(p.shape, dtype=p.dtype, device=p.device) if clipped is None  # sums carry 1/B
                 else clipped.contiguous() for p, clipped in zip(self._params, self._sums)]  # (MicroBatch.sum_scale)
        sharded = self.reducer is not None and getattr(self.reducer, "shards", False)
        if sharded:  # Σ over ranks of (clipped_r/B), this rank's shard of each parameter only
            self._sums = [None] * len(self._params)  # the reducer frees each whole sum once it is sent
            grads = self.reducer.sum_shards(grads, self._params)
        draws = self.gradient_noise_multiplier > 0 and (self.reducer is None or sharded or self.reducer.draws_noise)
        if draws:  # sharded: every rank draws its own shard's noise from its own stream (each coordinate once)
            add_step_noise(self.noise, grads, [std_grad[k] for k in self._group_of], self.correlation)
        for idx, row in self._padding_rows.items():
            start = self.reducer.shard_start(self._params[idx]) if sharded else 0
            if 0 <= row - start < grads[idx].shape[0]:
                grads[idx][row - start] = 0
        if self.reducer is not None:
            if not sharded:  # Σ over ranks of (clipped_r/B), plus the one rank's noise/B
                self.reducer.sum_(grads)
            self._clipped, self._nonfinite, self._samples = sum_counts(self.reducer, self._clipped,
                                                                       self._nonfinite, self._samples)
        for p, grad in zip(self._params, grads):
            p.grad = self.reducer.as_grad(grad.to(p.dtype), p) if sharded else grad.to(p.dtype)

        aux = list(self.policy.release(self.noise.generator(self._device)) or [])
        released = aux if self.stage is None or self.stage.flat else self.stage.gather_releases(aux)
        sigma_eff = effective_noise_multiplier(self.gradient_noise_multiplier, released)
        # The accounting package builds the event, so engine and plan agree exactly.
        event = gradient_step_event(self.sample_rate if self.sample_rate is not None else 1.0, sigma_eff)
        if self.config["fn"] == "auto":  # AUTO rescales every sample: "clipped" means nothing
            clip_fraction = None
        elif self._samples:
            clip_fraction = self._clipped / self._samples
        else:
            clip_fraction = torch.full_like(self._clipped, float("nan"))
        report = StepReport(
            group_names=self.group_names,
            thresholds=thresholds,
            norm_quantiles=LazyQuantiles(self._norms, len(self.groups), self._device, self._norm_dtype),
            clip_fraction=clip_fraction,
            nonfinite=self._nonfinite,
            noise_std_sum=std.detach(),
            noise_std_grad=std.detach() / batch,
            gradient_noise_multiplier=self.gradient_noise_multiplier,
            noise_multiplier=sigma_eff,
            aux_releases=aux,
            policy_summary=self.policy.summary(),
            dp_event=event,
            samples_seen=self._samples,
            expected_batch_size=batch,
            certificate=self.certificate.unreported(),
        )
        self.steps += 1
        self.certificate.step = self.steps
        self._reset_step()
        return report

    def debug_clipped(self) -> ClipDebug:
        """For tests and debugging only (never release it): the step's clipped sums without
        noise, the per-sample group norms and each parameter's norm path (:class:`ClipDebug`).
        Ends the step like :meth:`privatize` but draws no noise, charges nothing, moves no
        threshold and leaves ``p.grad`` alone."""
        if self._captured:
            raise EngineError("debug_clipped with a captured micro-batch not finished",
                              "call finish_micro_batch first")
        if type(self.policy).observe is not ThresholdPolicy.observe:  # observations would leak into a release
            raise EngineError("debug_clipped needs a threshold policy that releases nothing",
                              "use clipping.threshold {kind: fixed} while debugging")
        sums = {info.name: torch.zeros(p.shape, dtype=p.dtype, device=p.device) if s is None
                else s.detach() * self.expected_batch_size   # the engine keeps Σ_i c_i G_i / B
                for info, p, s in zip(self.groups.params, self._params, self._sums)}
        norms = (torch.cat(self._norms) if self._norms else
                 torch.zeros(0, len(self.groups), device=self._device, dtype=self._norm_dtype))
        result = ClipDebug(self.group_names, sums, norms, dict(self._paths))
        self._reset_step()
        return result

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Policy state and the noise generators' states (a secret: see :class:`NoiseSource`)."""
        state = {"policy": self.policy.state_dict(), "noise": self.noise.state_dict(), "steps": self.steps}
        if self.correlation is not None:  # the last b - 1 noises or BLT's buffers: as secret as the generators
            state["correlation"] = self.correlation.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.certificate.reset()   # a resumed run is checked again at its first step
        self.policy.load_state_dict(state["policy"])
        self.noise.load_state_dict(state["noise"])
        self.steps = int(state.get("steps", 0))
        if self.correlation is not None:
            if "correlation" not in state:
                raise EngineError("the checkpoint holds no correlated-noise history, and this engine correlates its "
                                  "noise (banded MF or BLT)", "resume with the mechanism the run was trained with")
            self.correlation.load_state_dict(state["correlation"])
