"""benchmarks/dp_cost.py --smoke runs end to end, so the benchmark cannot rot (issue 8)."""

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "dp_cost.py"


def load():
    spec = importlib.util.spec_from_file_location("dp_cost", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dp_cost"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


DPCLIP = ["non-private", "dpclip all-layer", "dpclip layer", "dpclip param"]


def test_smoke_times_every_dpclip_method_on_every_workload(capsys):
    result = load().main(["--smoke", "--methods", *DPCLIP, "--markdown"])
    assert set(result["workloads"]) == {"gpt2", "cnn", "mlp"}
    for wl in result["workloads"].values():
        assert list(wl["ratio"]) == DPCLIP
        assert set(wl["page_faults"]) == set(DPCLIP) and all(f >= 0 for f in wl["page_faults"].values())
        assert wl["ratio"]["non-private"] == 1.0 and all(r > 0 for r in wl["ratio"].values())
    out = capsys.readouterr().out
    assert "| dpclip param |" in out and "### GPT-2" in out


@pytest.mark.slow  # 12 s
def test_smoke_gpt2_small_runs_each_of_its_shapes():
    result = load().main(["--smoke", "--workloads", "gpt2-small", "--methods", *DPCLIP,
                          "--repeats", "2"])
    assert set(result["workloads"]) == {"gpt2-small 2x16", "gpt2-small 1x64"}
    for key, wl in result["workloads"].items():
        assert wl["workload"] == "gpt2-small" and key.endswith(f"{wl['sizes']['batch']}x{wl['sizes']['seq']}")
        assert list(wl["ratio"]) == DPCLIP and wl["ratio"]["non-private"] == 1.0
    name, sizes = load().resolve("gpt2-small 2x1024")
    assert (name, sizes["batch"], sizes["seq"], sizes["vocab"]) == ("gpt2-small", 2, 1024, 50257)


@pytest.mark.slow  # a benchmark smoke run: the slow set (README)
def test_gpt2_small_shapes_option_times_only_the_named_shapes_each_in_its_own_process():
    result = load().main(["--smoke", "--workloads", "gpt2-small", "--gpt2-small-shapes", "1x64",
                          "--methods", "non-private", "dpclip layer"])
    assert list(result["workloads"]) == ["gpt2-small 1x64"]
    wl = result["workloads"]["gpt2-small 1x64"]
    # timed in a child: its own peak resident set comes back with the times
    assert wl["timing_process_peak_mib"] > 0 and list(wl["ratio"]) == ["non-private", "dpclip layer"]
    with pytest.raises(SystemExit, match="not BxT"):
        load().main(["--smoke", "--workloads", "gpt2-small", "--gpt2-small-shapes", "64"])


def test_smoke_opacus_rows():
    pytest.importorskip("opacus")
    result = load().main(["--smoke", "--workloads", "gpt2", "--methods", "non-private",
                          "opacus hooks", "opacus ghost"])
    assert set(result["workloads"]["gpt2"]["ratio"]) == {"non-private", "opacus hooks", "opacus ghost"}


def test_missing_opacus_is_reported_not_fatal(monkeypatch, capsys):
    module = load()
    monkeypatch.setattr(module, "opacus_available", lambda: False)
    result = module.main(["--smoke", "--workloads", "mlp"])
    assert "opacus is not installed" in capsys.readouterr().out
    assert set(result["workloads"]["mlp"]["ratio"]) == set(DPCLIP)


@pytest.mark.slow  # a benchmark smoke run: the slow set (README)
def test_memory_child_measures_step_memory_in_a_fresh_process():
    module = load()
    mem = module.measure_memory("mlp", "dpclip layer", dict(features=64, hidden=512, batch=512), 1, 1)
    assert mem["step_mib"] > 0  # activations and gradients of a 512-wide MLP at B 512 take megabytes
    # the engine's stash held at least the 512 x 512 layer's factors: 2 x 512 x 512 floats
    assert mem["stash_peak_mib"] >= 2 * 512 * 512 * 4 / 2**20


def test_scaling_reports_the_engines_norm_choice():
    module = load()
    small_t = module.gpt2_norm_methods(embd=256, vocab=1024, seq=32)
    large_t = module.gpt2_norm_methods(embd=256, vocab=1024, seq=512)
    # all-layer / layer-wise; at T 32 the matmul layers stay ghost both ways (256·256 > 2·32·512);
    # at T 512 both instantiate (G_i ≤ its factors)
    assert list(small_t.values())[:4] == ["ghost / ghost"] * 4
    assert list(large_t.values())[:4] == ["instantiate / instantiate"] * 4
    mid = module.gpt2_norm_methods(embd=256, vocab=1024, seq=128)
    assert mid["attn.c_proj 256x256"] == "instantiate / instantiate"  # 65536 ≤ 128·512
    assert mid["attn.c_attn 256x768"] == "ghost / instantiate"  # 128·1024 < 196608 ≤ 2·128·1024
    assert mid["wte/lm_head 1024x256 (tied)"] == "ghost / ghost"  # tied: not transient
    rows = module.scaling([8], [2], module.SMOKE["gpt2"], repeats=1, warmup=0)
    assert rows[0]["all_layer"] > 0 and rows[0]["norm_methods"]


def test_profile_script_smoke():
    path = PATH.with_name("profile_step.py")
    spec = importlib.util.spec_from_file_location("profile_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.profile_method("mlp", "dpclip layer", steps=1, top=5, smoke=True)
    assert "Self CPU" in table


def test_norm_rule_smoke_runs_the_engines_functions(capsys):
    spec = importlib.util.spec_from_file_location("norm_rule", PATH.parent / "norm_rule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--smoke"])
    out = capsys.readouterr().out
    assert "rule picked the faster path in" in out and "vecdot" in out
    module.main(["--smoke", "--strips"])
    out = capsys.readouterr().out
    assert "k=4" in out and "per step, 12 blocks + lm_head" in out
    module.main(["--smoke", "--traffic"])
    out = capsys.readouterr().out
    assert "B scaled adds" in out and "mlp.c_proj" in out
    module.main(["--smoke", "--norms"])
    out = capsys.readouterr().out
    assert "per sample (CPU)" in out and "two-step" in out and "2 x 8" in out
    module.main(["--smoke", "--reductions"])
    out = capsys.readouterr().out
    assert "sum_of_squares" in out and "dot (unbounded)" in out and "tiny 4x64" in out


def test_profile_phases_smoke_times_every_phase():
    spec = importlib.util.spec_from_file_location("profile_step", PATH.parent / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from dpclip.engine import group_norms
    original = group_norms.param_norm_sq
    times = module.phase_times("gpt2", ["dpclip all-layer", "dpclip layer"], steps=1, smoke=True)
    assert group_norms.param_norm_sq is original  # the timers are removed again
    assert set(times) == {"non-private", "dpclip all-layer", "dpclip layer"}
    assert times["dpclip all-layer"]["  per-sample norms"] > 0
    assert "  per-sample norms" not in times["non-private"]  # the engine's timers stay silent
    for t in times.values():
        assert t["total"] >= t["forward"] + t["backward"]


def test_gram_cache_ab_smoke_times_both_sides_and_restores_the_cache():
    from dpclip.engine import grams, group_norms
    from tests.benchmarks.loader import load_benchmark

    out = load_benchmark("gram_cache_ab").main(["--smoke"])
    assert set(out["2x16"]["ratio"]) == {"non-private", "all-layer cache", "all-layer no cache",
                                         "layer cache", "layer no cache"}
    assert group_norms.GramCache is grams.GramCache
