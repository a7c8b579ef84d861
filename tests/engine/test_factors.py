"""Factor math: ghost norms, embedding norms, cross terms, clipped sums (dpclip/engine/factors.py)."""

import pytest
import torch
from torch import nn
from hypothesis import given, settings, strategies as st

from dpclip.engine.factors import (Bilinear, Dense, choose_ghost, clipped_sum, ghost_norm_sq, instantiate,
                                   param_norm_sq)
from dpclip.engine.streamed import streamed_clip
from tests.engine.conftest import DTYPE, per_sample_reference

FEW = settings(max_examples=8, deadline=None)


def _dense(gen, b, g, t, m, n):
    return Bilinear(torch.randn(b, g, t, m, generator=gen, dtype=DTYPE),
                    torch.randn(b, g, t, n, generator=gen, dtype=DTYPE))


def _ids(gen, b, t, vocab, n):
    return Bilinear(torch.randint(0, vocab, (b, t), generator=gen),
                    torch.randn(b, 1, t, n, generator=gen, dtype=DTYPE), vocab=vocab)


@FEW
@given(b=st.integers(1, 3), g=st.integers(1, 3), t=st.integers(1, 5), m=st.integers(1, 4),
       n=st.integers(1, 4), seed=st.integers(0, 99))
def test_ghost_norm_equals_norm_of_instantiated_gradient(b, g, t, m, n, seed):
    use = _dense(torch.Generator().manual_seed(seed), b, g, t, m, n)
    explicit = instantiate(use).flatten(1).pow(2).sum(1)
    torch.testing.assert_close(ghost_norm_sq(use.left, use.right), explicit)
    # instantiate is the per-sample sum over t of outer products L_tᵀ R_t
    torch.testing.assert_close(instantiate(use)[:, 0, :, :],
                               torch.einsum("btm,btn->bmn", use.left[:, 0], use.right[:, 0]))


@FEW
@given(b=st.integers(1, 3), t=st.integers(1, 6), vocab=st.integers(1, 5), n=st.integers(1, 4),
       seed=st.integers(0, 99))
def test_embedding_ghost_norm_counts_repeated_tokens(b, t, vocab, n, seed):
    use = _ids(torch.Generator().manual_seed(seed), b, t, vocab, n)
    onehot = torch.nn.functional.one_hot(use.left, vocab).to(DTYPE)
    explicit = torch.einsum("btv,btn->bvn", onehot, use.right[:, 0])
    torch.testing.assert_close(instantiate(use)[:, 0], explicit)
    ghost = param_norm_sq([use], torch.Size([vocab, n]), "ghost", out_dtype=DTYPE)[0]
    torch.testing.assert_close(ghost, explicit.flatten(1).pow(2).sum(1))


@FEW
@given(t_e=st.integers(1, 5), t_h=st.integers(1, 5), vocab=st.integers(2, 6), d=st.integers(1, 4),
       extra=st.booleans(), method=st.sampled_from(["auto", "ghost", "instantiate"]),
       seed=st.integers(0, 99))
def test_tied_embedding_and_head_norm_has_exact_cross_term(t_e, t_h, vocab, d, extra, method, seed):
    # Embedding use (ids, b^e) + head use (L = b^h [T_h, V], R = h [T_h, d]) of one V x d
    # weight, optionally a third instantiated use: ||Σ||² over all cross terms.
    gen = torch.Generator().manual_seed(seed)
    b = 3
    uses = [_ids(gen, b, t_e, vocab, d), _dense(gen, b, 1, t_h, vocab, d)]
    if extra:
        uses.append(Dense(torch.randn(b, vocab, d, generator=gen, dtype=DTYPE)))
    shape = torch.Size([vocab, d])
    full = per_sample_reference(uses, shape)
    norm_sq, parts = param_norm_sq(uses, shape, method)
    torch.testing.assert_close(norm_sq, full.flatten(1).pow(2).sum(1))
    c = torch.rand(b, generator=gen, dtype=DTYPE)
    torch.testing.assert_close(clipped_sum(parts, c, shape), torch.einsum("b,bvd->vd", c, full))
    # dropping the cross term would be wrong: the test data must make it matter
    separate = sum(per_sample_reference([u], shape).flatten(1).pow(2).sum(1) for u in uses)
    assert not torch.allclose(separate, norm_sq)


