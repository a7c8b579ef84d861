"""DPEngine: the private step (docs/engine.md).

A DPEngine is a composition: book-keeping (per-layer norm rules) + grouping + clip
function + threshold policy + noise allocation, read from one typed
:class:`~dpclip.engine.spec.ClippingSpec` (a dict is turned into one at this edge). It never
owns the optimizer.

    engine = DPEngine(model, clipping={...}, gradient_noise_multiplier=1.0, expected_batch_size=256)
    for micro in logical_batch:
        engine.backward(per_sample_losses)      # one backward; clipped sums accumulate
    report = engine.privatize()                  # p.grad = (Σ clipped + noise) / B
    optimizer.step()

Its parts: the book-keeping (:mod:`dpclip.engine.bookkeeping`) collects each layer's uses; one
micro-batch (uses in backward order, groups finalized early) is :mod:`dpclip.engine.microbatch`'s;
the step's accumulator (:mod:`dpclip.engine.accumulator`) adds the micro-batches up; the
privatizer of the run's parallel mode (:mod:`dpclip.engine.privatizer`) noises the sums into
``p.grad``; the certificate (:mod:`dpclip.engine.certificate`) checks the attribution inside
:meth:`DPEngine.backward` (:mod:`dpclip.engine.step_checks`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dpclip.engine.accumulator import StepAccumulator
from dpclip.engine.bookkeeping import Bookkeeper
from dpclip.engine.certificate import Certificate, CertificateRecord
from dpclip.engine.clip import make_clip_fn
from dpclip.engine.blt import noise_streamer
from dpclip.engine.groups import Groups, build_groups, sole_user_groups, trainable_params, untied_padding_rows
from dpclip.engine.noise import NoiseSource, allocation_weights, noise_stds
from dpclip.engine.microbatch import StepContext
from dpclip.engine.policies import PolicyContext, ThresholdPolicy, build_policy
from dpclip.engine.privatizer import privatizer_for
from dpclip.engine.refusals import refuse_detached, refuse_new_trainable, refuse_outside_leaves
from dpclip.engine.reducer import Reducer, StageLink
from dpclip.engine.step_checks import StepChecks
from dpclip.engine.report import ClipDebug, StepReport
from dpclip.engine.spec import ClippingSpec
from dpclip.errors import EngineError

def _checked_step_arguments(expected_batch_size, sample_rate, gradient_noise_multiplier,
                            noise_multiplier, records_per_unit: int = 1) -> float:
    """σ_g of :class:`DPEngine`'s arguments (default 1), which are refused where out of range."""
    if isinstance(records_per_unit, bool) or not isinstance(records_per_unit, int) or records_per_unit < 1:
        raise EngineError(f"records_per_unit must be a positive integer, got {records_per_unit!r}",
                          "1 for example-level privacy; k (max_examples_per_user) at the user level")
    if isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, int) or expected_batch_size < 1:
        raise EngineError(f"expected_batch_size must be a positive integer, got {expected_batch_size!r}",
                          "the expected batch size B = q·N the noise is divided by, e.g. expected_batch_size=256")
    if sample_rate is not None and (isinstance(sample_rate, bool) or not 0 < sample_rate <= 1):
        raise EngineError(f"sample_rate must be in (0, 1], got {sample_rate!r}", "the Poisson rate q = B/N, e.g. 0.01")
    if gradient_noise_multiplier is not None and noise_multiplier is not None:
        raise EngineError("give gradient_noise_multiplier or noise_multiplier, not both",
                          "gradient_noise_multiplier=σ_g is the gradient's noise multiplier")
    sigma_g = gradient_noise_multiplier if noise_multiplier is None else noise_multiplier
    sigma_g = 1.0 if sigma_g is None else sigma_g
    if isinstance(sigma_g, bool) or not math.isfinite(sigma_g) or sigma_g < 0:  # True is no σ = 1; NaN: `< 0`
        raise EngineError(f"gradient_noise_multiplier must be a finite number ≥ 0, got {sigma_g!r}",
                          "σ_g comes from the accounting (dpclip.accounting.calibrate; make_private's target_epsilon)")
    return sigma_g


