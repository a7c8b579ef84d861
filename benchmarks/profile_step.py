"""Where does a private step's time go? Two views of dpclip steps on a workload of
benchmarks/dp_cost.py, next to the non-private step.

``--phases`` (the tables in benchmarks/README.md): wall-clock timers around the phases of a
step, median over interleaved steps: forward, backward (and inside it the layers' input
gradients, the engine's ghost/eager per-sample norms, clipped sums, and the streamed
instantiation of transient layers, which computes norms and sums together), noise and
``p.grad``, optimizer; and the minor page faults of each step (see dpclip/allocator.py). The timers wrap the engine's
functions from outside; nothing in the engine changes.

default: torch.profiler, top operators by self CPU time. (Under the profiler an all-layer
GPT-2 step ran about 1.8x slower than without it, in its elementwise ops: use it to see
which operators run, ``--phases`` for how long they take.)

    python benchmarks/profile_step.py --phases --methods "dpclip all-layer" "dpclip layer"
    python benchmarks/profile_step.py --method "dpclip all-layer" --steps 5 --top 25
    python benchmarks/profile_step.py --phases --workload "gpt2-small 4x256" --steps 2
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp_cost  # noqa: E402


def profile_method(workload: str, method: str, steps: int, top: int, smoke: bool = False) -> str:
    name, sizes = dp_cost.resolve(workload, smoke)
    step = dp_cost.make_step(method, dp_cost.make_workload(name, sizes))
    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


FAULTS = "minor page faults per step"
PHASES = ("forward", "backward", "  input gradients", "  per-sample norms", "  clipped sums",
          "  instantiated norms + sums", "noise and p.grad", "optimizer step")


def _timed(acc: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0
    return wrapper


def phase_times(workload: str, methods: list[str], steps: int, smoke: bool = False) -> dict:
    """Median ms per phase and step for non-private and each dpclip method (interleaved)."""
    from dpclip.engine import group_norms, layers, microbatch

    name, sizes = dp_cost.resolve(workload, smoke)
    w = dp_cost.make_workload(name, sizes)
    acc: dict[str, float] = defaultdict(float)
    saved = (group_norms.param_norm_sq, microbatch.clipped_sum, microbatch.streamed_clip)
    group_norms.param_norm_sq = _timed(acc, "  per-sample norms", group_norms.param_norm_sq)
    microbatch.clipped_sum = _timed(acc, "  clipped sums", microbatch.clipped_sum)
    # transient instantiation computes norms and sums together, a chunk of samples at a time
    microbatch.streamed_clip = _timed(acc, "  instantiated norms + sums", microbatch.streamed_clip)
    timed_rules = []   # input gradients, timed on each registered rule (instance attribute)
    for rule in {id(r): r for r in layers.registered_rules().values()}.values():
        timed_rules.append((rule, rule.__dict__.get("input_grad")))
        rule.input_grad = _timed(acc, "  input gradients", rule.input_grad)
    try:
        return _interleaved_phases(w, methods, steps, acc)
    finally:
        group_norms.param_norm_sq, microbatch.clipped_sum, microbatch.streamed_clip = saved
        for rule, own in timed_rules:
            if own is None:
                del rule.input_grad
            else:
                rule.input_grad = own


def _interleaved_phases(w, methods: list[str], steps: int, acc: dict) -> dict:
    runs = {}
    for method in ["non-private"] + methods:
        model = copy.deepcopy(w.model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        engine = None
        if method != "non-private":
            from dpclip.engine import DPEngine
            engine = DPEngine(model, {"grouping": method.split(" ", 1)[1]}, gradient_noise_multiplier=1.0,
                              expected_batch_size=w.batch, seed=0)
        runs[method] = (model, opt, engine)
    rows: dict[str, dict[str, list[float]]] = {m: defaultdict(list) for m in runs}
    for i in range(steps + 1):
        for method, (model, opt, engine) in runs.items():
            acc.clear()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            loss = w.per_sample_loss(model)
            t1 = time.perf_counter()
            if engine is None:
                loss.mean().backward()
                t2 = t3 = time.perf_counter()
            else:
                engine.backward(loss)
                t2 = time.perf_counter()
                engine.privatize()
                t3 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            if i == 0:
                continue  # warm-up
            step = {"forward": t1 - t0, "backward": t2 - t1, "noise and p.grad": t3 - t2,
                    "optimizer step": t4 - t3, **acc, "total": t4 - t0}
            for key, value in step.items():
                rows[method][key].append(value * 1e3)
            rows[method][FAULTS].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}


def render_phases(times: dict, markdown: bool) -> str:
    methods = list(times)
    lines = []
    if markdown:
        lines += ["| phase (ms per step) | " + " | ".join(methods) + " |",
                  "|---|" + "---|" * len(methods)]
    else:
        lines.append(f"{'phase (ms per step)':<22}" + "".join(f"{m:>18}" for m in methods))
    for phase in PHASES + ("total", FAULTS):
        vals = [times[m].get(phase) for m in methods]
        cells = ["-" if v is None else f"{v:.0f}" if phase == FAULTS else f"{v:.1f}" for v in vals]
        lines.append(("| " + " | ".join([phase.strip() if not phase.startswith("  ") else "of which " + phase.strip()] + cells) + " |")
                     if markdown else f"{phase:<22}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="gpt2",
                    help="a workload of dp_cost.py (" + ", ".join(dp_cost.WORKLOADS) + "), or one "
                         "shape of it: \"gpt2-small 2x1024\" (default: its first shape)")
    ap.add_argument("--method", default="dpclip layer", choices=dp_cost.METHODS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--phases", action="store_true", help="timed phases instead of torch.profiler")
    ap.add_argument("--methods", nargs="+", default=["dpclip all-layer", "dpclip layer"],
                    choices=[m for m in dp_cost.METHODS if m.startswith("dpclip")])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", type=Path, help="with --phases: also write the times here")
    args = ap.parse_args(argv)
    from dpclip.allocator import keep_freed_memory

    keep_freed_memory()  # as the dpclip command does (see dpclip/allocator.py)
    torch.set_num_threads(args.threads)
    if args.phases:
        steps = max(args.steps, 1)
        print(f"{args.workload}: median of {steps} interleaved steps after one warm-up, "
              f"{torch.get_num_threads()} threads")
        times = phase_times(args.workload, args.methods, steps, args.smoke)
        print(render_phases(times, args.markdown))
        if args.json:
            args.json.write_text(json.dumps(times, indent=1))
        return
    for method in ("non-private", args.method):
        print(f"== {method} ({args.workload}, {args.steps} steps)")
        print(profile_method(args.workload, method, args.steps, args.top, args.smoke))


if __name__ == "__main__":
    main()
