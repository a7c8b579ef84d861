"""What does the shared-input Gram cache cost where nothing is shared? An A/B in one process.

GPT-2 small shares no input between its weights (q, k, v are one ``c_attn``), so the
engine's ``GramCache`` (dpclip/engine/grams.py) only looks up and never hits there. This
times, interleaved on one device, the non-private step and each grouping's private step
with the cache and with a cache that never keeps anything, and prints the medians and the
ratios to non-private (benchmarks/README.md, "Measured against the floor").

    python benchmarks/gram_cache_ab.py --device cuda     # GPT-2 small at 4x256 and 2x1024
    python benchmarks/gram_cache_ab.py --smoke           # tiny GPT-2 on the CPU (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_cost  # noqa: E402
import gpu_rows  # noqa: E402
from dpclip.bench import time_rounds  # noqa: E402
from dpclip.engine import grams, group_norms  # noqa: E402


class NoCache(grams.GramCache):
    """Computes every Gram afresh."""

    def strips(self, factor, count, compute):
        return compute()


def under(cache_class, step):
    """``step`` with the engine's micro-batches built with ``cache_class``."""
    def run():
        saved = group_norms.GramCache
        group_norms.GramCache = cache_class
        try:
            step()
        finally:
            group_norms.GramCache = saved
    return run


def measure(sizes: dict, device: str, repeats: int, warmup: int) -> dict:
    w = gpu_rows.to_device(dp_cost.make_workload("gpt2-small", sizes), device)
    steps = {"non-private": dp_cost.make_step("non-private", w)}
    for grouping in ("all-layer", "layer"):
        steps[f"{grouping} cache"] = under(grams.GramCache, dp_cost.make_step(f"dpclip {grouping}", w))
        steps[f"{grouping} no cache"] = under(NoCache, dp_cost.make_step(f"dpclip {grouping}", w))
    times = time_rounds(steps, repeats, warmup, sync=lambda: gpu_rows.sync(device))
    base = times["non-private"]
    return {"median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "ratio": {k: statistics.median(a / r for a, r in zip(v, base)) for k, v in times.items()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    base = dict(dp_cost.SMOKE["gpt2-small"] if args.smoke else dp_cost.FULL["gpt2-small"])
    shapes = [(2, 16)] if args.smoke else [tuple(s) for s in base["shapes"]]
    base.pop("shapes")
    if args.smoke:
        args.repeats, args.warmup = 1, 0
    out = {}
    for b, t in shapes:
        out[f"{b}x{t}"] = r = measure(dict(base, batch=b, seq=t), args.device, args.repeats, args.warmup)
        print(f"{b}x{t}: " + ", ".join(f"{k} {r['median_ms'][k]:.2f} ms ({r['ratio'][k]:.3f}x)"
                                        for k in r["median_ms"]), flush=True)
    return out


if __name__ == "__main__":
    main()
