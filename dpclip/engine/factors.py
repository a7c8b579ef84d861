"""Factor math: per-sample gradient norms and clipped sums from (activation, output gradient).

Everything here is pure tensor math on what one backward pass hands over; capturing
those tensors is :mod:`dpclip.engine.bookkeeping`'s job, and turning one layer's tensors
into :class:`Bilinear` / :class:`Dense` uses is its layer rule's (:mod:`dpclip.engine.layers`).

Length: a little over 400 lines, because it is the one home of the norm math of a
parameter's uses, and splitting the cross terms from the norms they feed would scatter one
derivation (the Gram matrices themselves are in :mod:`dpclip.engine.grams`).

How a per-sample gradient is represented
----------------------------------------
Almost every parameter of a modern network enters it bilinearly. For one sample the
gradient of such a parameter, viewed as a ``(g·m, n)`` matrix (``g`` blocks of ``m``
rows; ``g > 1`` only for grouped convolutions), is

    G_i = [ L_{i,1}ᵀ R_{i,1} ; ... ; L_{i,g}ᵀ R_{i,g} ],   L_{i,j}: T x m,  R_{i,j}: T x n

(groupwise-clipping paper §2.2, eq. (3); docs/layer-rules.md). A :class:`Bilinear` *use* keeps
the factors ``L`` and ``R`` instead of ``G``:

=====================  ===================  =================  ==================
layer                  parameter view       L (T x m)          R (T x n)
=====================  ===================  =================  ==================
nn.Linear (p x d)      weight (p, d)        output grad b      input a
transformers Conv1D    weight (d, p)        input a            output grad b
nn.Conv{1,2}d          weight (out, in/g·k) output grad        unfolded input
nn.Embedding (V x d)   weight (V, d)        one-hot(ids)       output grad b
MHA in_proj (3E x E)   in_proj_weight       output grad of     input a
                                            q/k/v (0 elsewhere)
=====================  ===================  =================  ==================

One-hot factors are never materialised: a Bilinear use may carry integer ``ids``
instead of a dense ``L``. Small parameters (biases, norm affines, anything the
torch.func rule handles) arrive already instantiated as a :class:`Dense` use.

A parameter may have several uses: a module called twice, or one tensor shared by two
modules (GPT-2 ties ``wte`` and ``lm_head``). Its per-sample gradient is the sum of its
uses and its norm needs every cross term, ``||Σ_u G_u||² = Σ_{u,v} <G_u, G_v>``.
:func:`param_norm_sq` computes exactly that; nothing is ever dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dpclip.engine.grams import GHOST_MAX_STRIPS, GHOST_MIN_BLOCK, GramCache, symmetric_ghost, ghost_strips  # noqa: F401
from dpclip.engine.sums import as_rows, batched_dot, sum_of_squares
from dpclip.engine.precision import widened
from dpclip.engine.spec import NORM_METHODS  # noqa: F401 (re-exported)
from dpclip.errors import EngineError



# --------------------------------------------------------------------------- uses


@dataclass
class Bilinear:
    """Per-sample gradient G_i = L_iᵀ R_i of one use of a parameter (see module doc).

    ``left`` is dense ``[B, g, T, m]`` or, when ``vocab`` is set, integer ids ``[B, T]``
    standing for one-hot rows of width ``vocab``. ``right`` is ``[B, g, T, n]``.
    """

    left: Tensor
    right: Tensor
    vocab: int | None = None

    @property
    def is_ids(self) -> bool:
        return self.vocab is not None

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.left, self.right)


@dataclass
class Dense:
    """An instantiated per-sample gradient ``[B, *param.shape]``."""

    grad: Tensor

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.grad,)


Use = Bilinear | Dense


def widened_use(use: Use, dtype: torch.dtype) -> Use:
    """``use`` with its half-precision float factors in ``dtype`` (ids stay integers)."""
    if isinstance(use, Dense):
        grad = widened(use.grad, dtype)
        return use if grad is use.grad else Dense(grad)
    left, right = (use.left if use.is_ids else widened(use.left, dtype)), widened(use.right, dtype)
    return use if left is use.left and right is use.right else Bilinear(left, right, use.vocab)


# ------------------------------------------------------------- norm² of one bundle


def ghost_norm_sq(left: Tensor, right: Tensor) -> Tensor:
    """||Σ_t L_tᵀ R_t||_F² per sample without forming the gradient ("ghost norm").

    ||G||_F² = Σ_{t,s} (L Lᵀ)_{ts} (R Rᵀ)_{ts}  (docs/layer-rules.md; Li et al. 2021 via the
    groupwise-clipping paper §2.2). Cost O(T²(m+n)) (5/8 of it at T ≥ 128: both Grams are
    symmetric, see :func:`symmetric_ghost`), memory O(T²). Shapes ``[B, g, T, m]`` and
    ``[B, g, T, n]`` -> ``[B]`` (blocks summed).
    """
    return symmetric_ghost(left, right, False)[0].sum(1)


def atom_sizes(use: Use, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per sample: (D, M) = (Σ_t ||G_t||², Σ_t ||G_t||) over the atoms of ``use``.

    A Bilinear use's atoms are its positions' rank-one terms G_t = L_tᵀR_t, with
    ||G_t|| = ||L_t||·||R_t|| (a one-hot row has norm 1); a Dense gradient is one atom.
    Both are sums of non-negative terms, so they carry no cancellation themselves; by
    the triangle inequality ||G|| ≤ M (docs/formulas.md, "Cancellation")."""
    if isinstance(use, Dense):
        size = torch.linalg.vector_norm(as_rows(use.grad), dim=1, dtype=dtype)
        return size.square(), size
    right = torch.linalg.vector_norm(use.right, dim=-1, dtype=dtype)          # [B, g, T]
    if use.is_ids:
        size = right[:, 0]
    else:
        size = torch.linalg.vector_norm(use.left, dim=-1, dtype=dtype) * right
    size = size.flatten(1)
    return size.square().sum(1), size.sum(1)


