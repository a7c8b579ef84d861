"""The certificate on a dry micro-batch: in eval mode, for a forward that draws random numbers the
replay cannot reproduce (:func:`check_in_eval_mode`), and on rows of its own before training, where
no step can be checked (:func:`check_before`: a model about to be sharded, or cut into stages).

A layer rule may draw its dropout in another order than the module's own forward
(``nn.MultiheadAttention``'s rule recomputes the attention with torch's operations; the module
itself calls the fused kernel): replayed from the same RNG state, the plain forward then gives
other outputs than the step's. The check then runs on the same inputs with the model in eval
mode (no dropout): the engine's book-kept forward and backward of surrogate per-sample losses
L_i = Σ_o ⟨cot_{i,o}, o⟩ (the checked rows' cotangents from the real step), its norms and witness
sums against each row's own gradient replayed alone. The dry micro-batch's sums are thrown away,
no threshold policy sees its norms, and the module's training flags are put back.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from dpclip.engine.batch_axis.layout import tensor_leaves
from dpclip.engine.certificate import Certificate, CertificateRecord, Forward, NotReproducible
from dpclip.engine.certificate.replay import copied
from dpclip.errors import EngineError


def check_in_eval_mode(cert: Certificate, model: nn.Module, forwards: list[Forward], rows: list[int], cots: dict,
                       micro_batch: Callable[[Tensor, list[int]], tuple], step: int, scale: float,
                       row_weights: Tensor | None) -> None:
    """``micro_batch(losses, rows)``: the engine's backward of ``losses`` on a scratch micro-batch
    watching ``rows``, returning (norms [b, K], witness, thresholds used, cancelling groups per row)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    cert.suspended = True
    batch = forwards[0].batch
    devices = sorted({p.device.index or 0 for p in cert.params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            dry, terms = [], {r: [] for r in rows}
            for j, f in enumerate(forwards):
                args, kwargs = copied((f.args, f.kwargs)) if f.written else (f.args, f.kwargs)   # (replay.py)
                outs = [t for t in tensor_leaves(model(*args, **kwargs)) if t.requires_grad][:len(f.outputs)]
                dry.append(Forward(f.args, f.kwargs, batch, f.rng, f.autocast, outs, written=f.written))
                for r in rows:
                    terms[r] += [(o * c.to(o.dtype)).sum() for o, c in zip(outs, cots[r][j]) if c is not None]
            zero = torch.zeros((), device=cert.params[0].device)
            losses = torch.stack([torch.stack(terms[r]).sum() if terms.get(r) else zero for r in range(batch)])
            norms, witness, thresholds, cancelling = micro_batch(losses, rows)
            cert.check(step, dry, rows, cots, norms, witness, thresholds, row_weights, scale, cancelling, mode="eval")
    finally:
        for m, training in modes:
            m.training = training
        cert.suspended = False


def check_before(cert: Certificate, model: nn.Module, run_losses: Callable[[], Tensor],
                 micro_batch: Callable[[Tensor, list[int]], tuple], step: int, scale: float,
                 before: str) -> CertificateRecord:
    """The check on a micro-batch of its own: ``run_losses()`` runs the model's forward on some rows
    and returns their per-sample losses [b]; the backward goes into scratch sums (``micro_batch``, as
    for :func:`check_in_eval_mode`) that are thrown away. For what no step of the run can check: a
    sharded model's ranks cannot replay a sample alone, a pipeline stage's backward starts inside the
    model (docs/certificate.md). ``before``: what comes after, for the report."""
    kept = cert.families, cert.last_step
    cert.families, cert.last_step = set(), None   # due whatever the rows' shape
    try:
        with torch.enable_grad():
            losses = run_losses()
        if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] == 0:
            raise EngineError("the certificate's check before training needs one loss per row (shape [b], b ≥ 1)",
                              "return per-sample losses (reduction='none') of at least one row")
        forwards = cert.take(losses.shape[0])
        if not forwards:
            raise EngineError("the certificate's check before training saw no forward of the model",
                              "compute the losses by calling the model the engine was built on")
        rows = cert.rows(losses.shape[0])
        cots = cert.cotangents(losses, rows, forwards)
        norms, witness, thresholds, cancelling = micro_batch(losses, rows)
        try:
            cert.check(step, forwards, rows, cots, norms, witness, thresholds, None, scale, cancelling)
        except NotReproducible:
            check_in_eval_mode(cert, model, forwards, rows, cots, micro_batch, step, scale, None)
    except BaseException:
        cert.families, cert.last_step = kept
        raise
    cert.last.before = before
    return cert.last
