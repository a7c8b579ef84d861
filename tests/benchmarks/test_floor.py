"""benchmarks/floor.py: the flop floor of exact per-sample clipping, against hand counts (issue 32).

Every expected number below is written out by hand from the formulas in the module's
docstring (one flop = one add or one multiply); none is computed by the code under test.
"""

import json

import pytest
import torch
from torch import nn

from tests.benchmarks.loader import load_benchmark

def load():
    return load_benchmark("floor")


floor = load()


def two_linear_layers():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    x = torch.empty(2, 5, 3, device="meta")  # B 2, T 5; the input needs no gradient
    return floor.walk(model, {"input": x}, batch=2)


def test_two_linear_layers_match_the_hand_count():
    params = two_linear_layers()
    result = floor.floor(params, batch=2)
    costs = {p.name: floor.param_costs(p, 2, "symmetric") for p in params}
    # Linear(3 -> 4), weight 4 x 3 (m 4, n 3), B·T = 10 tokens:
    #   forward 2·2·5·4·3 = 240; backward: weight gradient only (its input needs none) 240
    #   ghost, symmetric: Grams 2·5·6·(4+3) = 420, their inner product 2·5·6 = 60,
    #   scaling the thinner factor 2·5·3 = 30: 510; instantiate: 4·2·4·3 = 96
    w1 = costs["0.weight"]
    assert (w1["forward"], w1["backward"]) == (240, 240)
    assert w1["options"] == {"ghost": 510, "instantiate": 96}
    assert (w1["choice"], w1["floor"]) == ("instantiate", 96)
    # bias 4: forward 2·5·4 = 40, backward 2·40 = 80, extra 4·2·4 = 32
    assert (costs["0.bias"]["forward"], costs["0.bias"]["backward"], costs["0.bias"]["floor"]) == (40, 80, 32)
    # Linear(4 -> 2), weight 2 x 4: forward 2·2·5·2·4 = 160, backward (input gradient
    #   too) 4·2·5·2·4 = 320; ghost 2·5·6·(2+4) = 360 + 60 + 2·5·2 = 20: 440; inst 4·2·2·4 = 64
    w2 = costs["1.weight"]
    assert (w2["forward"], w2["backward"]) == (160, 320)
    assert w2["options"] == {"ghost": 440, "instantiate": 64}
    # bias 2: forward 20, backward 40, extra 4·2·2 = 16
    assert (costs["1.bias"]["forward"], costs["1.bias"]["backward"], costs["1.bias"]["floor"]) == (20, 40, 16)
    # totals: non-private 240+240+40+80 + 160+320+20+40 = 1140; extra 96+32+64+16 = 208;
    # all ghost 510+32+440+16 = 998
    assert (result["nonprivate"], result["extra"], result["ghost_extra"]) == (1140, 208, 998)
    assert result["ratio"] == pytest.approx((1140 + 208) / 1140)
    assert result["parameters"] == 4 * 3 + 4 + 2 * 4 + 2


def test_the_full_gram_count_is_the_symmetric_one_without_symmetry():
    params = two_linear_layers()
    w1 = floor.param_costs(params[0], 2, "full")
    # Linear(3 -> 4): Grams 2·2·5²·(4+3) = 700, inner product 2·2·5² = 100, scaling 30
    assert w1["options"]["ghost"] == 830
    # the symmetric count is at least half the full one (the diagonal is computed once)
    for t in (2, 7, 64, 1024):
        sym, full = floor.gram_flops(3, t, 768, "symmetric"), floor.gram_flops(3, t, 768, "full")
        assert full / 2 < sym < full