@FEW
@given(calls=st.lists(st.integers(1, 4), min_size=1, max_size=3), g=st.integers(1, 2),
       method=st.sampled_from(["auto", "ghost", "instantiate"]), seed=st.integers(0, 99))
def test_several_calls_of_one_layer_concatenate_along_t(calls, g, method, seed):
    gen = torch.Generator().manual_seed(seed)
    uses = [_dense(gen, 2, g, t, 3, 4) for t in calls]
    shape = torch.Size([g * 3, 4])
    full = per_sample_reference(uses, shape)
    norm_sq, parts = param_norm_sq(uses, shape, method)
    torch.testing.assert_close(norm_sq, full.flatten(1).pow(2).sum(1))
    c = torch.tensor([0.3, 1.7], dtype=DTYPE)
    torch.testing.assert_close(clipped_sum(parts, c, shape), torch.einsum("b,bmn->mn", c, full))


def test_memory_rule_instantiates_exactly_when_the_gradient_fits_in_its_factors():
    # m = n = 128: G_i has 16384 entries, its factors T·256: equal at T = 64.
    def use(t):
        return Bilinear(torch.zeros(1, 1, t, 128), torch.zeros(1, 1, t, 128))
    assert choose_ghost(use(63), "auto") and not choose_ghost(use(64), "auto")
    assert choose_ghost(use(64), "ghost") and not choose_ghost(use(63), "instantiate")


@settings(max_examples=200, deadline=None)
@given(t=st.integers(1, 300), m=st.integers(1, 300), n=st.integers(1, 300))
def test_memory_rule_instantiates_wherever_fastdp_space_rule_does(t, m, n):
    use = Bilinear(torch.empty(1, 1, t, m, device="meta"), torch.empty(1, 1, t, n, device="meta"))
    if 2 * t * t >= m * n:
        assert not choose_ghost(use, "auto")


def test_transient_rule_instantiates_when_gradient_is_at_most_kappa_times_its_factors():
    # m = n = 128: G_i has 16384 entries, the factors T·256. Off the CPU κ = 2 reaches it at
    # T = 32; on the CPU κ = 2.5 at T = 26 (16384 ≤ 2.5·26·256). The memory rule still
    # ghost-norms until T = 64.
    def use(t, device="cpu"):
        return Bilinear(torch.zeros(1, 1, t, 128, device=device), torch.zeros(1, 1, t, 128, device=device))
    assert choose_ghost(use(25), "auto", transient=True)
    assert not choose_ghost(use(26), "auto", transient=True)
    assert choose_ghost(use(31, "meta"), "auto", transient=True)
    assert not choose_ghost(use(32, "meta"), "auto", transient=True)
    assert choose_ghost(use(32), "auto") and choose_ghost(use(63), "auto")
    assert choose_ghost(use(64), "ghost", transient=True)
    # ids factors are T integers + T·n: a 1000-row embedding stays ghost-normed at T = 64
    ids = Bilinear(torch.zeros(1, 64, dtype=torch.long), torch.zeros(1, 1, 64, 16), vocab=1000)
    assert choose_ghost(ids, "auto", transient=True)


def test_transient_instantiation_keeps_the_gradient_instead_of_its_factors():
    gen = torch.Generator().manual_seed(5)
    use = _dense(gen, 3, 1, 40, 6, 9)            # G_i (54 entries) below its factors (600)
    wide = _dense(gen, 3, 1, 3, 6, 9)            # G_i (54) above its factors (45)
    for u, transient, dense in ((use, False, True), (wide, False, False), (wide, True, True)):
        norm_sq, parts = param_norm_sq([u], torch.Size([6, 9]), "instantiate", transient=transient)
        assert isinstance(parts[0], Dense) == dense
        full = per_sample_reference([u], torch.Size([6, 9]))
        torch.testing.assert_close(norm_sq, full.flatten(1).pow(2).sum(1))
        c = torch.tensor([0.2, 1.0, 3.0], dtype=DTYPE)
        torch.testing.assert_close(clipped_sum(parts, c, torch.Size([6, 9])),
                                   torch.einsum("b,bmn->mn", c, full))


