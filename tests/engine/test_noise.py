"""Noise allocation, the generator (seeded vs OS entropy), and the DpEvent."""

import copy
import math

import dp_accounting
import pytest
import torch
from torch import nn

from dpclip.engine import DPEngine, effective_noise_multiplier
from dpclip.engine.noise import allocation_weights, noise_stds
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, classify_loss, mlp, mlp_batch

C = torch.tensor([1.0, 3.0], dtype=DTYPE)
D = torch.tensor([620.0, 105.0], dtype=DTYPE)     # sizes of the two layers below


def test_allocation_formulas_on_a_hand_computed_case():
    c, d = torch.tensor([1.0, 2.0], dtype=DTYPE), torch.tensor([4.0, 9.0], dtype=DTYPE)
    sigma = 1.5
    stds = {kind: noise_stds(sigma, c, allocation_weights(kind, c, d))
            for kind in ("global", "equal-budget", "weighted")}
    torch.testing.assert_close(stds["global"], sigma * math.sqrt(5) * torch.ones(2, dtype=DTYPE))
    torch.testing.assert_close(stds["equal-budget"], sigma * math.sqrt(2) * c)
    # w = C/sqrt(d) = [1/2, 2/3]; S = sqrt(1/(1/4) + 4/(4/9)) = sqrt(13)
    torch.testing.assert_close(stds["weighted"],
                               sigma * math.sqrt(13) * torch.tensor([0.5, 2 / 3], dtype=DTYPE))


@pytest.mark.parametrize("kind", ["global", "equal-budget", "weighted"])
def test_every_allocation_keeps_sensitivity_over_std_equal_to_sigma(kind):
    # Scaled by 1/w_k, every group has noise std σ·S and the scaled sensitivity is S.
    w = allocation_weights(kind, C, D)
    std = noise_stds(0.7, C, w)
    s = (C.pow(2) / w.pow(2)).sum().sqrt()
    torch.testing.assert_close(std / w, 0.7 * s * torch.ones(2, dtype=DTYPE))


def _two_layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 5)).to(DTYPE)


@pytest.mark.parametrize("kind", ["global", "equal-budget", "weighted"])
def test_empirical_noise_std_per_group_matches_allocation(kind):
    sigma, batch, steps = 1.3, 4, 10
    model = _two_layer()
    engine = DPEngine(model, {"grouping": "layer", "noise_allocation": kind,
                              "threshold": {"kind": "fixed", "value": C.tolist()}},
                      gradient_noise_multiplier=sigma, expected_batch_size=batch, seed=123)
    x = torch.randn(3, 30, dtype=DTYPE)
    samples = [[], []]
    for _ in range(steps):
        engine.backward(0.0 * model(x).sum(1))       # zero loss: p.grad is pure noise
        report = engine.privatize()
        for k, layer in enumerate((model[0], model[2])):
            samples[k].append(torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()]))
    expected = noise_stds(sigma, C, allocation_weights(kind, C, D)) / batch
    torch.testing.assert_close(report.noise_std_grad, expected)
    torch.testing.assert_close(report.noise_std_sum, expected * batch)
    for k in range(2):
        z = torch.cat(samples[k])
        n = z.numel()
        assert n == steps * D[k]
        # sd of the sample std / true std ≈ 1/sqrt(2(n−1)); sd of the mean = std/sqrt(n)
        assert abs(float(z.std() / expected[k]) - 1) < 5 / math.sqrt(2 * (n - 1))
        assert abs(float(z.mean() / expected[k])) < 5 / math.sqrt(n)


def _noise_of(seed):
    model = mlp()
    engine = DPEngine(model, {}, gradient_noise_multiplier=1.0, expected_batch_size=2, seed=seed)
    engine.backward(0.0 * classify_loss(model, mlp_batch(n=2)))
    engine.privatize()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_seed_gives_identical_noise_and_no_seed_draws_from_os_entropy():
    assert torch.equal(_noise_of(7), _noise_of(7))
    assert not torch.equal(_noise_of(7), _noise_of(8))
    a, b = _noise_of(None), _noise_of(None)
    assert not torch.equal(a, b) and not torch.equal(a, _noise_of(7))


