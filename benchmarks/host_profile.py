"""Where a private step's host time goes: its reads from the device and its Python.

A small step on a GPU is bound by the host (benchmarks/README.md, "Measured against the
floor"): each read back from the device (``.tolist()``, ``.item()``, ``float(t)``,
``bool(t)``) makes the host wait for the GPU, and each tensor operation is a kernel launch
the host pays for. For GPT-2 small (or a tiny GPT-2 with ``--smoke``) this runs the steps of
dp_cost.py's ``make_step`` (non-private, dpclip all-layer and layer-wise) after warm-up
and prints, per private method:

- the reads of one step, by the innermost dpclip (or benchmark) lines that made them;
- the non-view aten operations of one step (``engine_step_ratio.count_ops``);
- the unprofiled time of a step, and cProfile's top functions over ``--steps`` steps.

    python benchmarks/host_profile.py --device cuda --shape 4x256 --out FILE   # on a GPU
    python benchmarks/host_profile.py --smoke                                  # tiny, CPU (CI)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_cost  # noqa: E402
from engine_step_ratio import count_ops  # noqa: E402
from gpu_rows import sync, to_device  # noqa: E402

METHODS = ["non-private", "dpclip all-layer", "dpclip layer"]
READS = ("tolist", "item", "__float__", "__bool__")
SMOKE = {"layers": 2, "embd": 32, "heads": 2, "vocab": 64, "positions": 16}


def read_sites(step) -> collections.Counter:
    """The reads from the device of one call of ``step``, by where they were made (the
    innermost three frames of dpclip or of the benchmarks)."""
    sites: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name):
        real = originals[name]

        def read(self, *args, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/dpclip/" in f.filename.replace("\\", "/") or f.filename.startswith(str(HERE))]
            sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])] += 1
            return real(self, *args, **kwargs)
        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counted(name))
        step()
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)
    return sites


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="4x256", help="B x T of GPT-2 small")
    ap.add_argument("--steps", type=int, default=5, help="steps timed and profiled per method")
    ap.add_argument("--top", type=int, default=30, help="cProfile rows per method")
    ap.add_argument("--out", help="write the report here as well")
    ap.add_argument("--json", help="write the counts and times here")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT-2, 2 steps (CI)")
    args = ap.parse_args(argv)
    batch, seq = (int(v) for v in args.shape.lower().split("x"))
    sizes = dict(dp_cost.resolve("gpt2-small")[1])
    if args.smoke:
        sizes.update(SMOKE)
        batch, seq, args.steps, args.top = 2, 8, 2, 10
    sizes.update(batch=batch, seq=seq)
    workload = to_device(dp_cost.make_workload("gpt2-small", sizes), args.device)
    steps = {method: dp_cost.make_step(method, workload) for method in METHODS}
    for _ in range(3):   # warm-up: the first step probes the batch axes
        for step in steps.values():
            step()
    sync(args.device)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "shape": [batch, seq], "reads": {}, "ops": {}, "step_ms": {}}
    report = io.StringIO()
    print(f"GPT-2 small{' (smoke sizes)' if args.smoke else ''}, B {batch}, T {seq}, "
          f"{result['device']}, torch {torch.__version__}", file=report)
    for method, step in steps.items():
        sites = read_sites(step)
        result["reads"][method] = sum(sites.values())
        result["ops"][method] = count_ops(step)
        sync(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync(args.device)
        result["step_ms"][method] = (time.perf_counter() - start) / args.steps * 1e3
        print(f"\n== {method}: {result['step_ms'][method]:.1f} ms a step (unprofiled), "
              f"{result['ops'][method]} tensor operations, {result['reads'][method]} reads from the device",
              file=report)
        for where, count in sites.most_common():
            print(f"{count:5d}  {where}", file=report)
    for method in METHODS[1:]:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            steps[method]()
        sync(args.device)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"\n==== cProfile, {method}, {args.steps} steps, by own time\n{text.getvalue()}", file=report)
    print(report.getvalue())
    if args.out:
        Path(args.out).write_text(report.getvalue())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
