"""Where does a private step's time go? torch.profiler over dpclip steps on a workload
of benchmarks/dp_cost.py, next to the non-private step, top operators by self CPU time.

    python benchmarks/profile_step.py                       # GPT-2 of REFERENCE §G, layer-wise
    python benchmarks/profile_step.py --method "dpclip all-layer" --steps 5 --top 25
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp_cost  # noqa: E402


def profile_method(workload: str, method: str, steps: int, top: int, smoke: bool = False) -> str:
    sizes = (dp_cost.SMOKE if smoke else dp_cost.FULL)[workload]
    step = dp_cost.make_step(method, dp_cost.make_workload(workload, sizes))
    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="gpt2", choices=dp_cost.WORKLOADS)
    ap.add_argument("--method", default="dpclip layer", choices=dp_cost.METHODS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    from dpclip.allocator import keep_freed_memory

    keep_freed_memory()  # as the dpclip command does (see dpclip/allocator.py)
    torch.set_num_threads(args.threads)
    for method in ("non-private", args.method):
        print(f"== {method} ({args.workload}, {args.steps} steps)")
        print(profile_method(args.workload, method, args.steps, args.top, args.smoke))


if __name__ == "__main__":
    main()