@pytest.mark.parametrize("seed", [3, None])
def test_state_dict_resumes_the_noise_stream_in_both_modes(seed):
    model = mlp()
    twin = copy.deepcopy(model)
    engine = DPEngine(model, {}, gradient_noise_multiplier=1.0, expected_batch_size=2, seed=seed)
    engine.privatize()
    state = engine.state_dict()
    engine.privatize()
    want = [p.grad.clone() for p in model.parameters()]
    resumed = DPEngine(twin, {}, gradient_noise_multiplier=1.0, expected_batch_size=2, seed=None if seed is None else 99)
    resumed.load_state_dict(state)
    resumed.privatize()
    for p, w in zip(twin.parameters(), want):
        assert torch.equal(p.grad, w)
    assert resumed.steps == 2


def test_state_of_one_randomness_mode_is_refused_by_the_other():
    seeded = DPEngine(mlp(), {}, gradient_noise_multiplier=1.0, expected_batch_size=2, seed=3)
    entropy = DPEngine(mlp(), {}, gradient_noise_multiplier=1.0, expected_batch_size=2)
    with pytest.raises(EngineError):
        entropy.load_state_dict(seeded.state_dict())


def test_effective_noise_multiplier_formula_and_edge_cases():
    # docs/methods.md: budget share r -> σ_g = σ/sqrt(1−r) keeps σ_eff = σ.
    k, r, sigma = 4, 0.1, 1.0
    sigma_b = math.sqrt(k / (4 * r)) * sigma
    sigma_g = sigma / math.sqrt(1 - r)
    assert sigma_g == pytest.approx(1.054, abs=1e-3)
    assert effective_noise_multiplier(sigma_g, [(math.sqrt(k) / 2, sigma_b)]) == pytest.approx(sigma)
    assert effective_noise_multiplier(2.0) == 2.0
    assert effective_noise_multiplier(0.0, [(1.0, 1.0)]) == 0.0
    assert effective_noise_multiplier(1.0, [(1.0, 0.0)]) == 0.0


def test_dp_event_is_gaussian_or_poisson_subsampled():
    engine = DPEngine(mlp(), {}, gradient_noise_multiplier=1.1, expected_batch_size=2)
    assert engine.privatize().dp_event == dp_accounting.GaussianDpEvent(1.1)
    engine = DPEngine(mlp(), {}, gradient_noise_multiplier=1.1, expected_batch_size=2, sample_rate=0.01)
    assert engine.privatize().dp_event == dp_accounting.PoissonSampledDpEvent(
        0.01, dp_accounting.GaussianDpEvent(1.1))



def test_the_total_noise_multiplier_is_accepted_where_it_is_the_gradients():
    """``noise_multiplier`` is the total σ_eff everywhere; with a threshold policy that releases
    nothing it equals σ_g, so the engine takes it and reports both as one value."""
    engine = DPEngine(mlp(), {}, noise_multiplier=1.1, expected_batch_size=2)
    assert engine.gradient_noise_multiplier == 1.1
    report = engine.privatize()
    assert report.noise_multiplier == report.gradient_noise_multiplier == 1.1
    assert report.dp_event == dp_accounting.GaussianDpEvent(1.1)


def test_the_total_noise_multiplier_is_refused_where_a_statistic_shares_the_budget():
    quantile = {"threshold": {"kind": "quantile", "sigma": 5.0, "initial": 1.0}}
    with pytest.raises(EngineError) as info:
        DPEngine(mlp(), quantile, noise_multiplier=1.1, expected_batch_size=2)
    assert "gradient_noise_multiplier" in info.value.hint
    report = DPEngine(mlp(), quantile, gradient_noise_multiplier=1.1, expected_batch_size=2).privatize()
    assert report.gradient_noise_multiplier == 1.1 and report.noise_multiplier < 1.1  # the joint σ_eff
    with pytest.raises(EngineError, match="not both"):
        DPEngine(mlp(), {}, noise_multiplier=1.1, gradient_noise_multiplier=1.1, expected_batch_size=2)


# ------------------------------------------------ split draws (large models, several threads)


def _split_source(monkeypatch, seed=11, split_min=1000):
    from dpclip.engine import noise

    monkeypatch.setattr(noise, "SPLIT_MIN_NUMEL", split_min)
    return noise.NoiseSource(seed)


