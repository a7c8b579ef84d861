"""The certificate's part in the engine's steps (docs/certificate.md).

The certificate (:mod:`dpclip.engine.certificate`) vouches for the engine's attribution: at the
first step, on each new shape family of the batch (one row at each new batch size), after a
resume and every ``verify_every`` steps, the clipped sums of a few watched rows of a micro-batch are checked against those rows'
own gradients. :class:`StepChecks` is where the engine's step meets it: the watched rows of a
micro-batch, the check once the micro-batch's norms are known, the dry micro-batch of a check on
rows of its own (:mod:`dpclip.engine.certificate.dry`), and the refusal of any release from a
model that no check could vouch for.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from dpclip.engine.accumulator import StepAccumulator
from dpclip.engine.bookkeeping import Bookkeeper
from dpclip.engine.certificate import Certificate, CertificateRecord, NotReproducible
from dpclip.engine.certificate.dry import check_before, check_in_eval_mode
from dpclip.engine.microbatch import MicroBatch
from dpclip.engine.policies import ThresholdPolicy
from dpclip.errors import EngineError


class StepChecks:
    """The certificate's checks of one engine's steps. ``scale``: 1/B, the sums' scale."""

    def __init__(self, certificate: Certificate, model: nn.Module, keeper: Bookkeeper, step: StepAccumulator,
                 policy: ThresholdPolicy, scale: float):
        self.certificate, self.model, self.keeper = certificate, model, keeper
        self.step, self.policy, self.scale = step, policy, scale

    def watch(self, losses: Tensor, samples: int | None, forwards: list) -> tuple | None:
        """(rows, cotangents, forwards) of the rows a check watches in this micro-batch (taken before
        its graph is freed), or None: no check is due, or the micro-batch holds padding only."""
        if forwards and (samples is None or samples > 0):
            rows = self.certificate.rows(losses.shape[0] if samples is None else samples)
            return rows, self.certificate.cotangents(losses, rows, forwards, samples), forwards
        return None

    def check(self, steps: int, micro: MicroBatch, norms: Tensor, watch: tuple) -> None:
        """The check of ``micro``'s watched rows (its witness sums against the rows' own gradients),
        replayed in eval mode where the step cannot be reproduced; a mismatch raises."""
        rows, cots, forwards = watch
        self.certificate.step = steps
        try:
            self.certificate.check(steps, forwards, rows, cots, norms, micro.witness, micro.used_thresholds,
                                   micro.row_weights, self.scale, micro.cancelling)
        except NotReproducible:
            check_in_eval_mode(self.certificate, self.model, forwards, rows, cots,
                               lambda losses, watched: self.dry_micro_batch(losses, watched, micro.row_weights),
                               steps, self.scale, micro.row_weights)
        micro.witness.clear()

    def certify(self, run_losses: Callable[[], Tensor], steps: int, before: str) -> CertificateRecord:
        """``DPEngine.certify``: the check on rows of its own, whose sums are thrown away."""
        try:
            return check_before(self.certificate, self.model, run_losses,
                                lambda losses, rows: self.dry_micro_batch(losses, rows, None),
                                steps, self.scale, before)
        except BaseException:   # a refused check leaves no forward behind for the next step
            self.certificate.take(-1)
            self.keeper.take_forward_counts()
            raise

    def dry_micro_batch(self, losses: Tensor, rows: list[int], row_weights: Tensor | None) -> tuple:
        """:meth:`StepAccumulator.dry_micro_batch` at the policy's thresholds."""
        return self.step.dry_micro_batch(self.policy, losses, rows, row_weights)

    def vouched(self) -> bool:
        """False for an engine whose steps cannot be checked and whose model never was, whole."""
        return self.certificate.disabled is None or self.certificate.last is not None

    def refuse_unvouched(self) -> None:
        """Raise unless :meth:`vouched`: nothing of the sums of a model never checked may leave,
        with noise or not."""
        if self.vouched():
            return
        raise EngineError(f"this engine's steps cannot be checked ({self.certificate.disabled}) and its "
                          "model was never checked whole", "build pipeline stages with "
                          "dpclip.distributed.pipeline.pipeline_engine, which checks the whole model first")

    def refuse_unchecked_sharding(self) -> None:
        """Raise before a model is sharded unchecked: no step of it could be checked after."""
        if self.certificate.checks == 0:
            raise EngineError("the model is about to be sharded but the certificate never checked it whole, "
                              "so no step of it could be vouched for",
                              "call engine.certify(lambda: per-sample losses of a few training rows) before "
                              "sharding (docs/distributed.md, \"Sharded training\")")
