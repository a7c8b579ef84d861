"""How far is a private step from its floor? GPT-2 small, measured beside the floor in one process.

For each (B, T) this times, interleaved A B C D A B C D ... after warm-up (dp_cost.py's
``make_step``): the non-private step, dpclip all-layer and layer-wise, and the noise draw
alone, two ways: the engine's (``dp_cost.NOISE_DRAW``: ``NoiseSource.add_gaussians``, one
Gaussian per parameter, added to a gradient-sized buffer) and one ``normal_`` call over a
flat parameter-sized buffer (``dp_cost.FLAT_NOISE_DRAW``: no add, the fewest launches on a
GPU; on a CPU one core draws it). The floor of a grouping is

    floor = memory-aware flop floor (floor.py --memory: the fewest extra flops of an exact
            per-sample norm and clipped sum within the step-memory goal, as a ratio)
          + noise share (the faster of the two draws / the non-private step, same round)

The noise is the one piece of a private step's work that no flop count holds and no
engine can skip (one Gaussian per parameter per step, 124M for GPT-2 small); it is
measured, not modelled, on the machine that runs the step, and the faster draw is taken so
that a slow draw of the engine's counts against the engine, not into the floor. Per round,
the gap is

    gap = (private step / non-private step) / floor

and the table shows its median over rounds with quartiles: how many times the floor the
step takes (issue 32's goal: at most 1.03). Step memory (``--memory``): on the CPU, each
configuration alone in fresh child processes (dp_cost.py's measure, peak resident set
above setup, median of ``--memory-runs`` children: with freed memory kept, one child's peak
moved by up to 440 MiB from the next at B 4, T 256, in two modes); on CUDA, the peak allocated during a step above what was allocated before it
(gpu_rows.py's).

    python benchmarks/floor_gap.py --memory --json benchmarks/results/floor_gap_cpu.json
    python benchmarks/floor_gap.py --device cuda --shapes 4x256 2x1024 16x256 8x1024
    python benchmarks/floor_gap.py --smoke       # tiny GPT-2, one round (CI)
    python benchmarks/floor_gap.py --render FILE # the table of a saved run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_cost  # noqa: E402
import floor as floor_model  # noqa: E402
import gpu_rows  # noqa: E402
from dpclip.allocator import keep_freed_memory  # noqa: E402
from dpclip.bench import time_rounds  # noqa: E402

GROUPINGS = ("all-layer", "layer")
NON_PRIVATE = "non-private"
GOAL = 1.03


def quartiles(values: list[float]) -> tuple[float, float, float]:
    values = sorted(values)
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3


def floors(sizes: dict) -> dict:
    """The memory-aware flop floor ratio of each grouping (None where nothing fits)."""
    model_sizes = {k: sizes[k] for k in ("layers", "embd", "heads", "vocab", "positions")}
    found = floor_model.gpt2_memory_floor(sizes["batch"], sizes["seq"], **model_sizes)
    return {"flop": found["flop_ratio"], "all-ghost": found["ghost_ratio"],
            **{g: found[g]["ratio"] for g in GROUPINGS}}


def measure(sizes: dict, repeats: int, warmup: int, device: str, memory: bool, threads: int,
            memory_runs: int = 3) -> dict:
    methods = [NON_PRIVATE] + [f"dpclip {g}" for g in GROUPINGS]
    memory_mib = {}
    if memory and device == "cpu":  # children first: this process grows with the models
        for m in methods:
            memory_mib[m] = dp_cost.measure_memory("gpt2-small", m, sizes, 1, threads,
                                                   runs=memory_runs)["step_mib"]
    w = gpu_rows.to_device(dp_cost.make_workload("gpt2-small", sizes), device)
    draws = [dp_cost.NOISE_DRAW, dp_cost.FLAT_NOISE_DRAW]
    steps = {m: dp_cost.make_step(m, w) for m in methods + draws}
    if memory and device != "cpu":
        memory_mib = {m: gpu_rows.step_memory(steps[m], device) / 2**20 for m in methods}
    times = time_rounds(steps, repeats, warmup, sync=lambda: gpu_rows.sync(device))
    del steps, w
    flop = floors(sizes)
    base = times[NON_PRIVATE]
    noise_share = [min(e, f) / b for e, f, b in zip(*(times[d] for d in draws), base)]
    engine_draw = sum(e <= f for e, f in zip(*(times[d] for d in draws)))
    out = {"faster_draw": "engine's" if 2 * engine_draw >= len(base) else "flat","batch": sizes["batch"], "seq": sizes["seq"], "floors": flop,
           "median_s": {m: statistics.median(ts) for m, ts in times.items()},
           "noise_share": quartiles(noise_share), "memory_mib": memory_mib, "groupings": {}}
    for g in GROUPINGS:
        ratios = [t / b for t, b in zip(times[f"dpclip {g}"], base)]
        row = {"measured": quartiles(ratios), "flop_floor": flop[g], "measured_rounds": ratios}
        if flop[g] is not None:
            gaps = [r / (flop[g] + s) for r, s in zip(ratios, noise_share)]
            row["floor"] = quartiles([flop[g] + s for s in noise_share])
            row["gap"] = quartiles(gaps)
            row["gap_rounds"] = gaps   # every round's, for pooling over processes (floor_gap_pooled.py)
        if memory_mib:
            row["memory_ratio"] = memory_mib[f"dpclip {g}"] / memory_mib[NON_PRIVATE]
        out["groupings"][g] = row
    return out


def render(result: dict) -> str:
    lines = [f"{result['machine']}; {result['repeats']} interleaved rounds after {result['warmup']} "
             "warm-up; median over rounds (quartiles)", "",
             "| B x T | grouping | flop floor | noise share | floor | measured | measured / floor | step memory |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    draws = sorted({shape.get("faster_draw", "engine's") for shape in result["shapes"]})
    lines[0] += f"; noise share: the {' or '.join(draws)} draw (the faster)"
    if result.get("memory_runs"):
        lines[0] += f"; step memory: median of {result['memory_runs']} fresh processes"
    for shape in result["shapes"]:
        noise = shape["noise_share"]
        for g, row in shape["groupings"].items():
            measured = row["measured"]
            mem = f"{row['memory_ratio']:.2f}x" if "memory_ratio" in row else "-"
            if row.get("floor") is None:
                cells = ["none fits", "-", "-"]
            else:
                f, gap = row["floor"], row["gap"]
                cells = [f"{row['flop_floor']:.4f}x", f"{f[0]:.3f}x",
                         f"**{gap[0]:.3f}** ({gap[1]:.3f}–{gap[2]:.3f})"]
            lines.append(f"| {shape['batch']} x {shape['seq']} | {g} | {cells[0]} | {noise[0]:.3f} | "
                         f"{cells[1]} | {measured[0]:.3f}x ({measured[1]:.3f}–{measured[2]:.3f}) | {cells[2]} | {mem} |")
    return "\n".join(lines)


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, float32, TF32 off"
    return dp_cost.machine()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["4x256", "2x1024"], metavar="BxT")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--memory", action="store_true", help="also step memory against non-private")
    ap.add_argument("--memory-runs", type=int, default=3, help="CPU: children per configuration (median)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--render", type=Path, metavar="FILE", help="print the table of a saved --json run")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        print(render(result))
        return result
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    base = {k: v for k, v in (dp_cost.SMOKE if args.smoke else dp_cost.FULL)["gpt2-small"].items() if k != "shapes"}
    shapes = [dp_cost.parse_shape(s) for s in (["2x16"] if args.smoke else args.shapes)]
    if args.smoke:
        args.repeats, args.warmup = 1, 0
    result = {"machine": machine(args.device), "repeats": args.repeats, "warmup": args.warmup,
              "memory_runs": args.memory_runs if args.device == "cpu" else None,
              "device": args.device, "shapes": []}
    for b, t in shapes:
        result["shapes"].append(measure(dict(base, batch=b, seq=t), args.repeats, args.warmup,
                                        args.device, args.memory, args.threads, args.memory_runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(render(result))
    return result


if __name__ == "__main__":
    main()
