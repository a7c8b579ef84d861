"""Mixed precision: the engine under autocast against a per-example reference.

The reference (:func:`reference`) runs the plain model (no engine) under the same autocast,
so that its activations and output gradients are those autocast computes, and captures each
parametrised module's input ``a`` and output gradient ``b``. Each example's gradient is then
taken in float64 from its own rows: the module is re-run in float64 on ``a_i`` and ``b_i`` is
pulled back. Every weight gradient here is linear in (a, b) and does not depend on the
weights, so this is the exact gradient of the function autocast computed, with no bfloat16
rounding of its own (autocast's own weight-gradient GEMM would round every entry to 8 bits).
A Linear, Conv or Conv1D under autocast multiplies bf16(a), not a: the reference rounds
their inputs as autocast does.

How close is close enough. bfloat16 keeps 8 significant bits: one rounding moves a value by
up to u = 2^-8 relative. The engine computes each per-sample norm and clipped sum in float32
from the same bf16 factors; its own error is float32 round-off of sums of K products, at most
K·2^-24 of the sum of their magnitudes, below 2^-12 for the K ≤ 2^12 terms of these models
(and measured below 2^-22). Any bf16 rounding of a norm, a Gram entry or a sum (the engine
computing "in bf16 end to end") moves the result by up to u, typically by a sizeable fraction
of it. So the tolerance on a norm is

    TOL = u / 16 = 2^-12  (relative)

the float32 worst case here, and a sixteenth of one bf16 rounding. A clipped sum
Σ_i c_i g_i inherits TOL from each sample's gradient and again from its clip factor
(c_i = min(1, C/‖g_i‖) moves by at most the norm's relative error): its error is at most
2·TOL·Σ_i c_i‖g_i‖. :func:`test_the_tolerance_rejects_norms_computed_in_bf16` and
:func:`test_the_tolerance_rejects_a_reference_that_ignores_autocast` check that the test
fails when the engine's math runs in bf16 or the reference runs in float32 (measured on
these models: the engine's error is below 10^-3·TOL; bf16 norm math gives 5-6·TOL on the
norms, a float32 reference 7-11·TOL on the norms and 2.5-3·TOL on the sums).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine, build_groups, trainable_params
from dpclip.engine.precision import DEFAULT_LOSS_SCALE, Precision, autocast_off, ieee_float32, widened
from dpclip.errors import EngineError

U = 2.0 ** -8          # bfloat16's unit roundoff
TOL = U / 16           # derived in the module docstring
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small models: threads only add overhead (and the machine is shared)."""


# --------------------------------------------------------------------- models


