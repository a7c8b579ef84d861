"""GPU rows of docs/performance.md: GPT-2 small, private against non-private, on one CUDA device.

The same workloads and steps as benchmarks/dp_cost.py (its ``make_workload`` and
``make_step``: non-private, dpclip's groupings, Opacus hooks and ghost when opacus is
installed), moved to the GPU. Time: methods interleaved A B C A B C ... after warm-up, each
step bracketed by ``torch.cuda.synchronize()``; the ratio to non-private is the median over
rounds of the same-round ratio, with its quartiles. Step memory: the peak of
``torch.cuda.max_memory_allocated`` during one step, less what was allocated before it (the
models and optimizer states of every method stay resident between steps, so only the
step's own memory is counted). fp32 throughout, TF32 off (torch's default for matmuls).

    python benchmarks/gpu_rows.py --json out.json                # GPT-2 small at 4x256, 2x1024, 16x256, 8x1024
    python benchmarks/gpu_rows.py --profile 4x256 8x1024 --shapes   # only where the time goes (torch.profiler)
    python benchmarks/gpu_rows.py --smoke                        # tiny GPT-2, on the CPU if no GPU (CI)
    python benchmarks/gpu_rows.py --methods non-private "non-private compiled" "dpclip all-layer" \
        "dpclip all-layer compiled" --json out.json              # issue 54: the compiled step (training.compile)

A method's `` compiled`` variant: the non-private step with its model under ``torch.compile``, the
private step as ``training.compile`` runs it (one graph, a CUDA graph on the GPU); their first
calls compile (warm-up), and their step memory is measured after the timed rounds.
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
from dpclip.bench import round_ratios, time_rounds  # noqa: E402

SHAPES = [(4, 256), (2, 1024), (16, 256), (8, 1024)]


def to_device(w: dp_cost.Workload, device: str) -> dp_cost.Workload:
    w.model.to(device)
    w.inputs = {k: v.to(device) for k, v in w.inputs.items()}
    w.targets = w.targets.to(device)
    return w


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_memory(step, device: str) -> int | None:
    """Bytes a step allocates above what was live before it (CUDA only)."""
    if not device.startswith("cuda"):
        return None
    sync(device)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    sync(device)
    return torch.cuda.max_memory_allocated() - before


def measure_shape(sizes: dict, methods: list[str], repeats: int, warmup: int, device: str) -> dict:
    w = to_device(dp_cost.make_workload("gpt2-small", sizes), device)
    steps = {m: dp_cost.make_step(m, w) for m in methods}
    # also the first (probing) step; a compiled step's first call compiles: measured after the rounds
    memory = {m: step_memory(s, device) for m, s in steps.items() if not m.endswith(dp_cost.COMPILED)}
    times = time_rounds(steps, repeats, warmup, sync=lambda: sync(device))
    memory.update({m: step_memory(s, device) for m, s in steps.items() if m.endswith(dp_cost.COMPILED)})
    memory = {m: memory[m] for m in methods}
    ratios = round_ratios(times, "non-private")
    out = {"median_s": {m: statistics.median(ts) for m, ts in times.items()},
           "ratio": {m: r[0] for m, r in ratios.items()},
           "ratio_quartiles": {m: [r[1], r[2]] for m, r in ratios.items()},
           "step_memory_bytes": memory}
    if memory.get("non-private"):
        out["memory_ratio"] = {m: b / memory["non-private"] for m, b in memory.items()}
    del steps, w
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def profile_shape(sizes: dict, methods: list[str], device: str, steps: int = 3) -> str:
    """torch.profiler over ``steps`` steps of each method after 3 warm-up steps: the GPU's
    kernel time and the host's time per step (the profiler's own overhead included), the
    device-to-host copies (each one waits for the GPU to catch up), and the top operators
    by host time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    w = to_device(dp_cost.make_workload("gpt2-small", sizes), device)
    lines = []
    for method in methods:
        step = dp_cost.make_step(method, w)
        for _ in range(3):
            step()
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync(device)
        events = prof.key_averages()
        # kernels only: an operator's row repeats the time of the kernels it launched
        gpu = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / steps / 1000
        host = sum(e.self_cpu_time_total for e in events) / steps / 1000
        copies = sum(e.count for e in events if e.key == "cudaMemcpyAsync") / steps
        lines += [f"== {sizes['batch']}x{sizes['seq']} {method}: GPU {gpu:.1f} ms/step, host {host:.1f} ms/step "
                  f"(profiled), {copies:.0f} device-to-host copies/step",
                  events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40)]
    return "\n".join(lines)


def render(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, {result['repeats']} interleaved rounds "
             f"after {result['warmup']} warm-up",
             "| shape | method | median ms | x non-private (quartiles) | step memory MiB | x non-private |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for shape, row in result["shapes"].items():
        for m, t in row["median_s"].items():
            q1, q3 = row["ratio_quartiles"][m]
            mem = row["step_memory_bytes"].get(m)
            mem_text = f"{mem / 2**20:,.0f}" if mem is not None else "-"
            mem_ratio = row.get("memory_ratio", {}).get(m)
            lines.append(f"| {shape} | {m} | {1000 * t:,.1f} | {row['ratio'][m]:.2f} ({q1:.2f}–{q3:.2f}) | "
                         f"{mem_text} | {f'{mem_ratio:.2f}' if mem_ratio else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=[f"{b}x{t}" for b, t in SHAPES], metavar="BxT")
    ap.add_argument("--methods", nargs="+", default=list(dp_cost.METHODS),
                    choices=list(dp_cost.METHODS) + [m + dp_cost.COMPILED for m in dp_cost.METHODS[:4]])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", nargs="*", default=[], metavar="BxT",
                    help="also profile these shapes: non-private and dpclip all-layer, or the "
                         "non-Opacus --methods named")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT-2, 1 round, CPU when there is no GPU")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        ap.error("no CUDA device (use --smoke to try the script on the CPU)")
    base = dict(dp_cost.FULL["gpt2-small"])
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    if args.smoke:
        base, args.repeats, args.warmup = dict(dp_cost.SMOKE["gpt2-small"]), 1, 0
        shapes = [(2, 16)] if shapes else []
    base.pop("shapes")
    methods = [m for m in args.methods if not m.startswith("opacus") or dp_cost.opacus_available()]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "repeats": args.repeats, "warmup": args.warmup, "shapes": {}}
    for b, t in shapes:
        key = f"{b}x{t}"
        try:
            result["shapes"][key] = measure_shape(dict(base, batch=b, seq=t), methods, args.repeats,
                                                  args.warmup, device)
        except torch.OutOfMemoryError as exc:  # report the shape, go on with the next
            result.setdefault("skipped", {})[key] = f"out of memory: {str(exc).splitlines()[0]}"
        print(f"{key} done", flush=True)
    if result["shapes"]:
        print(render(result))
    for text in args.profile:
        b, t = (int(x) for x in text.lower().split("x"))
        profiled = [m for m in methods if not m.startswith("opacus")] if args.methods != list(dp_cost.METHODS) \
            else ["non-private", "dpclip all-layer"]
        print(profile_shape(dict(base, batch=b, seq=t), profiled, device))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