def test_a_tied_embedding_and_head_is_one_norm_with_its_cross_term():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 2)
            self.head = nn.Linear(2, 6, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    with torch.device("meta"):
        model = Tied()
    params = floor.walk(model, {"ids": torch.zeros(1, 3, dtype=torch.long, device="meta")}, batch=1)
    assert len(params) == 1 and [c.kind for c in params[0].calls] == ["ids", "dense"]
    cost = floor.param_costs(params[0], 1, "symmetric")
    # B 1, T 3, V 6, d 2. Non-private: embedding backward 1·3·2 = 6; head forward
    # 2·1·3·6·2 = 72, backward 4·1·3·6·2 = 144
    assert (cost["forward"], cost["backward"]) == (72, 150)
    # instantiate both: 4·1·6·2 = 48
    # head ghost: Grams 1·3·4·(6+2) = 96, inner 12, scaling 1·3·2 = 6: 114
    # embedding ghost: Gram 1·3·4·2 = 24, masked sum 12/2 = 6, scaling 6: 36
    # cross term: 2·1·3·3·2 = 36 + 2·1·3·3 = 18: 54  -> ghost 114 + 36 + 54 = 204
    # mixed: head ghost 114 + embedding rows 4·1·3·2 = 24 + cross 2·1·3·3·2 = 36 + 2·1·3·2 = 12: 186
    assert cost["options"] == {"instantiate": 48, "ghost": 204, "mixed": 186}
    assert cost["choice"] == "instantiate"


def test_a_wide_layer_switches_from_ghost_to_instantiation_where_the_hand_count_says():
    # Linear 64 x 64, B 1: instantiate 4·64·64 = 16384; ghost T(T+1)·128 + T(T+1) + 64·T:
    # T 10: 110·129 + 640 = 14830 < 16384 -> ghost; T 11: 132·129 + 704 = 17732 -> instantiate
    for t, choice in ((10, "ghost"), (11, "instantiate")):
        p = floor.Param("w", "w", 64 * 64, [floor.Call("dense", 64, 64, t)])
        assert floor.param_costs(p, 1, "symmetric")["choice"] == choice


@pytest.mark.parametrize("seq", [16, 64, 256, 1024])
def test_the_ratio_of_one_wide_layer_is_at_most_one_plus_two_thirds_over_t(seq):
    # one dense layer whose input needs a gradient: non-private 6·B·T·m·n, the floor at
    # most 4·B·m·n, so ratio - 1 <= 2 / (3T), equal once instantiation is cheaper:
    # ghost T(T+1)·3840 + T(T+1) + 768·T against 4·768·3072 = 9,437,184 a sample is
    # cheaper up to T 48 (48·49·3841 + 36,864 = 9,070,896), so at T 16 the bound is strict
    p = floor.Param("w", "w", 768 * 3072, [floor.Call("dense", 768, 3072, seq)])
    result = floor.floor([p], batch=4)
    assert result["ratio"] > 1
    if seq < 49:
        assert result["ratio"] - 1 < 2 / (3 * seq)
    else:
        assert result["ratio"] - 1 == pytest.approx(2 / (3 * seq))


def test_gpt2_small_non_private_flops_match_the_hand_count():
    result = floor.gpt2_floor(4, 256)
    # B·T = 1024 tokens. Dense weights: per block 768·2304 + 768·768 + 2·768·3072 =
    # 7,077,888, times 12 = 84,934,656, plus lm_head 50257·768 = 38,597,376: 123,532,032,
    # each 6 flops a token (all their inputs need gradients): 6·1024·123,532,032
    dense = 6 * 1024 * 123_532_032
    # attention 12 layers · (4 + 8)·B·T²·d = 12·12·4·256²·768
    attention = 12 * 12 * 4 * 256**2 * 768
    # embeddings' scatter (wte, wpe): 2·1024·768; vectors: 25 LayerNorms · 2 · 768 plus
    # biases 12·(2304 + 768 + 3072 + 768), 3 flops a token each
    small = 2 * 1024 * 768 + 3 * 1024 * (25 * 2 * 768 + 12 * 6912)
    assert result["nonprivate"] == dense + attention + small
    assert result["parameters"] == 124_439_808


def test_gpt2_small_floor_instantiates_the_wide_layers_where_the_engine_ghosts_at_t256():
    """The floor counts flops only, with memory for any G_i: instantiating costs 4·B·m·n
    extra, ghost norms about B·T²·(m+n), so at T 256 and 1024 it instantiates every wide
    layer. The engine's layer-wise time rule ghost-norms the three wide layers of each
    block at T 256 (benchmarks/README.md: ghost plus the clipped GEMM measured 0.83-0.87x
    the time of instantiating them there): instantiation writes and reads B·m·n per-sample
    values, memory traffic the floor does not count. At T 1024 both instantiate."""
    wide = ("attn.c_attn", "mlp.c_fc", "mlp.c_proj")
    for seq, engine in ((256, "ghost"), (1024, "instantiate")):
        rows = {r["kind"]: r for r in floor.gpt2_floor(4, seq)["layers"]}
        for name in wide:
            row = rows[f"transformer.h.*.{name}"]
            assert row["choice"] == "instantiate"
            assert row["engine"].split(" / ")[1] == engine
            assert row["instantiate"] < row["ghost"] / 20
        # the 768 x 768 attention projection is narrow enough for the engine to instantiate at T 256
        assert rows["transformer.h.*.attn.c_proj"]["engine"].split(" / ")[1] == "instantiate"


def test_gpt2_small_floor_ratio_is_above_one_and_falls_with_t():
    short, long = floor.gpt2_floor(4, 256), floor.gpt2_floor(4, 1024)
    assert 1 < long["ratio"] < short["ratio"] < 1.01
    assert short["ratio"] < short["ghost_ratio"]


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "floor.json"
    results = floor.main(["--shape", "2x16", "--shape", "1x64", "--per-layer", "--json", str(out),
                          "--layers", "2", "--embd", "64", "--heads", "2", "--vocab", "500",
                          "--positions", "64", "--memory"])
    text = capsys.readouterr().out
    assert "memory-aware all-layer" in text and "- 1 x 64, layer: " in text
    assert "| 2 x 16 |" in text and "| 1 x 64 |" in text and "wte/lm_head (tied)" in text
    saved = json.loads(out.read_text())
    assert [(r["batch"], r["seq"]) for r in saved] == [(2, 16), (1, 64)]
    assert saved[0]["ratio"] == results[0]["ratio"] > 1


# ------------------------------------------------------------------ the memory-aware floor


def test_two_linear_layers_memory_matches_the_hand_count():
    params = two_linear_layers()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    # autograd saves each Linear's input for its weight gradient (weights are parameters,
    # left out): x 2·5·3 = 30 floats and the hidden 2·5·4 = 40: 70 floats, 280 bytes
    assert floor.saved_bytes(model, {"input": torch.empty(2, 5, 3, device="meta")}) == 280
    options = {p.name: {o.name: (o.flops, o.held, o.transient)
                        for o in floor.memory_options(p, 2, "symmetric", "all-layer")} for p in params}
    # Linear(3 -> 4), all-layer: ghost holds b_i 2·5·4 = 40 floats, its Grams B·T² = 50 at
    # once; instantiation holds B·m·n = 2·4·3 = 24; norm only holds b_i and one G_i (12) at
    # a time, flops 2·2·5·12 + 2·2·12 + 2·5·3 = 318
    assert options["0.weight"] == {"ghost": (510, 40, 50), "instantiate": (96, 24, 0), "norm only": (318, 40, 12)}
    assert options["0.bias"] == {"per-sample sum": (32, 8, 0)}
    # Linear(4 -> 2): b_i 2·5·2 = 20, G_i 2·2·4 = 16; norm only 2·2·5·8 + 2·2·8 + 2·5·2 = 212
    assert options["1.weight"] == {"ghost": (440, 20, 50), "instantiate": (64, 16, 0), "norm only": (212, 20, 8)}
    # layer-wise holds nothing; instantiation streams chunks of
    # max(1, min(B, 2·B·T·(m+n) // (m·n))) = min(2, 140 // 12) = 2 samples: 24 floats
    layer = {o.name: (o.held, o.transient) for o in floor.memory_options(params[0], 2, "symmetric", "layer")}
    assert layer == {"ghost": (0, 50), "instantiate": (0, 24), "norm only": (0, 24)}
    # all instantiated: held 24 + 8 + 16 + 4 = 52 floats, less the gradients book-keeping
    # has not formed (26 parameters): 26 floats, 104 bytes; all ghost: 72 - 26 + 50 = 96, 384 bytes
    assert floor.config_memory(params, 2, "all-layer", floor.cheapest) == 104
    assert floor.config_memory(params, 2, "all-layer", floor.all_ghost) == 384
    found = floor.memory_floor(params, 2, 104, "all-layer")
    assert (found["extra"], found["memory"]) == (208, 104)
    assert floor.memory_floor(params, 2, 103, "all-layer") is None


def wide_layers(batch=4, seq=8):
    # two Linear(16 -> 16) at B 4, T 8: instantiating costs fewer flops (4·16·16 = 1024 a
    # sample against the Grams' 8·9·32 + 72 + 128 = 2504) but holds more (G_i 256 floats a
    # sample against b_i's 8·16 = 128), the trade the memory-aware floor is about
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    return floor.walk(model, {"input": torch.empty(batch, seq, 16, device="meta")}, batch)


@pytest.mark.parametrize("grouping", floor.GROUPINGS)
def test_the_memory_aware_floor_is_the_flop_floor_with_unlimited_memory(grouping):
    for params, batch in ((two_linear_layers(), 2), (wide_layers(), 4)):
        flop = floor.floor(params, batch)
        found = floor.memory_floor(params, batch, float("inf"), grouping)
        assert found["extra"] == flop["extra"]


def test_with_only_the_ghost_steps_memory_the_floor_is_the_all_ghost_cost():
    params = wide_layers()
    flop = floor.floor(params, 4)
    # all-layer, all ghost: held 2·4·8·16 = 1024 + biases 2·4·16 = 128, less 544 gradients
    # not formed, + Grams 4·8² = 256: 864 floats, 3456 bytes. Instantiating either layer
    # holds 4·256 - 512 = 512 floats more; nothing holds less
    ghost_memory = floor.config_memory(params, 4, "all-layer", floor.all_ghost)
    assert ghost_memory == 3456
    assert floor.memory_floor(params, 4, ghost_memory, "all-layer")["extra"] == flop["ghost_extra"]
    one = floor.memory_floor(params, 4, ghost_memory + 4 * 512, "all-layer")
    assert flop["extra"] < one["extra"] < flop["ghost_extra"]
    assert floor.memory_floor(params, 4, ghost_memory - 1, "all-layer") is None
    # no memory at all: nothing exact fits, every way needs its Grams or its G_i
    assert floor.memory_floor(params, 4, 0, "all-layer") is None


@pytest.mark.parametrize("grouping", floor.GROUPINGS)
def test_the_memory_aware_floor_is_what_enumerating_every_choice_finds(grouping):
    import itertools

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 16), nn.Linear(16, 24), nn.Linear(24, 8))
    params = floor.walk(model, {"input": torch.empty(3, 6, 8, device="meta")}, 3)
    options = [floor.memory_options(p, 3, "symmetric", grouping) for p in params]
    credit = sum(p.numel for p in params) if grouping == "all-layer" else 0
    every = [(sum(o.flops for o in pick),
              floor.extra_memory(sum(o.held for o in pick), max(o.transient for o in pick), credit))
             for pick in itertools.product(*options)]
    for budget in sorted({m for _, m in every}):
        best = min(f for f, m in every if m <= budget)
        assert floor.memory_floor(params, 3, budget, grouping)["extra"] == best