def _scatter_rows(rows: Tensor, index: Tensor, num: int) -> Tensor:
    """out[v] = Σ_{j: index_j = v} rows_j, shape [num, n].

    The embedding's own backward kernel, what autograd itself uses: deterministic on CUDA,
    where ``index_add_`` is not."""
    return torch.ops.aten.embedding_dense_backward(rows, index, num, -1, False)


def instantiate(use: Bilinear) -> Tensor:
    """G_i = L_iᵀ R_i for every sample, ``[B, g, m, n]``. Cost O(T·m·n) per sample."""
    if use.is_ids:
        ids, r = use.left, use.right[:, 0]
        batch, t, n = r.shape
        # One flat scatter for the whole batch: row (i, v) of a [B·V, n] buffer.
        flat = (ids + torch.arange(batch, device=ids.device).unsqueeze(1) * use.vocab).reshape(-1)
        out = _scatter_rows(r.reshape(batch * t, n), flat, batch * use.vocab)
        return out.view(batch, 1, use.vocab, n)
    return use.left.transpose(-1, -2) @ use.right


# ------------------------------------------------------------------ cross terms


def _cross_ids_dense(ids_use: Bilinear, dense_use: Bilinear) -> Tensor:
    """<onehot(x)ᵀ R_e, Lᵀ R> per sample = Σ_{t,s} L[s, x_t] <R_e[t], R[s]>.

    This is docs/layer-rules.md's exact tied-embedding cross term
    2·Σ_{t,s} b^h[s, x_t]·<b^e_t, h_s> (without the factor 2): the head's output grad
    b^h plays L, its input h plays R. Cost O(T_e·T_h·n); never forms V x n matrices.
    """
    if dense_use.left.shape[1] != 1:
        raise EngineError("a parameter is shared between an embedding and a grouped convolution",
                          "untie the parameters")
    ids, r_e = ids_use.left, ids_use.right[:, 0]
    left, r_h = dense_use.left[:, 0], dense_use.right[:, 0]
    index = ids.unsqueeze(1).expand(-1, left.shape[1], -1)
    gathered = torch.gather(left, 2, index)                       # [B, T_h, T_e]
    inner = r_h @ r_e.transpose(-1, -2)                           # [B, T_h, T_e]
    return batched_dot(gathered, inner)


def _cross_bilinear_dense(use: Bilinear, grad: Tensor) -> Tensor:
    """<L_iᵀ R_i, D_i> per sample, with D an instantiated gradient ``[B, g, m, n]``."""
    if use.is_ids:
        r = use.right[:, 0]
        rows = torch.gather(grad[:, 0], 1, use.left.unsqueeze(-1).expand(-1, -1, r.shape[-1]))
        return (rows * r).sum(dim=(1, 2))
    return ((use.left @ grad) * use.right).sum(dim=(1, 2, 3))


# ------------------------------------------------------------------ param level


