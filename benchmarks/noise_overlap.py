"""Can a step's noise be drawn while its backward runs, for free? (issue 32's floor)

The floor of docs/performance.md counts the noise draw (one Gaussian per parameter) as
time added to the step. It would be lower if the draw could hide behind the backward:
torch's CPU ``normal_`` runs on one core and releases the GIL, so a second thread can draw
while the backward's GEMMs run. This measures whether that time is there to take, on the
non-private backward of GPT-2 small (the floor's own step), interleaved per round:

- the backward alone;
- the backward with the noise drawn at the same time on one more thread (into buffers the
  size of the parameters, kept across rounds so that no page is faulted in), at normal
  priority and at the lowest (Linux nice 19: only cores nothing else wants);
- the draw alone on one thread, and the engine's own draw alone
  (``NoiseSource.add_gaussians``, split over torch's threads: the floor's noise share).

The cost of an overlapped draw is (backward with the draw − backward alone) in the same
round; the draw hides behind the backward only where that is below the engine's draw alone.

    python benchmarks/noise_overlap.py --json benchmarks/results/noise_overlap_cpu.json
    python benchmarks/noise_overlap.py --smoke      # tiny GPT-2, one round (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_cost  # noqa: E402

from dpclip.allocator import keep_freed_memory  # noqa: E402
from dpclip.engine.noise import NoiseSource  # noqa: E402

CHUNK = 1 << 20
MODES = ("backward alone", "backward + draw", "backward + draw, nice 19", "draw alone, one thread",
         "engine draw alone")


def _nice() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def measure(key: str, repeats: int, warmup: int, smoke: bool) -> dict:
    name, sizes = dp_cost.resolve(key, smoke=smoke)
    w = dp_cost.make_workload(name, sizes)
    model = w.model
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [torch.empty(p.numel()) for p in params]
    generator = torch.Generator().manual_seed(0)
    engine_draw = dp_cost.noise_draw_step(model)

    def draw(nice: bool = False) -> None:
        if nice:
            _nice()
        for buffer in buffers:
            for lo in range(0, buffer.numel(), CHUNK):
                buffer[lo:lo + CHUNK].normal_(generator=generator)

    def backward(concurrent=None) -> float:
        loss = w.per_sample_loss(model).mean()
        start = time.perf_counter()
        thread = threading.Thread(target=concurrent) if concurrent else None
        if thread:
            thread.start()
        loss.backward()
        if thread:
            thread.join()
        elapsed = time.perf_counter() - start
        for p in params:
            p.grad = None
        return elapsed

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    runs = {
        "backward alone": lambda: backward(),
        "backward + draw": lambda: backward(draw),
        "backward + draw, nice 19": lambda: backward(lambda: draw(nice=True)),
        "draw alone, one thread": lambda: timed(draw),
        "engine draw alone": lambda: timed(engine_draw),
    }
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for round_ in range(warmup + repeats):
        for mode in MODES:
            t = runs[mode]()
            if round_ >= warmup:
                times[mode].append(t)
    alone = times["backward alone"]
    cost = {m: statistics.median(t - a for t, a in zip(times[m], alone))
            for m in ("backward + draw", "backward + draw, nice 19")}
    return {"workload": key, "parameters": sum(p.numel() for p in params), "repeats": repeats,
            "warmup": warmup, "threads": torch.get_num_threads(), "machine": dp_cost.machine(),
            "median_s": {m: statistics.median(ts) for m, ts in times.items()},
            "overlapped_cost_s": cost}


def render(r: dict) -> str:
    med, cost = r["median_s"], r["overlapped_cost_s"]
    lines = [f"{r['machine']}; {r['workload']}, {r['parameters']:,} parameters; "
             f"median of {r['repeats']} interleaved rounds after {r['warmup']} warm-up", "",
             "| run | median ms | added to the backward, ms |", "|---|---:|---:|"]
    for mode in MODES:
        added = f"{cost[mode] * 1e3:.0f}" if mode in cost else "-"
        lines.append(f"| {mode} | {med[mode] * 1e3:.0f} | {added} |")
    engine = med["engine draw alone"]
    best = min(cost.values())
    lines += ["", f"overlapped draw costs {best * 1e3:.0f} ms against {engine * 1e3:.0f} ms for the engine's "
              f"draw alone: {'hides' if best < engine else 'does not hide'} "
              f"({(engine - best) * 1e3:+.0f} ms a step)"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4x256", help="GPT-2 small's B x T")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the dpclip command does (dpclip/allocator.py)
    if args.smoke:
        result = measure("gpt2", 1, 0, smoke=True)
    else:
        result = measure(f"gpt2-small {args.shape}", args.repeats, args.warmup, smoke=False)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
