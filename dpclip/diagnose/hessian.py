"""Second-order quantities of the training loss, and what the pre-training paper derives from them.

Bu et al., "Pre-training differentially private models with limited public data" (the
**pre-training** paper of docs/formulas.md), model one step of DP-SGD,
``g = (Σ_i C_i g_i + σ N(0, I)) / B ≈ (c Σ_i g_i + σ N(0, I)) / B`` (their eq. (2), the
clipped sum having sensitivity 1), by the second-order expansion of the loss. With G the
mean gradient, H the Hessian of the mean loss and Σ the covariance of per-sample
gradients, the best per-sample improvement of one step over the learning rate is

    ΔL*(B) = ½ |G|⁴ / (B·GᵀHG + tr(HΣ) + σ²·tr(H)/(B·c²))        (eq. (6); σ = 0: eq. (7))

whose last term is the **decelerator** (eq. (8)). :func:`measure` estimates the four
quantities (tr(H) with Hutchinson's estimator), :class:`HessianDiagnostics` evaluates the
formulas. docs/hessian-diagnostics.md explains them; docs/formulas.md lists them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from dpclip.errors import EngineError
from dpclip.rng import entropy_generator

__all__ = ["HessianDiagnostics", "measure", "typical_clip_factor"]


@dataclass(frozen=True)
class HessianDiagnostics:
    """What :func:`measure` found on one batch, and the paper's formulas evaluated on it.

    ``clip_factor`` (c) in the methods is the typical per-sample clipping factor in the
    paper's normalisation: the clipped sum has sensitivity 1 and its noise std is σ. dpclip
    clips to a threshold C and noises with σ·C, which is the same update divided by C, so c
    is the factor dpclip applies divided by C (the learning rate absorbs the scale, and
    ΔL* is maximised over it). :func:`typical_clip_factor` gives the plug-in values:
    abadi clipping, c = min(1/C, 1/sqrt(E‖g_i‖²)); AUTO / normalised clipping,
    c = 1/(sqrt(E‖g_i‖²) + γ) (the paper's 1/c² ≈ E‖g_i‖², eq. (8)). With several clipping
    groups, C is the total sensitivity sqrt(Σ_k C_k²).
    """

    trace_h: float            # Hutchinson tr(H) of the mean loss over the batch
    trace_h_stderr: float     # standard error of that estimate: sample std of vᵀHv / sqrt(k)
    gthg: float               # GᵀHG, G = mean gradient over the batch
    trace_h_sigma: float      # tr(HΣ), Σ = covariance of per-sample gradients (over a subsample)
    grad_norm_sq: float       # |G|²
    mean_sample_grad_norm_sq: float  # E_i ‖g_i‖² over the subsample
    batch_size: int           # rows the Hessian and G were measured on
    probes: int               # Hutchinson probes k
    per_sample: int = 0       # rows of the per-sample subsample (tr(HΣ), E‖g_i‖²)

    def decelerator(self, gradient_noise_multiplier: float, batch_size: int, clip_factor: float) -> float:
        """σ²·tr(H) / (B·c²), eq. (8): the term DP adds to the denominator of eq. (6)."""
        return gradient_noise_multiplier ** 2 * self.trace_h / (batch_size * clip_factor ** 2)

    def improvement(self, batch_size: int, gradient_noise_multiplier: float, clip_factor: float) -> float:
        """ΔL*(B) = ½|G|⁴ / (B·GᵀHG + tr(HΣ) + σ²tr(H)/(B c²)), eq. (6); σ = 0, c = 1 gives eq. (7).

        ``inf`` where the denominator is not positive: the second-order model then has no
        best learning rate (the loss is not locally convex along the update)."""
        denominator = (batch_size * self.gthg + self.trace_h_sigma
                       + self.decelerator(gradient_noise_multiplier, batch_size, clip_factor))
        if not denominator > 0:
            return math.inf if math.isfinite(denominator) else math.nan
        return 0.5 * self.grad_norm_sq ** 2 / denominator

    def b_star_dp(self, gradient_noise_multiplier: float, clip_factor: float) -> float:
        """B*_DP = sqrt(σ²·tr(H) / (c²·GᵀHG)) (appendix A.4, Remark 3.2).

        It minimises B·GᵀHG + σ²tr(H)/(Bc²), the only part of eq. (6)'s denominator that
        depends on B, so it maximises ΔL*(B) exactly (within the second-order model).
        ``inf`` when GᵀHG ≤ 0 < σ²tr(H) (larger batches always help), ``nan`` when the
        model has no interior optimum (tr(H) < 0, or both terms vanish)."""
        a = self.gthg
        d = gradient_noise_multiplier ** 2 * self.trace_h / clip_factor ** 2
        if a > 0 and d >= 0:
            return math.sqrt(d / a)
        if a <= 0 < d:
            return math.inf
        return math.nan

    def alpha_star(self, public_batch_size: int, private_batch_size: int, gradient_noise_multiplier: float,
                   clip_factor: float) -> float:
        """The best weight of the public gradient when mixing, eq. (10) (subscript 0 public, 1 private):

            α* = ( (1/c)·tr(HΣ)·(B₁/B₀) / (tr(HΣ) + σ²·tr(H)/(B₁·c²)) + 1 )⁻¹

        for the mixed gradient g_α = α/B₀·Σ_public g_j + (1 − α)/B₁·(Σ_private C_i g_i + σN)."""
        b0, b1, c = public_batch_size, private_batch_size, clip_factor
        noisy = self.trace_h_sigma + gradient_noise_multiplier ** 2 * self.trace_h / (b1 * c ** 2)
        if noisy == 0:
            return math.nan
        return 1.0 / ((1.0 / c) * self.trace_h_sigma * (b1 / b0) / noisy + 1.0)

    def to_dict(self) -> dict:
        return asdict(self)


def typical_clip_factor(diag: HessianDiagnostics, fn: str | None, threshold: float, gamma: float = 0.0) -> float:
    """The plug-in c of :class:`HessianDiagnostics` for dpclip's clip functions.

    ``threshold`` is C, the clipped sum's sensitivity (sqrt(Σ_k C_k²) over groups); ``fn``
    is the recipe's ``clipping.fn``:

    - ``"abadi"``: dpclip's factor min(1, C/‖g_i‖) over the noise scale C, with ‖g_i‖
      replaced by its root mean square: c = min(1/C, 1/sqrt(E‖g_i‖²));
    - ``"auto"``: C/(‖g_i‖ + γ) over C: c = 1/(sqrt(E‖g_i‖²) + γ) (the paper's AUTO
      clipping, 1/c² ≈ E‖g_i‖², eq. (8));
    - ``None``: no clipping and no noise (non-private SGD, Remark 2.2): c = 1.

    Group-wise clipping is summarised by this all-layer plug-in (an approximation, as c
    itself is: the paper's c ≈ E[C_i] assumes little clipping bias, its section 2)."""
    if fn is None:
        return 1.0
    if not threshold > 0:
        raise EngineError(f"the clipping threshold must be positive, got {threshold!r}", None)
    rms = math.sqrt(max(diag.mean_sample_grad_norm_sq, 0.0))
    if fn == "abadi":
        return 1.0 / threshold if rms == 0 else min(1.0 / threshold, 1.0 / rms)
    if fn == "auto":
        return math.inf if rms + gamma == 0 else 1.0 / (rms + gamma)
    raise EngineError(f"unknown clip function {fn!r}", "use 'abadi' or 'auto'")


# --------------------------------------------------------------------------- measuring

@contextmanager
def _math_attention():
    """Attention through the math kernel: the fused CPU/CUDA kernels have no double backward
    ("derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
    implemented"), and a Hessian-vector product needs one."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch: nothing to select
        yield
        return
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _rows(rows: dict[str, Tensor], index) -> dict[str, Tensor]:
    return {name: tensor[index] for name, tensor in rows.items()}


def _batch_len(rows: dict[str, Tensor]) -> int:
    lengths = {len(t) for t in rows.values() if isinstance(t, Tensor) and t.dim() > 0}
    if len(lengths) != 1:
        raise EngineError(f"the rows' tensors disagree on the batch size ({sorted(lengths)})",
                          "pass a dict of tensors with one row per example")
    return lengths.pop()


def _dot(a: list[Tensor], b: list[Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def _rademacher(params: list[Tensor], generator: torch.Generator) -> list[Tensor]:
    """±1 entries, each with probability ½ (lower variance than Gaussian probes: the
    estimator's variance is 2·Σ_{i≠j} H_ij² instead of 2·‖H‖_F²)."""
    draws = []
    for p in params:
        bits = torch.randint(0, 2, p.shape, generator=generator, device=generator.device)
        draws.append((bits.to(device=p.device, dtype=p.dtype) * 2 - 1))
    return draws


def measure(model: nn.Module, loss_fn: Callable, rows: dict[str, Tensor], *, probes: int = 20,
            per_sample: int = 16, generator: torch.Generator | None = None) -> HessianDiagnostics:
    """Measure tr(H), GᵀHG, tr(HΣ), |G|² and E‖g_i‖² of ``model`` on ``rows``.

    ``loss_fn(model, rows)`` returns per-example losses (shape [B]), as dpclip's losses do;
    the objective is their mean over ``rows`` and only parameters with ``requires_grad``
    count. Hessian-vector products are double backwards (ordinary autograd: call this with
    no DPEngine routing the forwards, e.g. inside ``DPEngine.paused()``).

    - tr(H): Hutchinson, (1/k)·Σ_j v_jᵀHv_j over ``probes`` = k Rademacher vectors; the
      standard error is the sample std of the v_jᵀHv_j over sqrt(k);
    - GᵀHG and |G|²: G the mean gradient over ``rows``, one Hessian-vector product;
    - tr(HΣ) = (1/(n−1))·Σ_i (g_i − ḡ)ᵀH(g_i − ḡ) over ``per_sample`` = n rows drawn from
      ``rows`` (ḡ their mean; divided by n − 1, the unbiased estimate of tr(HΣ) for
      this H), one backward and one Hessian-vector product per row; E‖g_i‖² over the same rows.

    The model's mode is kept as given: in training mode dropout draws a new mask in every
    forward, so the measured H is that of one random mask (the per-sample gradients see
    others); ``dpclip diagnose`` and the in-training recorder measure in eval mode.
    ``generator`` draws the probes and the subsample (default: OS entropy).
    """
    if probes < 2:
        raise EngineError(f"probes must be at least 2 (a standard error needs two), got {probes}", None)
    if per_sample < 2:
        raise EngineError(f"per_sample must be at least 2 (a covariance needs two rows), got {per_sample}", None)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise EngineError("the model has no trainable parameters", "unfreeze what the diagnostics should measure")
    batch = _batch_len(rows)
    if batch < 2:
        raise EngineError(f"the Hessian diagnostics need at least 2 rows, got {batch}", None)
    generator = entropy_generator() if generator is None else generator
    n = min(per_sample, batch)
    chosen = torch.randperm(batch, generator=generator, device=generator.device)[:n].cpu()

    with torch.enable_grad(), _math_attention():
        samples = [_gradient(model, loss_fn, _rows(rows, chosen[i: i + 1]), params)
                   for i in range(n)]
        losses = loss_fn(model, rows)
        if losses.dim() != 1 or len(losses) != batch:
            raise EngineError(f"loss_fn must return one loss per example (shape [{batch}]), "
                              f"got {tuple(losses.shape)}", "compute the loss with reduction='none'")
        grads = torch.autograd.grad(losses.mean(), params, create_graph=True, allow_unused=True)
        hvp = _hessian_vector_product(grads, params)
        gradient = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]

        quadratic = [_dot(v, hvp(v)) for v in (_rademacher(params, generator) for _ in range(probes))]
        gthg = _dot(gradient, hvp(gradient))
        mean = [torch.stack([s[j] for s in samples]).mean(dim=0) for j in range(len(params))]
        spread = 0.0
        for sample in samples:
            centred = [g - m for g, m in zip(sample, mean)]
            spread += _dot(centred, hvp(centred))

    values = torch.tensor(quadratic, dtype=torch.float64)
    return HessianDiagnostics(
        trace_h=float(values.mean()),
        trace_h_stderr=float(values.std(unbiased=True) / math.sqrt(probes)),
        gthg=gthg,
        trace_h_sigma=spread / (n - 1),
        grad_norm_sq=_dot(gradient, gradient),
        mean_sample_grad_norm_sq=sum(_dot(s, s) for s in samples) / n,
        batch_size=batch,
        probes=probes,
        per_sample=n,
    )


def _gradient(model, loss_fn, rows, params) -> list[Tensor]:
    """The gradient of one example's loss, detached; zeros for parameters it does not use."""
    losses = loss_fn(model, rows)
    grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]


def _hessian_vector_product(grads, params) -> Callable[[list[Tensor]], list[Tensor]]:
    """v ↦ Hv by differentiating (∇L)ᵀv once more (the gradient graph is kept for every product).

    Gradient entries that do not depend on the parameters (a loss linear in them) are
    constant: their rows of H are zero."""
    live = [j for j, g in enumerate(grads) if g is not None and g.requires_grad]

    def product(vector: list[Tensor]) -> list[Tensor]:
        out = [torch.zeros_like(p) for p in params]
        if not live:
            return out
        second = torch.autograd.grad([grads[j] for j in live], params, grad_outputs=[vector[j] for j in live],
                                     retain_graph=True, allow_unused=True)
        return [o if s is None else s.detach() for o, s in zip(out, second)]

    return product