def concat_uses(uses: list[Bilinear]) -> Bilinear:
    """Calls of one factor kind concatenate along T: Σ_u L_uᵀR_u = [L_1;L_2]ᵀ[R_1;R_2]."""
    if len(uses) == 1:
        return uses[0]
    if len({u.left.shape[1] for u in uses if not u.is_ids}) > 1:
        raise EngineError("one parameter is used with different convolution groups", None)
    if uses[0].is_ids:
        return Bilinear(torch.cat([u.left for u in uses], dim=1),
                        torch.cat([u.right for u in uses], dim=2), uses[0].vocab)
    return Bilinear(torch.cat([u.left for u in uses], dim=2),
                    torch.cat([u.right for u in uses], dim=2))


def numel_per_sample(use: Bilinear) -> tuple[int, int]:
    """(numel of one instantiated G_i, numel of its stored factors L_i and R_i)."""
    g, n = use.right.shape[1], use.right.shape[3]
    m = use.vocab if use.is_ids else use.left.shape[3]
    return g * m * n, use.left.shape[1:].numel() + use.right.shape[1:].numel()   # no views made


# How much larger than its factors a transient G_i may be and still be instantiated
# (:func:`choose_ghost`). On the CPU, where :mod:`dpclip.engine.streamed` forms a large G_i
# one sample at a time in a buffer that stays in cache, instantiation measured faster than
# the ghost norm up to m·n = 2.4·T(m+n) (GPT-2 small's MLP weights at B 4, T 256: 17.0 and
# 17.5 ms against 18.0 and 18.2; ghost faster from 3.0 on: benchmarks/norm_rule.py). Other
# devices keep the factor 2 this rule was first measured with.
TRANSIENT_FACTOR = {"cpu": 2.5}
TRANSIENT_FACTOR_DEFAULT = 2.0


def choose_ghost(use: Bilinear, method: str, transient: bool = False) -> bool:
    """The mixed rule: ghost-norm this use, or instantiate its per-sample gradient?

    ``transient=False`` (G_i would wait for other layers' norms, e.g. all-layer clipping):
    a memory rule, instantiate iff G_i is no larger than its factors (m·n ≤ T·(m+n) for a
    dense use), which it then replaces: the stash never grows, and the clipped sum becomes
    a cheap Σ_i c_i G_i. FastDP's space rule (ghost iff 2T² < m·n, docs/layer-rules.md) only
    instantiates where this one does too (2T² ≥ m·n implies T(m+n) ≥ 2T·sqrt(m·n) ≥ m·n).

    ``transient=True`` (the group is finalized right after this parameter, e.g. layer-wise
    clipping): a time rule. Instantiating costs one per-sample matmul (T·m·n) and then a
    cheap Σ_i c_i G_i; ghost costs the Grams (≈ 5/8·T²(m+n) on CPU) plus the clipped GEMM
    (T·m·n). Instantiate iff G_i is at most κ times its factors, m·n ≤ κ·T·(m+n), κ = 2.5
    on the CPU and 2 elsewhere (:data:`TRANSIENT_FACTOR`): where instantiation measured
    faster (benchmarks/norm_rule.py). :func:`~dpclip.engine.streamed.streamed_clip` holds
    at most twice the factors' memory in G_i at a time whatever κ is.
    """
    if method == "ghost":
        return True
    if method == "instantiate":
        return False
    inst, factors = numel_per_sample(use)
    if not transient:
        return inst > factors
    kappa = TRANSIENT_FACTOR.get(use.right.device.type, TRANSIENT_FACTOR_DEFAULT)
    return inst > kappa * factors


def early_instance(use: Use, shape: torch.Size, method: str) -> Use:
    """``Dense(G)`` for a dense Bilinear use whose per-sample gradient the memory rule
    instantiates (G_i no larger than its factors), else ``use`` unchanged.

    For a parameter whose other uses arrive later (GPT-2's lm_head, tied to wte): the
    factors (lm_head's [B, T, V] output gradient) would otherwise wait for the last use
    and then be instantiated anyway, the gradient and the factors both held at the end.
    :func:`param_norm_sq` gives the same norm and parts either way (instantiated uses
    are summed; their cross terms with the other uses are exact)."""
    if not isinstance(use, Bilinear) or use.is_ids or choose_ghost(use, method):
        return use
    inst, factors = numel_per_sample(use)
    if inst > factors:  # "instantiate" forced on a wide layer: keep the smaller factors
        return use
    wide = widened_use(use, torch.promote_types(use.right.dtype, torch.float32))  # bf16 factors: G_i in float32
    return Dense(instantiate(wide).reshape(use.right.shape[0], *shape))


@dataclass
class _Part:
    """One summand of a parameter's per-sample gradient, with its instantiated form
    (``[B, *shape]``) when one was computed."""

    use: Use
    inst: Tensor | None = None