class CNN(nn.Module):
    """conv + GroupNorm + strided conv + Linear head."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.gn(self.c1(x)))
        return self.head(torch.relu(self.c2(h)).mean((2, 3)))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return CNN()


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight   # a tied pair: cross terms
    return model


def classify_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def gpt2_loss(model, batch):
    ids = batch["ids"]
    # Position ids per sample (not broadcast from (1, T)): the reference takes rows of them.
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def batch_for(name: str, device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        batch = {"x": torch.randn(8, 20, generator=g), "y": torch.randint(0, 5, (8,), generator=g)}
    elif name == "cnn":
        batch = {"x": torch.randn(8, 3, 8, 8, generator=g), "y": torch.randint(0, 5, (8,), generator=g)}
    else:
        batch = {"ids": torch.randint(0, 50, (8, 6), generator=g)}
    return {k: v.to(device) for k, v in batch.items()}


MODELS = {"mlp": (mlp, classify_loss), "cnn": (cnn, classify_loss), "gpt2": (tiny_gpt2, gpt2_loss)}


# ------------------------------------------------------------------ reference


def _autocast_multiplies(module: nn.Module) -> bool:
    """Modules whose forward autocast runs as a half-precision matmul / convolution."""
    from transformers.pytorch_utils import Conv1D
    return isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, Conv1D))


@contextlib.contextmanager
def capturing(model: nn.Module) -> Iterator[list]:
    """Record [module, input a, output gradient b] of each parametrised module's calls."""
    calls = []

    def keep_input(module, args):
        call = [module, args[0].detach(), None]
        calls.append(call)
        return None

    def keep_output(module, args, out):
        out.register_hook(lambda grad, call=calls[-1]: call.__setitem__(2, grad.detach()))

    handles = []
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            handles += [module.register_forward_pre_hook(keep_input), module.register_forward_hook(keep_output)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def per_example_from(model: nn.Module, calls: list, n: int, dtype, loss_scale: float) -> list[dict]:
    """Per-example float64 gradients {parameter name: tensor} from captured (a, b)."""
    device = next(model.parameters()).device
    names = {id(p): name for name, p in model.named_parameters()}       # tied: the first name
    per = [{name: torch.zeros(p.shape, dtype=torch.float64, device=device)
            for name, p in model.named_parameters()} for _ in range(n)]
    for module, a, b in calls:
        wide = copy.deepcopy(module).double()
        own = dict(wide.named_parameters(recurse=False))
        originals = dict(module.named_parameters(recurse=False))
        if dtype is not None and _autocast_multiplies(module):
            a = a.to(dtype)                                            # what autocast multiplies
        for i in range(n):
            x = a[i:i + 1]
            out = wide(x.double() if x.is_floating_point() else x)
            grads = torch.autograd.grad(out, list(own.values()), b[i:i + 1].double() / loss_scale)
            for (pname, _), g in zip(own.items(), grads):
                per[i][names[id(originals[pname])]] += g
    return per


def reference(model: nn.Module, loss_fn, batch, dtype=BF16, loss_scale: float = 1.0) -> list[dict]:
    """Per-example gradients {parameter name: float64 tensor} (see the module docstring);
    ``dtype=None`` runs the reference without autocast."""
    model = copy.deepcopy(model)
    device = next(model.parameters()).device
    region = (torch.autocast(device.type, dtype=dtype) if dtype is not None
              else torch.autocast(device.type, enabled=False))
    with capturing(model) as calls:
        with region:
            losses = loss_fn(model, batch)
        (losses.sum() * loss_scale).backward()
    return per_example_from(model, calls, losses.shape[0], dtype, loss_scale)


def group_norms(per: list[dict], groups) -> torch.Tensor:
    """[n, K] per-sample group norms (float64)."""
    names = [[groups.params[j].name for j in members] for members in groups.members]
    return torch.stack([torch.stack([torch.sqrt(sum(g[nm].pow(2).sum() for nm in members)) for members in names])
                        for g in per])


def engine_run(model, loss_fn, batch, grouping, thresholds, dtype=BF16, loss_scale=1.0, same_run=False):
    """(per-sample group norms [n, K], clipped sums by name, and with ``same_run`` the
    reference's per-example gradients from the engine's own run) under autocast."""
    model = copy.deepcopy(model)
    device = next(model.parameters()).device
    engine = DPEngine(model, {"grouping": grouping, "threshold": {"kind": "fixed", "value": thresholds}},
                      gradient_noise_multiplier=0.0, expected_batch_size=1)
    seen = []
    observe = engine.policy.observe
    engine.policy.observe = lambda norms: (seen.append(norms.detach().clone()), observe(norms))[1]
    with capturing(model) if same_run else contextlib.nullcontext([]) as calls:
        with torch.autocast(device.type, dtype=dtype):
            losses = loss_fn(model, batch)
        engine.backward(losses, loss_scale=loss_scale)
    engine.privatize()
    sums = {info.name: info.param.grad.double() for info in trainable_params(model)}   # B = 1: p.grad = Σ
    engine.detach()   # the modules' own forwards again, for the float64 re-runs
    per = per_example_from(model, calls, losses.shape[0], dtype, loss_scale) if same_run else None
    return torch.cat(seen).double(), sums, per


def worst(model, loss_fn, batch, grouping, ref_dtype=BF16, dtype=BF16, loss_scale=1.0,
          same_run=False) -> dict[str, float]:
    """The largest error of norms and clipped sums, each as a multiple of its tolerance.

    ``same_run``: the reference takes its (a, b) from the engine's own forward and backward
    instead of a run of its own (the thresholds still come from a run of its own), so that
    only the engine's own arithmetic is compared, whatever state the process is in. A
    separate run is the stronger check of the whole step: it caught autocast left on by an
    earlier trainer run (tests/engine/test_batch_axis.py), which same_run would not."""
    groups = build_groups(copy.deepcopy(model), grouping)
    per = reference(model, loss_fn, batch, ref_dtype, loss_scale)
    thresholds = group_norms(per, groups).median(dim=0).values   # some samples clipped, some not, per group
    got_norms, sums, same = engine_run(model, loss_fn, batch, grouping, [float(t) for t in thresholds], dtype,
                                       loss_scale, same_run)
    per = same if same_run else per
    norms = group_norms(per, groups)
    factors = torch.clamp(thresholds / norms, max=1.0)                                   # [n, K]
    sum_err, sum_scale = 0.0, 0.0
    for k, members in enumerate(groups.members):
        for j in members:
            name = groups.params[j].name
            want = sum(factors[i, k] * g[name] for i, g in enumerate(per))
            sum_err += float((sums[name] - want).pow(2).sum())
        sum_scale += float((factors[:, k] * norms[:, k]).sum())
    norm_err = float(((got_norms.cpu() - norms.cpu()).abs() / norms.cpu()).max())
    return {"norms": norm_err / TOL, "sums": sum_err ** 0.5 / (2 * TOL * sum_scale)}


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_norms_and_clipped_sums_match_a_float64_per_example_reference(name, grouping):
    factory, loss_fn = MODELS[name]
    errors = worst(factory(), loss_fn, batch_for(name), grouping)
    assert errors["norms"] <= 1 and errors["sums"] <= 1, errors


@pytest.mark.parametrize("name", list(MODELS))
def test_the_tolerance_rejects_norms_computed_in_bf16(name, monkeypatch):
    # The engine's factor math with its float32 widening replaced by a cast to bf16:
    # Grams, norms and clipped sums rounded to 8 bits, as an engine without it would be.
    # The blocked sums of squares (dpclip/engine/sums.py) widen half precision themselves:
    # kept in bf16 too.
    import dpclip.engine.factors as factors
    import dpclip.engine.sums as sums
    monkeypatch.setattr(factors, "widened", lambda t, dtype=None: t.to(BF16) if t.is_floating_point() else t)
    monkeypatch.setattr(sums, "_working_dtype", lambda t: t.dtype)
    factory, loss_fn = MODELS[name]
    errors = worst(factory(), loss_fn, batch_for(name), "all-layer")
    assert errors["norms"] > 1, errors


@pytest.mark.parametrize("name", list(MODELS))
def test_the_tolerance_rejects_a_reference_that_ignores_autocast(name):
    factory, loss_fn = MODELS[name]
    errors = worst(factory(), loss_fn, batch_for(name), "all-layer", ref_dtype=None)
    assert errors["norms"] > 1 and errors["sums"] > 1, errors


def test_backward_inside_an_autocast_region_computes_in_float32_as_outside():
    model, batch = mlp(), batch_for("mlp")
    grads = []
    for inside in (False, True):
        m = copy.deepcopy(model)
        engine = DPEngine(m, {"threshold": {"kind": "fixed", "value": 0.5}}, gradient_noise_multiplier=0.0,
                          expected_batch_size=8)
        with torch.autocast("cpu", dtype=BF16):
            losses = classify_loss(m, batch)
            if inside:   # CPU autocast would otherwise run the engine's matmuls and vecdots in bf16
                engine.backward(losses)
        if not inside:
            engine.backward(losses)
        engine.privatize()
        grads.append([p.grad.clone() for p in m.parameters()])
        engine.detach()
    for a, b in zip(*grads):
        assert a.dtype == torch.float32 and torch.equal(a, b)


class _SequenceMLP(nn.Module):
    """Linear layers over 16 positions: T large enough that the mixed rule instantiates."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 12)
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)).mean(1))


@pytest.mark.parametrize("grouping, threshold, norm_method, streamed", [
    ("all-layer", {"kind": "fixed", "value": 1.15}, "ghost", False),        # waiting group, ghost norms
    ("all-layer", {"kind": "fixed", "value": 1.15}, "instantiate", False),  # waiting group, G_i kept
    ("layer", {"kind": "fixed", "value": [0.5, 1.1]}, "auto", True),        # G_i chunk by chunk
    ("layer", {"kind": "discriminative", "small": 0.5, "large": 3.0, "tail_rule": "top_fraction",
               "top_fraction": 0.25}, "auto", False),                      # finalized at the end
])
def test_a_power_of_two_loss_scale_is_undone_exactly_before_clipping(grouping, threshold, norm_method, streamed,
                                                                     monkeypatch):
    # float16 training seeds the backward with S; norms and sums scale by S exactly (S = 2^k),
    # so the engine's unscaled results must equal those of S = 1 bit for bit.
    import dpclip.engine.microbatch as microbatch
    calls = []
    real = microbatch.streamed_clip
    monkeypatch.setattr(microbatch, "streamed_clip", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    torch.manual_seed(0)
    model = _SequenceMLP().double()
    g = torch.Generator().manual_seed(3)
    batch = {"x": torch.randn(12, 16, 8, generator=g, dtype=torch.float64),
             "y": torch.randint(0, 5, (12,), generator=g)}
    results = []
    for scale in (1.0, DEFAULT_LOSS_SCALE):
        m = copy.deepcopy(model)
        engine = DPEngine(m, {"grouping": grouping, "threshold": threshold, "norm_method": norm_method},
                          gradient_noise_multiplier=0.0, expected_batch_size=12)
        seen = []
        observe = engine.policy.observe
        engine.policy.observe = lambda norms: (seen.append(norms.clone()), observe(norms))[1]
        engine.backward(classify_loss(m, batch), loss_scale=scale)
        report = engine.privatize()
        results.append(([p.grad.clone() for p in m.parameters()], seen[0], report.clip_fraction))
        engine.detach()
    assert bool(calls) == streamed
    (grads1, norms1, clipped1), (grads2, norms2, clipped2) = results
    assert torch.equal(norms1, norms2) and torch.equal(clipped1, clipped2)
    if threshold["kind"] == "fixed":   # the thresholds sit among the norms
        assert 0 < float(clipped1.min()) and float(clipped1.max()) < 1, (norms1.min(0), norms1.max(0))
    for a, b in zip(grads1, grads2):
        assert torch.equal(a, b)


def test_a_sample_whose_scaled_gradient_overflows_contributes_zero_and_the_step_is_not_skipped():
    # fp16's overflow, imitated in float32: sample 0's loss is scaled past float32's range.
    model = mlp()
    batch = batch_for("mlp")
    engine = DPEngine(copy.deepcopy(model), {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=8)
    losses = classify_loss(engine.model, batch)
    weights = torch.ones(8)
    weights[0] = 1e38
    engine.backward(losses * weights, loss_scale=1e4)
    report = engine.privatize()
    assert report.nonfinite.tolist() == [1]
    grads = [p.grad.clone() for p in engine.model.parameters()]
    engine.detach()
    clean = DPEngine(copy.deepcopy(model), {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                     expected_batch_size=8)
    clean.backward(classify_loss(clean.model, {k: v[1:] for k, v in batch.items()}))
    clean.privatize()
    for a, b in zip(grads, clean.model.parameters()):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-7)   # float32 sums, 7 vs 8 rows
    clean.detach()


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_loss_scale_must_be_positive_and_finite(scale):
    model = mlp()
    engine = DPEngine(model, gradient_noise_multiplier=0.0, expected_batch_size=8)
    with pytest.raises(EngineError) as info:
        engine.backward(classify_loss(model, batch_for("mlp")), loss_scale=scale)
    assert "loss_scale" in info.value.message and info.value.hint
    engine.detach()


def test_the_torch_func_fallback_differentiates_the_autocast_forward():
    # A module without a rule: recomputed per sample in the backward under the forward's
    # autocast. Its gradients come from autocast's own backward (rounded to bf16 once per
    # entry), so they match within one rounding, 2^-8, not TOL.
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 32) / 6)

        def forward(self, x):
            return x @ self.weight

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), Scale(), nn.Tanh(), nn.Linear(32, 5))
    errors = worst(model, classify_loss, batch_for("mlp"), "layer")
    assert errors["norms"] * TOL <= U and errors["sums"] * TOL <= U, errors


def test_widened_leaves_float32_and_float64_alone():
    x = torch.ones(2)
    assert widened(x) is x and widened(x.double()).dtype == torch.float64
    assert widened(x.to(BF16)).dtype == torch.float32 and widened(x.half(), torch.float64).dtype == torch.float64


def test_autocast_off_disables_cpu_autocast_inside():
    with torch.autocast("cpu", dtype=BF16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == BF16
        with autocast_off():
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_ieee_float32_turns_tf32_off_inside_and_restores_the_callers_choice():
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        with ieee_float32():
            assert matmul.fp32_precision == "ieee" and torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
        with pytest.raises(RuntimeError), ieee_float32():
            raise RuntimeError("the flags come back after an error too")
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = saved


def test_the_engine_backward_runs_with_tf32_off():
    seen = []   # the flag as a hook inside the engine's backward finds it
    model = mlp()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=8)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    accumulator = first.weight.view_as(first.weight).grad_fn.next_functions[0][0]   # (a hook on the weight is refused)
    accumulator.register_prehook(lambda grads: seen.append(torch.backends.cuda.matmul.fp32_precision))
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        engine.backward(classify_loss(model, batch_for("mlp")))
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    engine.detach()
    assert seen and set(seen) == {"ieee"}, seen


def test_precision_fp16_is_refused_on_cpu_with_a_hint():
    with pytest.raises(EngineError) as info:
        Precision("fp16", "cpu")
    assert "CUDA" in info.value.message and "bf16" in info.value.hint


@pytest.mark.parametrize("kwargs, words", [
    ({"name": "fp8"}, "unknown precision"),
    ({"name": "bf16", "loss_scale": 128.0}, "fp16 only"),
    ({"name": "fp16", "device_type": "cuda", "loss_scale": 0.0}, "positive"),
])
def test_precision_refuses_what_it_cannot_do(kwargs, words):
    with pytest.raises(EngineError) as info:
        Precision(**kwargs)
    assert words in info.value.message and info.value.hint


def test_precision_runs_the_forward_under_its_autocast():
    assert Precision("fp32").scale == 1.0 and Precision("bf16").scale == 1.0
    assert Precision("fp16", "cuda").scale == DEFAULT_LOSS_SCALE
    assert Precision("fp16", "cuda", 64.0).scale == 64.0
    with Precision("bf16").autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == BF16
    with Precision("fp32").autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


# ------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype, scale", [(BF16, 1.0), (torch.float16, DEFAULT_LOSS_SCALE)])
@pytest.mark.parametrize("name", list(MODELS))
def test_on_cuda_norms_and_clipped_sums_match_the_reference(name, dtype, scale):
    # float16 keeps 11 bits (u = 2^-11 = 2·TOL): the same TOL is still far above the engine's
    # float32 error and below one float16 rounding. The loss scale is undone before clipping.
    factory, loss_fn = MODELS[name]
    errors = worst(factory().cuda(), loss_fn, batch_for(name, "cuda"), "all-layer", ref_dtype=dtype, dtype=dtype,
                   loss_scale=scale)
    assert errors["norms"] <= 1 and errors["sums"] <= 1, errors


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("guarded", [True, False])
def test_on_cuda_fp16_sums_stay_float32_exact_when_the_caller_allows_tf32(guarded, monkeypatch):
    """TF32 rounds each float32 matmul input to 10 bits (2^-11 relative, a float16 factor
    keeps 11): a clipped sum of K products then errs by about 2^-11/sqrt(K) relative, a tenth
    of the sums' unit here (2·TOL = 2^-11), where float32 leaves about 2^-24·sqrt(K), 10^-4
    of it. Measured on an H200: 4·10^-5 with the guard, 0.086 without. 10^-2 lies between;
    with ieee_float32 replaced by nothing the check must fail (the control)."""
    import dpclip.engine.bookkeeping as bookkeeping
    import dpclip.engine.microbatch as microbatch
    if not guarded:
        for module in (bookkeeping, microbatch):
            monkeypatch.setattr(module, "engine_math", autocast_off)
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        errors = worst(mlp().cuda(), classify_loss, batch_for("mlp", "cuda"), "all-layer", ref_dtype=torch.float16,
                       dtype=torch.float16, loss_scale=DEFAULT_LOSS_SCALE, same_run=True)
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    assert (errors["norms"] <= 1 and errors["sums"] < 1e-2) == guarded, errors