@pytest.mark.parametrize("t", [63, 64, 96, 128, 130, 200, 256])
def test_symmetric_ghost_norm_matches_instantiation_for_long_sequences(t):
    # T ≥ 64 cuts the Grams into column strips (4 at T 128, 8 from T 256); T need not divide evenly.
    gen = torch.Generator().manual_seed(t)
    for g in (1, 2):
        use = _dense(gen, 3, g, t, 5, 7)
        torch.testing.assert_close(ghost_norm_sq(use.left, use.right),
                                   instantiate(use).flatten(1).pow(2).sum(1), rtol=1e-10, atol=0)
    # a transposed (non-contiguous) factor, as convolutions hand over
    left = torch.randn(3, 1, 5, t, generator=gen, dtype=DTYPE).transpose(-1, -2)
    right = torch.randn(3, 1, t, 4, generator=gen, dtype=DTYPE)
    torch.testing.assert_close(ghost_norm_sq(left, right),
                               instantiate(Bilinear(left, right)).flatten(1).pow(2).sum(1),
                               rtol=1e-10, atol=0)
    ids = _ids(gen, 3, t, 9, 4)                  # 9 tokens over T positions: many repeats
    torch.testing.assert_close(param_norm_sq([ids], torch.Size([9, 4]), "ghost", out_dtype=DTYPE)[0],
                               instantiate(ids).flatten(1).pow(2).sum(1), rtol=1e-10, atol=0)