def _block_view(grad: Tensor, use: Bilinear) -> Tensor:
    """``[B, *shape]`` -> ``[B, g, m, n]`` matching ``use``'s factors."""
    batch = grad.shape[0]
    if use.is_ids:
        return grad.reshape(batch, 1, use.vocab, -1)
    return grad.reshape(batch, use.left.shape[1], use.left.shape[3], use.right.shape[3])


def _self_term(p: _Part, cache: GramCache | None = None) -> tuple[Tensor, Tensor]:
    """(||part||², its atoms' squared sizes D)."""
    if p.inst is not None:
        value = sum_of_squares(p.inst)   # blocked: a bound that does not grow with m·n
        if isinstance(p.use, Dense):
            return value, value
        return value, atom_sizes(p.use, value.dtype)[0]
    assert isinstance(p.use, Bilinear)
    if p.use.is_ids:
        return symmetric_ghost(p.use.left, p.use.right[:, 0], True)
    value, atoms = symmetric_ghost(p.use.left, p.use.right, False, cache=cache)   # [B, g]: g = 1 a view, no kernel
    return (value[:, 0], atoms[:, 0]) if value.shape[1] == 1 else (value.sum(1), atoms.sum(1))


def _cross_term(a: _Part, c: _Part) -> Tensor:
    if a.inst is not None and c.inst is not None:
        return batched_dot(a.inst, c.inst)
    if a.inst is not None:
        a, c = c, a
    if c.inst is not None:
        assert isinstance(a.use, Bilinear)
        return _cross_bilinear_dense(a.use, _block_view(c.inst, a.use))
    assert isinstance(a.use, Bilinear) and isinstance(c.use, Bilinear)
    return _cross_ids_dense(a.use, c.use) if a.use.is_ids else _cross_ids_dense(c.use, a.use)


def param_norm_sq(uses: list[Use], shape: torch.Size, method: str = "auto",
                  out_dtype: torch.dtype | None = None, transient: bool = False,
                  with_atoms: bool = False, gram_cache: GramCache | None = None,
                  ) -> tuple[Tensor, list[Use]] | tuple[Tensor, list[Use], Tensor]:
    """Exact per-sample ||Σ_u G_{i,u}||² of one parameter over all its uses.

    Uses are merged into at most three parts: dense-factor Bilinear uses concatenated
    along T (D), id-factor uses concatenated along T (E), and everything instantiated,
    summed (I). Then ||D+E+I||² = ||D||² + ||E||² + ||I||² + 2(<D,E> + <D,I> + <E,I>),
    each term computed without forming V x n matrices for embeddings (docs/layer-rules.md).
    The mixed rule (:func:`choose_ghost`; ``transient``: the clipped sum follows at once)
    decides per part whether D or E is ghost-normed or instantiated.

    Returns ``(norm_sq [B], parts)``; ``parts`` is what :func:`clipped_sum` needs. An
    instantiated gradient replaces its factors when it is not larger than them, or when
    it is ``transient``, which makes the clipped sum a cheap Σ_i c_i G_i. ``with_atoms``
    adds the parts' atoms' squared sizes D [B] (:func:`atom_sizes`; free for ghost parts,
    read off the Grams), what the cancellation check compares the norm with. ``gram_cache``
    reuses the Gram of a factor the previous parameter read (:class:`GramCache`).
    """
    # Half-precision factors (autocast) are widened for the arithmetic only; the parts
    # returned keep them as they are, so the stash stays small (dpclip.engine.precision).
    work_dtype = out_dtype or torch.float32
    inst: Tensor | None = None
    for u in uses:
        if isinstance(u, Dense):
            grad = widened(u.grad, work_dtype)
            inst = grad if inst is None else inst + grad
    parts: list[_Part] = []
    kept: list[Use] = []
    for group in ([u for u in uses if isinstance(u, Bilinear) and not u.is_ids],
                  [u for u in uses if isinstance(u, Bilinear) and u.is_ids]):
        if not group:
            continue
        bundle = concat_uses(group)
        work = widened_use(bundle, work_dtype)
        if choose_ghost(bundle, method, transient):
            parts.append(_Part(work))
            kept.append(bundle)
            continue
        g = instantiate(work).reshape(bundle.right.shape[0], *shape)
        inst_numel, factor_numel = numel_per_sample(bundle)
        if transient or bundle.is_ids or inst_numel <= factor_numel:
            inst = g if inst is None else inst + g
        else:  # keep the (smaller) factors for the clipped sum, the gradient for the norm
            parts.append(_Part(work, g))
            kept.append(bundle)
    if inst is not None:
        parts.append(_Part(Dense(inst), inst))
        kept.append(Dense(inst))
    if not parts:
        raise ValueError("param_norm_sq needs at least one use")

    total, atoms = _self_term(parts[0], gram_cache)
    for p in parts[1:]:
        value, more = _self_term(p, gram_cache)
        total, atoms = total + value, atoms + more
    for a in range(len(parts)):
        for c in range(a + 1, len(parts)):
            total = total + 2 * _cross_term(parts[a], parts[c])
    if out_dtype is not None:
        total, atoms = total.to(out_dtype), atoms.to(out_dtype)
    return (total, kept, atoms) if with_atoms else (total, kept)