def test_gpt2_small_memory_aware_floor_lies_between_the_flop_floor_and_all_ghost():
    result = floor.gpt2_memory_floor(4, 256)
    for grouping in floor.GROUPINGS:
        found = result[grouping]["found"]
        assert result["flop_ratio"] < result[grouping]["ratio"] < result["ghost_ratio"]
        assert found["memory"] <= result["budget"] < result[grouping]["floor_memory"]
    # at T 1024 G_i (768·p) is smaller than b_i (T·p) for three of a block's four weights:
    # the flop floor fits
    long = floor.gpt2_memory_floor(2, 1024)
    assert long["all-layer"]["ratio"] == long["layer"]["ratio"] == long["flop_ratio"]



def test_floor_gap_divides_each_rounds_ratio_by_flop_floor_plus_noise_share(capsys):
    result = load_benchmark("floor_gap").main(["--smoke"])
    shape = result["shapes"][0]
    times = shape["median_s"]      # one round: medians are that round's times
    noise = min(times["noise draw"], times["noise draw, flat"]) / times["non-private"]
    assert shape["noise_share"][0] == pytest.approx(noise)
    for grouping in ("all-layer", "layer"):
        row = shape["groupings"][grouping]
        measured = times[f"dpclip {grouping}"] / times["non-private"]
        assert row["measured"][0] == pytest.approx(measured)
        assert row["floor"][0] == pytest.approx(row["flop_floor"] + noise)
        assert row["gap"][0] == pytest.approx(measured / (row["flop_floor"] + noise))
    assert "measured / floor" in capsys.readouterr().out


@pytest.mark.parametrize("flat", [False, True])
def test_noise_draw_step_adds_one_unit_gaussian_per_parameter(flat):
    model = nn.Linear(1000, 500)                   # 500,500 parameters: one draw each
    dp_cost = load_benchmark("dp_cost")
    step = (dp_cost.flat_noise_draw_step if flat else dp_cost.noise_draw_step)(model)
    step()
    drawn = torch.cat([b.flatten() for b in step.buffers])
    assert drawn.numel() == 500_500
    # E[z²] = 1 with Var(z²) = 2: the mean of n squares is within 5 standard errors of 1
    assert abs(drawn.pow(2).mean().item() - 1) < 5 * (2 / drawn.numel()) ** 0.5
    assert abs(drawn.mean().item()) < 5 / drawn.numel() ** 0.5