def _draw(source, like, stds):
    out = [torch.zeros_like(t) for t in like]
    source.add_gaussians(out, stds)
    return out


def _corr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def test_split_draw_has_each_tensors_std_and_independent_coordinates(monkeypatch):
    from dpclip.engine.noise import STREAMS

    source = _split_source(monkeypatch)
    like = [torch.zeros(40_000, dtype=DTYPE), torch.zeros(100, 240, dtype=DTYPE)]
    stds = [1.0, 3.0]
    out = _draw(source, like, stds)
    assert [o.shape for o in out] == [t.shape for t in like]
    for z, std in zip(out, stds):
        n = z.numel()
        # sd of the sample std / true std ≈ 1/sqrt(2(n−1)); sd of the mean = std/sqrt(n)
        assert abs(float(z.std()) / std - 1) < 5 / math.sqrt(2 * (n - 1))
        assert abs(float(z.mean()) / std) < 5 / math.sqrt(n)
    flat = torch.cat([out[0], out[1].flatten() / 3.0])   # unit variance, concatenation order
    slices = flat.view(STREAMS, -1)                      # stream k's slice (64,000 / 8 each)
    m = slices.shape[1]
    # The streams must not be copies or shifts of each other: each pair, aligned and shifted
    # by one, is uncorrelated (sd of a null correlation ≈ 1/sqrt(m)).
    for a in range(STREAMS):
        for b in range(a + 1, STREAMS):
            assert abs(_corr(slices[a], slices[b])) < 5 / math.sqrt(m)
            assert abs(_corr(slices[a][1:], slices[b][:-1])) < 5 / math.sqrt(m)
    assert abs(_corr(flat[1:], flat[:-1])) < 5 / math.sqrt(flat.numel())


def test_split_draw_is_the_same_on_any_thread_count_and_moves_on_each_step(monkeypatch):
    like = [torch.zeros(3000), torch.zeros(5, 7)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _draw(_split_source(monkeypatch), like, [1.0, 2.0])
        torch.set_num_threads(3)
        source = _split_source(monkeypatch)
        three = _draw(source, like, [1.0, 2.0])
        following = _draw(source, like, [1.0, 2.0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, three))
    assert abs(_corr(three[0], following[0])) < 5 / math.sqrt(3000)   # a fresh split each step
    unseeded = _draw(_split_source(monkeypatch, seed=None), like, [1.0, 2.0])
    assert not torch.equal(unseeded[0], one[0])


def test_below_the_split_size_one_generator_draws_everything_in_order():
    from dpclip.engine.noise import NoiseSource

    # small tensors share one unit draw over their concatenation, in order, each piece scaled
    like = [torch.zeros(30), torch.zeros(4, 5)]
    got = _draw(NoiseSource(5), like, [1.0, 2.0])
    reference = NoiseSource(5)
    unit = torch.empty(50).normal_(generator=reference.generator(torch.device("cpu")))
    want = [unit[:30] * 1.0, (unit[30:] * 2.0).view(4, 5)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_noise_is_added_in_place_in_chunks_with_the_same_distribution(monkeypatch):
    from dpclip.engine import noise

    monkeypatch.setattr(noise, "CHUNK", 1000)     # 25 chunks per tensor, drawn one after another
    target = torch.full((25_000,), 7.0, dtype=DTYPE)
    same = target
    noise.NoiseSource(9).add_gaussians([target], [2.0])
    assert target is same
    z = (target - 7.0) / 2.0
    n = z.numel()
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * (n - 1)) and abs(float(z.mean())) < 5 / math.sqrt(n)
    chunks = z.view(25, 1000)
    assert all(abs(_corr(chunks[i], chunks[i + 1])) < 5 / math.sqrt(1000) for i in range(24))
    with pytest.raises(ValueError):
        noise.NoiseSource(9).add_gaussians([torch.zeros(4, 4).t()], [1.0])


@pytest.mark.parametrize("seed", [3, None])
def test_split_noise_resumes_from_the_state_dict(monkeypatch, seed):
    from dpclip.engine import noise

    monkeypatch.setattr(noise, "SPLIT_MIN_NUMEL", 64)   # the mlp's parameters are drawn split
    model = mlp()
    twin = copy.deepcopy(model)
    engine = DPEngine(model, {}, gradient_noise_multiplier=1.0, expected_batch_size=2, seed=seed)
    engine.privatize()
    state = engine.state_dict()
    engine.privatize()
    want = [p.grad.clone() for p in model.parameters()]
    resumed = DPEngine(twin, {}, gradient_noise_multiplier=1.0, expected_batch_size=2, seed=None if seed is None else 99)
    resumed.load_state_dict(state)
    resumed.privatize()
    for p, w in zip(twin.parameters(), want):
        assert torch.equal(p.grad, w)


@pytest.mark.parametrize("scaled_spans", [None, 0], ids=["span by span", "multi-tensor multiply"])
def test_packed_device_draw_gives_each_tensor_its_own_std_in_place(monkeypatch, scaled_spans):
    # The GPU path (_add_drawn_packed, device-agnostic) run on CPU tensors: small tensors share
    # a draw, a dtype change or a full run starts a new one, a large tensor is drawn alone;
    # scaled by one multiply per span of one std, or (many spans on a GPU) per tensor.
    from dpclip.engine import noise

    monkeypatch.setitem(noise.MAX_SCALED_SPANS, "cpu", scaled_spans)

    gen = torch.Generator().manual_seed(11)
    sizes = [500, 500] + [int(n) for n in torch.randint(1, 3000, (60,), generator=gen)] + [5000]
    dtypes = [torch.float64 if i % 7 == 3 else torch.float32 for i in range(len(sizes))]
    stds = [(0.5, 1.0, 3.0)[i % 3] for i in range(len(sizes))]
    targets = [torch.full((n,), 7.0, dtype=d) for n, d in zip(sizes, dtypes)]
    same = list(targets)
    noise._add_drawn_packed(targets, stds, torch.Generator().manual_seed(4), chunk=2000)
    assert all(a is b for a, b in zip(targets, same))
    for std in (0.5, 1.0, 3.0):
        z = torch.cat([((t - 7.0) / s).double() for t, s in zip(targets, stds) if s == std])
        n = z.numel()
        assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * (n - 1)) and abs(float(z.mean())) < 5 / math.sqrt(n)
    # consecutive tensors of one run are different slices of one draw: uncorrelated
    first, second = ((targets[i] - 7.0).double() for i in (0, 1))
    assert abs(_corr(first, second)) < 5 / math.sqrt(500)