# ------------------------------------------------------------------ clipped sum


def clipped_sum(parts: list[Use], factors: Tensor, shape: torch.Size) -> Tensor:
    """Σ_i c_i G_i for one parameter, from its parts (groupwise paper Alg. 1 line 10).

    Bilinear: Lᵀ diag(c) R, one matmul the size of the usual weight gradient; ids: a
    scatter-add of the scaled rows; Dense: a contraction over the batch. Later terms are
    added into the first in place; ids parts (a tied embedding's rows) come last, so that
    on the CPU their rows go straight into the head's V x n sum (``index_add_``), not into
    a V x n tensor of their own that is then added (two passes over the table).
    """
    out: Tensor | None = None
    for part in sorted(parts, key=lambda p: isinstance(p, Bilinear) and p.is_ids):   # stable
        part = widened_use(part, factors.dtype)   # half-precision factors: a float32 sum
        if isinstance(part, Dense):
            c = factors.to(part.grad.dtype)
            term = (c @ part.grad.reshape(part.grad.shape[0], -1)).reshape(shape)
        elif part.is_ids:
            r = part.right[:, 0]
            rows = (r * factors.to(r.dtype).view(-1, 1, 1)).reshape(-1, r.shape[-1])
            ids = part.left.reshape(-1)
            if out is not None and out.device.type == "cpu":
                # deterministic on the CPU (CUDA's index_add_ is not: there the scatter below)
                out.view(-1, r.shape[-1]).index_add_(0, ids, rows)
                continue
            term = _scatter_rows(rows, ids, part.vocab).reshape(shape)
        else:
            left, right = part.left, part.right
            c = factors.to(left.dtype).view(-1, 1, 1, 1)
            # Scale the thinner factor: the product is the same, the work is smaller.
            if left.shape[3] <= right.shape[3]:
                left = left * c
            else:
                right = right * c
            batch, g, t, m = left.shape
            n = right.shape[3]
            if g == 1:  # (B·T x m)ᵀ (B·T x n): one GEMM, no copies of the factors
                term = (left.reshape(batch * t, m).t() @ right.reshape(batch * t, n)).reshape(shape)
            else:
                lf = left.transpose(0, 1).reshape(g, batch * t, m)
                rf = right.transpose(0, 1).reshape(g, batch * t, n)
                term = torch.bmm(lf.transpose(1, 2), rf).reshape(shape)
        out = term if out is None else out.add_(term)
    if out is None:
        raise ValueError("clipped_sum needs at least one part")
    return out


def zero_samples(parts: list[Use], keep: Tensor) -> list[Use]:
    """The same uses with G_i = 0 for every sample i where ``keep`` [B] is False.

    Every factor's rows are zeroed, not only the one :func:`clipped_sum` scales: with
    c_i = 0, an inf or NaN in the other factor still gives 0·inf = NaN in the GEMM. New
    tensors: the factors may be the caller's own inputs."""
    def rows(t: Tensor) -> Tensor:
        return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, 0)

    out: list[Use] = []
    for part in parts:
        if isinstance(part, Dense):
            out.append(Dense(rows(part.grad)))
        elif part.is_ids:
            out.append(Bilinear(part.left, rows(part.right), part.vocab))
        else:
            out.append(Bilinear(rows(part.left), rows(part.right)))
    return out


def sqrt_or_zero(x: Tensor) -> Tensor:
    """Norm from norm², tolerating tiny negative round-off of cancelling cross terms."""
    return x.clamp_min(0).sqrt()


__all__ = ["Bilinear", "Dense", "Use", "NORM_METHODS", "GramCache", "batched_dot", "ghost_norm_sq", "instantiate",
           "param_norm_sq", "clipped_sum", "choose_ghost", "sqrt_or_zero", "zero_samples", "early_instance",
           "atom_sizes", "concat_uses", "numel_per_sample", "widened_use", "TRANSIENT_FACTOR",
           "TRANSIENT_FACTOR_DEFAULT"]