def test_wide_factor_is_read_in_panels_or_wider_strips_and_stays_exact(monkeypatch):
    # A factor no cache holds (an lm_head's [T, vocab] output gradient) would be re-read by
    # every strip: up to T 256 on the CPU it is read in panels of columns, every strip's
    # product with a panel added while it is in cache (8 strips of 32); longer sequences
    # take strips of at least GHOST_WIDE_MIN_BLOCK columns. Shrink the thresholds so a small
    # factor counts as wide and spans several panels, and check the strip count
    # symmetric_ghost takes and the norm, with the wide factor on either side.
    from dpclip.engine import grams
    seen = []
    real = grams.ghost_strips
    monkeypatch.setattr(grams, "ghost_strips", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    gen = torch.Generator().manual_seed(5)
    use = _dense(gen, 2, 1, 256, 5, 300)                          # 256 x 300 float64: 600 KiB a sample
    want = instantiate(use).flatten(1).pow(2).sum(1)
    torch.testing.assert_close(ghost_norm_sq(use.left, use.right), want, rtol=1e-10, atol=0)
    assert seen[-1] == 8                                          # 32-column strips
    monkeypatch.setattr(grams, "GHOST_WIDE_BYTES", 256 * 300 * 8 - 1)
    monkeypatch.setattr(grams, "GHOST_PANEL_COLUMNS", 64)         # 5 panels, the last of 44
    panels = []
    real_panels = grams._panel_strips
    monkeypatch.setattr(grams, "_panel_strips", lambda x, *a: panels.append(x.shape[-1]) or real_panels(x, *a))
    torch.testing.assert_close(ghost_norm_sq(use.left, use.right), want, rtol=1e-10, atol=0)
    assert seen[-1] == 256 // grams.GHOST_MIN_BLOCK["cpu"] == 8 and panels == [300]
    swapped = Bilinear(use.right, use.left)                       # the wide factor on the left
    torch.testing.assert_close(ghost_norm_sq(swapped.left, swapped.right),
                               instantiate(swapped).flatten(1).pow(2).sum(1), rtol=1e-10, atol=0)
    assert panels == [300, 300]
    wide = grams.GHOST_WIDE_BYTES + 1
    assert grams.ghost_panel(512, torch.device("cpu"), wide) is None
    assert real(512, torch.device("cpu"), wide) == 4              # 128-column strips
    assert real(1024, torch.device("cpu"), wide) == 4             # 256-column strips
    # a narrow factor: 32-column strips, at most 8 of them (128 columns at T 1024)
    assert [real(t, torch.device("cpu"), wide - 1) for t in (64, 128, 256, 1024)] == [2, 4, 8, 8]
    assert grams.ghost_panel(256, torch.device("meta"), wide) is None      # not on other devices
    assert grams.ghost_panel(256, torch.device("cpu"), wide - 1) is None   # nor for narrow factors


@pytest.mark.parametrize("one_at_a_time, min_numel, per_sample", [
    (False, None, False), (True, None, True),
    (None, None, False),    # the default on the CPU: G_i of 94 entries is batched
    (None, 94, True)])      # ... and one sample at a time from ONE_AT_A_TIME_MIN_NUMEL on
def test_streamed_clip_equals_clipping_fully_instantiated_gradients(one_at_a_time, min_numel, per_sample,
                                                                     monkeypatch):
    from dpclip.engine import streamed
    if min_numel is not None:
        monkeypatch.setattr(streamed, "ONE_AT_A_TIME_MIN_NUMEL", min_numel)
    gen = torch.Generator().manual_seed(8)
    # G_i 40 and 54 entries vs factors 13 and 15 (T = 1): G of a chunk ≤ twice the
    # factors held, chunks of 7·2·28//94 = 4 samples (4 + 3)
    bundles = [_dense(gen, 7, 1, 1, 5, 8), _dense(gen, 7, 1, 1, 6, 9)]
    shapes = [torch.Size([5, 8]), torch.Size([6, 9])]
    base = torch.rand(7, generator=gen, dtype=DTYPE)
    full = [per_sample_reference([b], s) for b, s in zip(bundles, shapes)]
    norms_ref = (base + sum(g.flatten(1).pow(2).sum(1) for g in full)).sqrt()
    threshold = norms_ref.median()
    factors = (threshold / norms_ref).clamp(max=1.0)
    calls = []

    def clip(chunk_norms, rows):
        calls.append((rows.start, chunk_norms.shape[0]))   # the rows let a caller weight them
        return (threshold / chunk_norms).clamp(max=1.0)

    norms, sums = streamed_clip(bundles, shapes, base, clip, one_at_a_time=one_at_a_time)
    assert calls == ([(i, 1) for i in range(7)] if per_sample else [(0, 4), (4, 3)])
    torch.testing.assert_close(norms, norms_ref)
    for total, g in zip(sums, full):
        torch.testing.assert_close(total, torch.einsum("b,bmn->mn", factors, g))


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_streamed_clip_drops_a_nonfinite_first_sample(one_at_a_time):
    # The per-sample path computes sample 0's G_0 into the sum itself: a NaN there must not
    # survive into the sum, nor one in a later sample.
    gen = torch.Generator().manual_seed(9)
    use = _dense(gen, 5, 1, 3, 4, 6)
    use.left[0, 0, 1, 2] = float("nan")
    use.right[3, 0, 0, 1] = float("inf")
    full = per_sample_reference([use], torch.Size([4, 6]))
    norms, (total,) = streamed_clip([use], [torch.Size([4, 6])], torch.zeros(5, dtype=DTYPE),
                                    lambda n, rows: (1.0 / n).clamp(max=1.0), one_at_a_time=one_at_a_time)
    assert not norms[0].isfinite() and not norms[3].isfinite() and norms[[1, 2, 4]].isfinite().all()
    keep = [1, 2, 4]
    want = torch.einsum("b,bmn->mn", (1.0 / full[keep].flatten(1).norm(dim=1)).clamp(max=1.0), full[keep])
    torch.testing.assert_close(total, want)


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
def test_streamed_clip_paths_agree_when_norms_are_wider_than_the_factors(factor_dtype):
    # float32 (or bf16) factors with float64 norms, as a model whose first parameter is
    # float64 gives: both paths keep G_i in the factors' (widened) dtype and agree.
    gen = torch.Generator().manual_seed(10)
    use = Bilinear(torch.randn(3, 1, 5, 4, generator=gen).to(factor_dtype),
                   torch.randn(3, 1, 5, 6, generator=gen).to(factor_dtype))
    base = torch.rand(3, generator=gen, dtype=torch.float64)
    clip = lambda n, rows: (2.0 / n).clamp(max=1.0)   # noqa: E731
    got = streamed_clip([use], [torch.Size([4, 6])], base, clip, one_at_a_time=True)
    want = streamed_clip([use], [torch.Size([4, 6])], base, clip, one_at_a_time=False)
    assert got[1][0].dtype == want[1][0].dtype == (torch.float32 if factor_dtype == torch.float32 else torch.float64)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1][0], want[1][0])