def test_tiny_float32_thresholds_still_get_their_noise():
    """σ·sqrt(Σ C_k²) in float32 underflowed to 0 below C ≈ 1e-23 while the clipped gradients (of
    size C) did not: the step released them exactly. The std is taken in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 5))
    threshold, batch = 1e-24, 4
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": threshold}},
                      gradient_noise_multiplier=1.0, expected_batch_size=batch, seed=0)
    engine.backward(0.0 * model(torch.randn(3, 30)).sum(1))   # zero loss: p.grad is pure noise
    report = engine.privatize()
    expected = threshold / math.sqrt(2) * math.sqrt(2) / batch   # C_k = C/sqrt(2), S = sqrt(2)·C_k
    assert report.noise_std_grad.tolist() == pytest.approx([expected] * 2, rel=1e-6)
    z = torch.cat([p.grad.flatten().double() for p in model.parameters()])
    # sd of the sample std / true std ≈ 1/sqrt(2(n−1))
    assert abs(float(z.std()) / expected - 1) < 5 / math.sqrt(2 * (z.numel() - 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_models_noise_is_drawn_and_added_in_float32_and_rounded_after(dtype):
    """The Gaussian mechanism is the float32 noisy sum; the half-precision p.grad is its rounding
    (post-processing). A draw or an addition in bf16/fp16 would round the noise before the sum
    and round twice: the same seed's noise would differ from the float32 model's rounded."""
    grads = {}
    for kind in (torch.float32, dtype):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 5)).to(kind)
        engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.3,
                          expected_batch_size=3, seed=0)
        engine.backward(0.0 * model(torch.randn(3, 30).to(kind)).float().sum(1))   # zero sums: p.grad is noise/B
        engine.privatize()
        grads[kind] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert grads[dtype].dtype == dtype
    assert torch.equal(grads[dtype], grads[torch.float32].to(dtype))


def test_a_noise_std_beyond_the_dtype_is_refused_before_anything_is_released():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 5))
    # thresholds that grew without bound after the engine was made (a fixed 3e38 is refused when it is made)
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": [1.0, 1.0]}},
                      gradient_noise_multiplier=1.0, expected_batch_size=4, seed=0)
    engine.policy.load_state_dict({"thresholds": [3e38, 3e38]})
    engine.backward(classify_loss(model, {"x": torch.randn(3, 30), "y": torch.tensor([0, 1, 2])}))
    with pytest.raises(EngineError, match="not finite") as caught:
        engine.privatize()
    assert "lower clipping.threshold" in caught.value.hint
    assert all(p.grad is None for p in model.parameters())
    # the refused step's sums are gone: the next step holds its own batch only
    batch = {"x": torch.randn(2, 30), "y": torch.tensor([1, 0])}
    engine.backward(classify_loss(model, batch))
    engine_sums = engine.debug_clipped().sums
    engine.detach()
    fresh = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": [1.0, 1.0]}},
                     gradient_noise_multiplier=1.0, expected_batch_size=4, seed=0)
    fresh.policy.load_state_dict({"thresholds": [3e38, 3e38]})
    fresh.backward(classify_loss(model, batch))
    fresh_sums = fresh.debug_clipped().sums
    assert all(torch.equal(engine_sums[k], fresh_sums[k]) for k in fresh_sums)


# ------------------------------------------------ thresholds and σ_g beyond float32 (hostile review)


@pytest.mark.parametrize("value", [1e39, 1e300, 1e-46])
def test_a_fixed_threshold_outside_float32s_range_is_refused_before_any_step(value):
    # 1e39 became inf in the float32 thresholds: no clipping (c_k = 1) and noise of std σ·inf, refused
    # only at the first release; 1e-46 became 0 (every gradient clipped to nothing, no noise)
    with pytest.raises(EngineError, match="float32"):
        DPEngine(mlp(), {"threshold": {"kind": "fixed", "value": value}}, gradient_noise_multiplier=1.0,
                 expected_batch_size=2)


def test_a_threshold_whose_noise_float32_cannot_hold_is_refused_with_a_hint_before_any_step():
    # 3e38 is within float32, but σ_g·C is not: refused at construction, not at every release
    with pytest.raises(EngineError, match="beyond torch.float32's range") as info:
        DPEngine(mlp().float(), {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": [3e38]}},
                 gradient_noise_multiplier=1e10, expected_batch_size=2)
    assert info.value.hint


@pytest.mark.parametrize("sigma", [math.nan, math.inf, 1e100])
def test_a_noise_multiplier_whose_noise_float32_cannot_hold_is_refused_before_any_step(sigma):
    # NaN passed the `σ < 0` check; inf and 1e100·C gave an infinite noise std, refused only at the first release
    with pytest.raises(EngineError) as info:
        DPEngine(mlp().float(), {}, gradient_noise_multiplier=sigma, expected_batch_size=2)
    assert info.value.hint


def test_a_threshold_split_below_float32s_smallest_normal_number_is_refused_with_a_hint():
    # C = 1.5e-38 passes the spec, but each of the 3 layers gets C/sqrt(3), subnormal in float32
    with pytest.raises(EngineError, match="outside the range of torch.float32") as info:
        DPEngine(mlp().float(), {"grouping": "layer", "threshold": {"kind": "fixed", "value": 1.5e-38}},
                 gradient_noise_multiplier=1.0, expected_batch_size=2)
    assert info.value.hint


@pytest.mark.parametrize("arguments", [{"gradient_noise_multiplier": True},
                                       {"noise_multiplier": True, "sample_rate": 0.1},
                                       {"gradient_noise_multiplier": 1.0, "sample_rate": True},
                                       {"gradient_noise_multiplier": 1.0, "expected_batch_size": True}])
def test_a_bool_for_the_engines_noise_multiplier_rate_or_batch_size_is_refused_not_read_as_one(arguments):
    with pytest.raises(EngineError) as info:
        DPEngine(torch.nn.Linear(3, 2), **{"expected_batch_size": 8, **arguments})
    assert "True" in str(info.value) and info.value.hint