def _check_noise(sigma_g: float, policy: ThresholdPolicy, kind: str, sizes: Tensor, batch: int) -> None:
    """The noise allocation checked; refused before any step: a first noise std σ_g·S·w_k/B not finite."""
    thresholds = policy.sensitivity_thresholds()
    std = noise_stds(sigma_g, thresholds, allocation_weights(kind, thresholds, sizes)) / batch
    if not bool(torch.isfinite(std).all()):
        raise EngineError(f"the noise's std σ_g·C/B = {sigma_g:g}·{float(thresholds.max()):g}/{batch} is beyond "
                          f"{thresholds.dtype}'s range: no step could be released", "lower the clipping threshold (a "
                          "useful C is near the gradients' norms, e.g. 0.1 to 10) or the noise multiplier")


class DPEngine:
    """Differentially private gradients for ``model`` (see module doc and docs/engine.md).

    Args:
        model: any ``nn.Module``; build the engine after freezing what should stay frozen.
        clipping: a :class:`~dpclip.engine.spec.ClippingSpec`, or the same settings as a dict (missing keys
            and None values take :data:`~dpclip.engine.spec.CLIPPING_DEFAULTS`).
        gradient_noise_multiplier: σ_g, the gradient's noise multiplier (std / sensitivity). With a threshold
            policy that releases a statistic, the total σ_eff the accountant sees is smaller
            (``report.noise_multiplier``; docs/formulas.md).
        noise_multiplier: the total σ_eff, accepted only where it is σ_g (a threshold policy that releases
            nothing); otherwise an EngineError names ``gradient_noise_multiplier`` (the engine does no budget split).
        expected_batch_size: B; ``p.grad`` is divided by it, never by the realised size.
        seed: None (default): the noise generator's whole state comes from OS entropy. An int makes the noise
            reproducible, and so removable by anyone who knows the seed: for tests and experiments only
            (:mod:`dpclip.rng`).
        sample_rate: Poisson rate q; the report's DpEvent is then Poisson-subsampled.
        reducer: ranks sharing each logical batch (sums over ranks, noise once: :mod:`dpclip.engine.reducer`).
        stage: the other stages of a pipeline when ``model`` is one stage of it (:class:`~dpclip.engine.reducer.
            StageLink`; docs/distributed.md, "Pipeline stages"); an engine takes a reducer or a stage, not both.
        noise_correlation: banded matrix factorization's strategy coefficients c (b of them, Σc² = 1:
            :func:`dpclip.engine.correlated.banded_strategy`); the noise of a step is then C⁻¹z, correlated with
            the b - 1 steps before (docs/formulas.md, "Banded matrix factorization"); or a BLT strategy
            (:func:`dpclip.engine.blt.blt_strategy`), whose noise is correlated across all steps through k
            buffers (docs/formulas.md, "BLT"); None or one coefficient: DP-SGD's independent noise.
        records_per_unit: the most rows one privacy unit has in a step (``row_weights`` at the user level: k); a
            threshold policy whose bound depends on it (the discriminative top-fraction rule) noises for it.
        verify_every: the certificate (:mod:`dpclip.engine.certificate`) checks the engine's attribution against
            the samples' own gradients at the first step, on each new shape family of the batch and after
            :meth:`load_state_dict` (one row at each new batch size); N > 0 also every N steps.
    """

    def __init__(self, model: nn.Module, clipping: ClippingSpec | dict | None = None, *,
                 gradient_noise_multiplier: float | None = None, expected_batch_size: int,
                 seed: int | None = None, noise_multiplier: float | None = None,
                 sample_rate: float | None = None, reducer: Reducer | None = None,
                 stage: StageLink | None = None, noise_correlation: Tensor | None = None,
                 records_per_unit: int = 1, verify_every: int = 0):
        cfg = ClippingSpec.of(clipping)
        sigma_g = _checked_step_arguments(expected_batch_size, sample_rate, gradient_noise_multiplier,
                                          noise_multiplier, records_per_unit)
        self.model, self.clipping, self.expected_batch_size = model, cfg, expected_batch_size
        self.gradient_noise_multiplier = float(sigma_g)
        self.sample_rate, self.reducer, self.stage, self.steps = sample_rate, reducer, stage, 0
        self._sharded_names: set[str] | None = None   # adopt_parameters: trainable names (FSDP swaps the objects)

        params = trainable_params(model)
        self.groups: Groups = build_groups(model, cfg.grouping, params)
        self._params = [p.param for p in params]
        clip = make_clip_fn(cfg.fn, float(cfg.gamma))
        first = self._params[0]
        norm_dtype = torch.promote_types(first.dtype, torch.float32)
        self.policy = build_policy(cfg.threshold, PolicyContext(
            list(self.groups.names), self.groups.sizes, expected_batch_size,
            self.gradient_noise_multiplier, first.device, norm_dtype, records_per_unit))
        if noise_multiplier is not None and type(self.policy).release is not ThresholdPolicy.release:
            raise EngineError("noise_multiplier is the total σ_eff: with a threshold policy that releases a "
                              "statistic it is not the gradient's, and the engine does no budget split",
                              "pass gradient_noise_multiplier=σ_g (dpclip.accounting.split_noise gives it; "
                              "docs/engine.md)")
        self.policy.reducer = reducer
        sizes = torch.tensor(self.groups.sizes, device=first.device, dtype=norm_dtype)
        _check_noise(self.gradient_noise_multiplier, self.policy, cfg.noise_allocation, sizes, expected_batch_size)
        self.noise = NoiseSource(seed, getattr(reducer, "noise_stream", None))
        self.correlation = noise_streamer(noise_correlation)
        for device in {p.device for p in self._params}:  # made now, so that a step-0 checkpoint holds them
            self.noise.generator(device)

        self._keeper = Bookkeeper(model, {id(p): i for i, p in enumerate(self._params)}, strict=bool(cfg.strict))
        self.privatizer = privatizer_for(
            reducer, stage, self._params, self.groups.group_of, untied_padding_rows(self._keeper.units), self.noise,
            self.correlation, gradient_noise_multiplier=self.gradient_noise_multiplier,
            allocation=cfg.noise_allocation, sizes=sizes, expected_batch_size=expected_batch_size, device=first.device)
        context = _step_context(self, clip, norm_dtype, first.device)
        self._transient = context.transient
        self._keeper.install()
        self.certificate = Certificate(model, self._params, context.names, list(self.groups.group_of), clip,
                                       self._keeper.plain, self._keeper.is_plain,
                                       verify_every, silence=lambda on: setattr(self._keeper, "silent", on))
        self.forward_written_state = self.certificate.written_state   # (a live view: docs/certificate.md)
        if stage is not None:   # a stage's backward starts from the next stage's gradient (capture)
            self.certificate.disabled = "a pipeline stage's backward starts inside the model"
        self._step = StepAccumulator(context, self._keeper, 1.0 / expected_batch_size)
        self._checks = StepChecks(self.certificate, model, self._keeper, self._step, self.policy,
                                  1.0 / expected_batch_size)

    # --------------------------------------------------------------- properties

    @property
    def group_names(self) -> list[str]:
        return list(self.groups.names)

    @property
    def thresholds(self) -> Tensor:
        return self.policy.thresholds()

    @property
    def book_keeper(self) -> Bookkeeper:
        """The model's book-kept modules and their routing (:mod:`dpclip.engine.bookkeeping`)."""
        return self._keeper

    @property
    def step_accumulator(self) -> StepAccumulator:
        """The step in progress: its clipped sums, norms and counts so far (never release them)."""
        return self._step

    @property
    def stash_bytes(self) -> int:
        """Bytes the engine's stash holds now (activations, output grads, per-sample gradients to clip)."""
        return self._keeper.stash.current

    @property
    def stash_bytes_peak(self) -> int:
        """Peak of :attr:`stash_bytes` since construction or :meth:`reset_peak`."""
        return self._keeper.stash.peak

    def reset_peak(self) -> None:
        self._keeper.stash.reset_peak()

    def detach(self) -> None:
        """Give the model its original forwards back (unusable after: backward and privatize refuse)."""
        self._keeper.remove()
        self.certificate.remove()
        self.backward = self.privatize = refuse_detached   # raw gradients in p.grad, or noise alone, otherwise

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards and backwards inside run the model's own layers with ordinary autograd,
        outside the book-keeping: unclipped, un-noised gradients land in ``p.grad``, and second
        derivatives work. For public data only (continual pre-training's public gradients, the
        Hessian diagnostics; docs/hessian-diagnostics.md)."""
        with self._keeper.plain():
            yield

    def certify(self, run_losses, before: str = "training") -> CertificateRecord:
        """The certificate's check now, on rows of its own: ``run_losses()`` runs the model on a few
        rows and returns their per-sample losses [b]. Their clipped sums are thrown away; a mismatch
        raises EngineError. For a model no step can check (sharded next, or cut into pipeline
        stages: docs/certificate.md); ``before`` names what follows, for the report."""
        return self._checks.certify(run_losses, self.steps, before)

    def adopt_parameters(self, why_sealed: str) -> None:
        """Take the model's parameters as they are now: FSDP's ``fully_shard`` replaced each by
        a sharded one, under the same module and name. No probe may run after (``why_sealed``
        says why, in the refusal that asks for one), and no step can be checked: the whole model
        must have been, by :meth:`certify`."""
        self._checks.refuse_unchecked_sharding()
        adopted = self._keeper.adopt_current_parameters(why_sealed)
        missed = [self.groups.params[i].name for i in range(len(self._params)) if i not in adopted]
        if missed:
            raise EngineError(f"parameters {', '.join(missed[:3])} belong to no book-kept module, so the engine "
                              "cannot follow them when they are sharded", "freeze them, or use training.parallel: data")
        for idx, param in adopted.items():
            self._params[idx] = self.groups.params[idx].param = param
        self._sharded_names = {name for info in self.groups.params for name in info.names}
        self.certificate.disabled = why_sealed

    def __enter__(self) -> "DPEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # --------------------------------------------------------------- the step

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
        self.refuse_changed_parameters()
        if self._sharded_names is None:   # (a sharded model's leaves are FSDP's own unsharded parameters)
            refuse_outside_leaves(losses, self._params)
        if losses.shape[0] == 0:
            self._keeper.take_forward_counts()
            return
        weights = torch.full_like(losses, loss_scale)
        if samples is not None:
            weights[samples:] = 0
        watch = self._checks.watch(losses, samples, forwards)
        with self.capture(losses.shape[0], samples=samples, loss_scale=loss_scale, row_weights=row_weights,
                          _watch=None if watch is None else watch[0]):
            torch.autograd.backward(losses, weights)
        self.finish_micro_batch(_watch=watch)
        self.refuse_changed_parameters()   # (its checks may lose one: refusals.refuse_new_trainable)

    def refuse_changed_parameters(self) -> None:
        """Refuse a parameter trainable now that was not when the engine was built (stepped unclipped)."""
        refuse_new_trainable(self.model, self._params, self._sharded_names)

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
        self.refuse_changed_parameters()
        with self._step.capture(self.policy, batch_size, samples, generation, loss_scale, row_weights, _watch):
            yield

    def finish_micro_batch(self, _watch: tuple | None = None) -> None:
        """Clip the oldest micro-batch :meth:`capture` collected: per-sample norms (on a flat
        pipeline, summed over the stages first), clip factors, clipped sums; the policy observes.
        (``_watch``: the certificate's rows, cotangents and forwards, from :meth:`backward`.)"""
        micro, samples = self._step.oldest()
        if not self._checks.vouched():
            micro.discard()
            self._checks.refuse_unvouched()
        norms = self._step.finish(micro)[:samples]
        if _watch is not None:   # before the policy observes anything: a refusal stops here
            self._checks.check(self.steps, micro, norms, _watch)
        weights = micro.row_weights   # passed only when given: a policy may take the norms alone
        self.policy.observe(norms) if weights is None else self.policy.observe(norms, weights[:samples])
        self._step.record(micro, norms, samples)

    def privatize(self) -> StepReport:
        """Noise the accumulated clipped sums, write ``p.grad``, return the report.

        Group k's summed clipped gradient gets N(0, (σ_g·S·w_k)²) (see
        :mod:`dpclip.engine.noise`); then ``p.grad = (sum + noise) / B`` with B the
        EXPECTED batch size. The policy releases its statistics after the noise
        (:mod:`dpclip.engine.privatizer`, one per parallel mode). A call that raises releases
        nothing and leaves nothing of its step (:meth:`Privatizer.all_or_nothing`).
        """
        if self._step.captured:
            raise EngineError("privatize with a captured micro-batch not finished", "call finish_micro_batch first")
        self._checks.refuse_unvouched()
        with self.privatizer.all_or_nothing(self.policy, self._step):   # a release that raised leaves nothing
            report = self.privatizer.release(self.policy, self._step, sample_rate=self.sample_rate,
                                             counts_clipped=self.clipping.fn != "auto", group_names=self.group_names)
            report.certificate = self.certificate.unreported()   # the last check's record, in one report only
        self.steps += 1
        self.certificate.step = self.steps
        self._step.reset()
        return report

    def debug_clipped(self) -> ClipDebug:
        """For tests and debugging only (never release it): the step's clipped sums without
        noise, the per-sample group norms and each parameter's norm path (:class:`ClipDebug`).
        Ends the step like :meth:`privatize` but draws no noise, charges nothing, moves no
        threshold and leaves ``p.grad`` alone."""
        if self._step.captured:
            raise EngineError("debug_clipped with a captured micro-batch not finished",
                              "call finish_micro_batch first")
        if type(self.policy).observe is not ThresholdPolicy.observe:  # observations would leak into a release
            raise EngineError("debug_clipped needs a threshold policy that releases nothing",
                              "use clipping.threshold {kind: fixed} while debugging")
        result = self._step.debug(self.group_names, self.expected_batch_size)
        self._step.reset()
        return result

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Policy state and the noise generators' states (a secret: see :class:`NoiseSource`)."""
        state = {"policy": self.policy.state_dict(), "noise": self.noise.state_dict(), "steps": self.steps,
                 "forward_written_state": sorted(self.forward_written_state)}
        if self.correlation is not None:  # the last b - 1 noises or BLT's buffers: as secret as the generators
            state["correlation"] = self.correlation.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.certificate.reset(state.get("forward_written_state", ()))   # checked again at its first step
        self.policy.load_state_dict(state["policy"])
        self.noise.load_state_dict(state["noise"])
        self.steps = int(state.get("steps", 0))
        if self.correlation is not None:
            if "correlation" not in state:
                raise EngineError("the checkpoint holds no correlated-noise history, and this engine correlates its "
                                  "noise (banded MF or BLT)", "resume with the mechanism the run was trained with")
            self.correlation.load_state_dict(state["correlation"])
        self.privatizer.lost_noise = None


def _step_context(engine: DPEngine, clip, norm_dtype: torch.dtype, device: torch.device) -> StepContext:
    """What every micro-batch of ``engine`` needs, fixed when it is built. A group is transient
    (finalized as soon as its own backward is done) where one module uses all of it and the policy
    needs no other group's norm first; on a flat pipeline stage none is: nothing can be clipped
    before the other stages' norms arrive."""
    count = len(engine._params)
    transient = ([False] * count if engine.policy.per_sample
                 else sole_user_groups(engine._keeper.units, engine.groups.members, count))
    flat_stage = engine.stage is not None and engine.stage.flat
    if flat_stage:
        transient = [False] * count
    return StepContext(
        params=engine._params, names=[info.name for info in engine.groups.params],
        group_of=list(engine.groups.group_of), members=[list(m) for m in engine.groups.members],
        transient=transient, norm_method=engine.clipping.norm_method, clip=clip,
        count_clipped=engine.clipping.fn != "auto", norm_dtype=norm_dtype,
        device=device, meter=engine._keeper.stash,
        exchange_norm_sq=engine.stage.sum_norm_sq if flat_stage else None)