def test_gram_cache_reuses_the_left_gram_only_for_the_same_unchanged_memory():
    from dpclip.engine.factors import GramCache, symmetric_ghost

    gen = torch.Generator().manual_seed(21)
    left = torch.randn(3, 1, 130, 6, generator=gen, dtype=DTYPE)
    rights = [torch.randn(3, 1, 130, n, generator=gen, dtype=DTYPE) for n in (5, 7, 4)]
    for strips in (1, 4):     # the shared factor on the left here; in the engine, a Linear's input is the right
        cache = GramCache()
        for right in rights:                    # q, k, v of one input: one left Gram
            got = symmetric_ghost(left.view(3, 1, 130, 6), right, False, strips=strips, cache=cache)
            want = symmetric_ghost(left, right, False, strips=strips)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(got[0].sum(1), instantiate(Bilinear(left, right)).flatten(1).pow(2).sum(1),
                                       rtol=1e-10, atol=0)
        assert cache.hits == 2
        fresh = [torch.randn(3, 1, 130, 2, generator=gen, dtype=DTYPE) for _ in range(2)]
        # equal values in other memory: computed afresh (the entry's memory is not that one)
        twin = left.clone()
        symmetric_ghost(twin, fresh[0], False, strips=strips, cache=cache)
        assert cache.hits == 2
        # changed in place: the version moved, the old Gram is not used
        twin.mul_(2)
        got = symmetric_ghost(twin, fresh[1], False, strips=strips, cache=cache)
        assert cache.hits == 2
        torch.testing.assert_close(got[0].sum(1), instantiate(Bilinear(twin, fresh[1])).flatten(1).pow(2).sum(1),
                                   rtol=1e-10, atol=0)
        # the right factor is looked up too (a Linear's input is its right factor)
        symmetric_ghost(fresh[0], fresh[1], False, strips=strips, cache=cache)
        assert cache.hits == 3


class _SharedInput(nn.Module):
    """q, k, v read one normalised input, as in Llama's attention."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.q, self.k, self.v = nn.Linear(6, 5), nn.Linear(6, 3), nn.Linear(6, 4)

    def forward(self, x):
        h = self.norm(x)
        return (self.q(h).sum(-1) + self.k(h).pow(2).sum(-1) - self.v(h).sum(-1)).sum(-1)


@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_layers_sharing_an_input_get_exact_norms_with_one_gram(grouping, monkeypatch):
    from dpclip.engine import group_norms
    from tests.engine.conftest import check_exact

    caches = []

    class Counting(group_norms.GramCache):
        def __init__(self):
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(group_norms, "GramCache", Counting)
    torch.manual_seed(0)
    x = torch.randn(5, 70, 6, dtype=DTYPE)
    check_exact(lambda: _SharedInput().to(DTYPE), lambda model, batch: model(batch["x"]), {"x": x},
                grouping=grouping, norm_method="ghost")
    assert sum(c.hits for c in caches) == 2      # k and v reuse q's input Gram (reverse order)
