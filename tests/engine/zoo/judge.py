"""Judge one zoo run: the engine's clipped sum against a per-sample reference.

A run is (case, shape family, grouping, norm method, precision). The engine gets
``DPEngine(model, clipping, gradient_noise_multiplier=0, expected_batch_size=B, seed=0)``, one
``backward`` of the per-sample losses and ``debug_clipped()``, which hands back the clipped
sums Σ_i c_ik g_i and the per-sample group norms without noise (docs/engine.md). The
reference runs autograd on each sample alone:

- fp32: on a float64 copy of the model (float64 inputs), so the reference's own error is
  negligible against float32's;
- bf16 (the forward and the loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``, float32
  weights): on a float32 copy under the same autocast, one sample at a time, so that both
  sides round the same operations to bf16.

It clips group k of sample i with c_ik = min(1, C_k/‖g_ik‖), C_k chosen in the widest gap
between two of the group's reference norms (some samples clipped, some not; at B = 1 below
the norm), far from every norm so that rounding cannot move a sample across C_k.

Verdicts: ``exact`` (every parameter and every per-sample group norm within tolerance),
``refused`` (an EngineError), ``wrong`` (no error, a mismatch), ``crashed`` (any other
exception), ``broken-reference`` (the float64 per-example reference itself is not finite for
some sample, so that sample cannot be judged, while everything that can be judged agrees: a
model's own overflow at tiny random sizes, not the engine's; an engine NaN where the reference
is finite stays ``wrong``). Errors are relative to their natural scale: a parameter's error
‖Δ_p‖ / Σ_i c_ik‖g_ip‖ (what rounding in the sum is proportional to), a norm's error
|n_e - n_r| / n_r; both floored at a fraction (FLOOR) of the run's largest scale.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch
from torch import Tensor, nn

from dpclip.engine import DPEngine, build_groups, trainable_params
from dpclip.errors import EngineError
from tests.engine.zoo import CASES, SHAPES

#: tolerances, relative (see the module doc for the scales). fp32: float32's unit round-off
#: is 2^-24 ≈ 6e-8; a forward and backward through a few layers and a batched vs per-sample
#: reduction order lose a few hundred of it, so 1e-4 leaves two orders of margin while every
#: logic error the issue lists is 1e-1 or more. bf16: both sides round each autocast op's
#: output to bf16 (unit round-off 2^-9), but in a different order (batched vs one sample), so
#: they differ by a few bf16 ulps after two layers: 4·2^-8 ≈ 0.016 (the largest bf16 error of
#: a run whose fp32 twin is exact was 0.007 on the full zoo; a logic error that the fp32 runs
#: show, e.g. 0.022 for nanoGPT positions at B == T, must not hide under bf16's tolerance).
#: The reported max errors of exact fp32 runs stay below 1e-5 (FLOOR below).
TOLERANCE = {"fp32": 1e-4, "bf16": 4 * 2.0 ** -8}
#: bf16 only: the mean log-ratio of the engine's norms to the reference's, over every sample
#: and group, must stay within this plus 3 standard errors of the per-norm scatter: rounding
#: scatters both ways, a norm method that under-reports shifts them all one way.
SYSTEMATIC = 2.0 ** -8
#: error floors, as a fraction of the largest parameter scale / largest per-sample group norm
#: of the run. Some gradients are zero in exact arithmetic (an attention key bias: softmax
#: ignores a shift) and come out as rounding noise, on both sides, with different values; a
#: relative error of noise is meaningless, so an error is measured against at least this
#: fraction of the run's largest scale (fp32: 1e-2, so that the noise of a zero gradient,
#: up to 8e-8 of the largest scale, stays 100x below tolerance). bf16 noise is 2^16 times
#: float32's, hence its larger floor; logic errors show in fp32 too, whose floor is tighter.
FLOOR = {"fp32": 1e-2, "bf16": 3e-2}


@dataclass
class Result:
    case: str
    shape: str
    grouping: str
    method: str
    precision: str
    verdict: str                               # exact | refused | wrong | crashed | broken-reference
    max_rel_err: float | None = None           # worst parameter error (see module doc)
    norm_rel_err: float | None = None          # worst per-sample group-norm error
    norm_bias: float | None = None             # mean log(engine norm / reference norm)
    params: list[str] = field(default_factory=list)   # parameters over tolerance, worst first
    message: str | None = None                 # refusal / exception: type and first line
    where: str | None = None                   # crash: innermost dpclip frame
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.case, self.shape, self.grouping, self.method, self.precision)


# ------------------------------------------------------------------ the reference


@lru_cache(maxsize=None)
def base_model(case: str) -> nn.Module:
    return CASES[case].build()


def fresh_model(case: str) -> nn.Module:
    return copy.deepcopy(base_model(case))


def make_batch(case: str, shape: str) -> dict[str, Tensor]:
    B, T = SHAPES[shape]
    g = torch.Generator().manual_seed(1000 + 17 * B + T)
    return CASES[case].batch(B, T, g)


def autocast(precision: str):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _unique_trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every name of every trainable parameter -> the tensor (tied names share one)."""
    return {n: p for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


@lru_cache(maxsize=None)
def reference_grads(case: str, shape: str, precision: str) -> tuple[dict[str, Tensor], ...]:
    """Per-sample gradients, one dict per sample: every parameter name -> float64 tensor."""
    model = fresh_model(case)
    batch = make_batch(case, shape)
    if precision == "fp32":
        model = model.double()
        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    named = _unique_trainable(model)
    unique = list({id(p): p for p in named.values()}.values())
    out = []
    for i in range(next(iter(batch.values())).shape[0]):
        with autocast(precision):
            loss = CASES[case].loss(model, {k: v[i:i + 1] for k, v in batch.items()}).sum()
        for p in unique:
            p.grad = None
        loss.backward()   # not autograd.grad: reentrant checkpointing supports only .backward()
        by_id = {id(p): (torch.zeros_like(p) if p.grad is None else p.grad).double() for p in unique}
        out.append({n: by_id[id(p)] for n, p in named.items()})
    return tuple(out)


def choose_thresholds(norms: Tensor) -> list[float]:
    """C_k per group: the geometric mean of the two adjacent sorted norms with the widest
    ratio (some samples clipped, some not); half the largest norm when there is no gap."""
    out = []
    for col in norms.t():
        pos = torch.unique(col[col > 0])
        if len(pos) == 0:
            out.append(1.0)
        elif len(pos) == 1:
            out.append(0.5 * float(pos[0]))
        else:
            ratios = pos[1:] / pos[:-1]
            j = int(ratios.argmax())
            out.append(math.sqrt(float(pos[j]) * float(pos[j + 1])))
    return out


# ------------------------------------------------------------------ one run


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _short(frame) -> str:
    path = frame.filename
    path = "dpclip/" + path.split("/dpclip/", 1)[1] if "/dpclip/" in path else "/".join(path.split("/")[-2:])
    return f"{path}:{frame.lineno} ({frame.name})"


def _where(exc: BaseException) -> str | None:
    """The innermost dpclip frame, then the frame that raised, when that is elsewhere."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    ours = [f for f in frames if "/dpclip/" in f.filename]
    last = _short(frames[-1])
    if not ours or ours[-1] is frames[-1]:
        return last
    return f"{_short(ours[-1])} > {last}"


def judge(case: str, shape: str, grouping: str, method: str, precision: str) -> Result:
    start = time.perf_counter()
    result = Result(case, shape, grouping, method, precision, "crashed")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run(result)
    except EngineError as exc:
        result.verdict, result.message = "refused", _first_line(exc)
    except Exception as exc:  # noqa: BLE001  (every other exception is the verdict "crashed")
        result.verdict, result.message, result.where = "crashed", _first_line(exc), _where(exc)
    result.seconds = round(time.perf_counter() - start, 4)
    return result


def _run(result: Result) -> None:
    case, shape, precision = result.case, result.shape, result.precision
    B = SHAPES[shape][0]
    per_sample = reference_grads(case, shape, precision)
    model = fresh_model(case)
    batch = make_batch(case, shape)
    groups = build_groups(model, result.grouping)
    names = [[groups.params[j].name for j in members] for members in groups.members]
    ref_norms = torch.tensor([[math.sqrt(sum(float(g[n].pow(2).sum()) for n in members)) for members in names]
                              for g in per_sample], dtype=torch.float64)               # [B, K]
    thresholds = choose_thresholds(ref_norms)
    factors = torch.clamp(torch.tensor(thresholds, dtype=torch.float64) / ref_norms, max=1.0).nan_to_num(1.0)
    broken = ~torch.isfinite(ref_norms)     # the reference itself overflowed there: left out of the sums (below)
    factors[broken] = 0.0

    clipping = {"grouping": result.grouping, "fn": "abadi", "norm_method": result.method,
                "threshold": {"kind": "fixed", "value": thresholds}}
    engine = DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=B, seed=0)
    try:
        with autocast(precision):
            losses = CASES[case].loss(model, batch)
        engine.backward(losses)
        debug = engine.debug_clipped()
    finally:
        engine.detach()

    tol = TOLERANCE[precision]
    errors: dict[str, float] = {}
    group_of = {n: k for k, members in enumerate(names) for n in members}
    scales = {}
    for info in trainable_params(model):
        name = info.name
        k = group_of[name]
        kept = [(float(factors[i, k]), g[name]) for i, g in enumerate(per_sample) if not broken[i, k]]
        ref = sum(c * g for c, g in kept)
        scales[name] = sum(c * float(g.norm()) for c, g in kept)
        if name not in debug.sums:
            errors[name] = math.inf
            continue
        errors[name] = float((debug.sums[name].double() - ref).norm())
    floor = FLOOR[precision] * max(scales.values(), default=0.0)
    errors = {n: (e / max(scales[n], floor) if floor > 0 else e) for n, e in errors.items()}
    result.max_rel_err = max(errors.values(), default=0.0)
    result.params = [n for n, e in sorted(errors.items(), key=lambda kv: -kv[1]) if e > tol][:6]

    got_norms = debug.norms.double()
    norm_ok = True
    if got_norms.shape != ref_norms.shape:
        result.norm_rel_err = math.inf
        norm_ok = False
    elif bool(broken.any()):
        norm_ok = _judge_around_broken(result, broken, ref_norms, got_norms, tol)
    else:
        norm_floor = max(FLOOR[precision] * float(ref_norms.max()), 1e-300)
        rel = (got_norms - ref_norms).abs() / ref_norms.clamp_min(norm_floor)
        result.norm_rel_err = float(rel.max())
        norm_ok = result.norm_rel_err <= tol
        live = ref_norms > norm_floor
        if precision == "bf16" and bool(live.any()):
            logs = torch.log(got_norms[live].clamp_min(1e-300) / ref_norms[live])
            result.norm_bias = float(logs.mean())
            spread = float(logs.std()) if logs.numel() > 1 else 0.0
            if abs(result.norm_bias) > SYSTEMATIC + 3 * spread / math.sqrt(logs.numel()):
                norm_ok = False
    if result.verdict == "broken-reference":
        return
    result.verdict = "exact" if result.max_rel_err <= tol and norm_ok else "wrong"


def _judge_around_broken(result: Result, broken: Tensor, ref_norms: Tensor, got_norms: Tensor, tol: float) -> bool:
    """Some (sample, group) norms of the float64 reference are not finite (``broken``): the
    per-example backward itself overflowed, a model's own NaN at tiny random sizes. Those cannot be
    judged; every other norm still is (an engine NaN where the reference is finite stays "wrong"),
    and so are the sums when the engine dropped every broken one (its norm not finite there too:
    the reference leaves them out). Returns whether all that can be judged agrees; if so the
    verdict is "broken-reference" and the message says what was not judged."""
    fine = ~broken
    if bool(fine.any()):
        live = ref_norms[fine]
        floor = max(FLOOR[result.precision] * float(live.max()), 1e-300)
        rel = ((got_norms[fine] - live).abs() / live.clamp_min(floor)).nan_to_num(math.inf)
        result.norm_rel_err = float(rel.max())
    else:
        result.norm_rel_err = 0.0
    dropped = not bool(torch.isfinite(got_norms[broken]).any())
    if result.norm_rel_err > tol or (dropped and not result.max_rel_err <= tol):
        return False
    samples = sorted({int(i) for i in broken.nonzero()[:, 0]})
    result.verdict = "broken-reference"
    result.message = (f"the float64 per-example reference is not finite for sample(s) {samples}: not judged; "
                      + ("the engine dropped them and agrees on the rest" if dropped else
                         "the engine kept them, so the sums are not judged; every other norm agrees"))
    return True
