"""Regenerate the measured part of docs/performance.md in one command.

Runs benchmarks/dp_cost.py (timing, step memory, GPT-2 scaling) and
benchmarks/profile_step.py --phases on this machine, then rewrites the block between the
``<!-- generated -->`` markers of docs/performance.md: the result tables, the goals of
issue 8 checked against them (computed here, not typed), and the phase profile.

    python benchmarks/performance_page.py                 # about 12 minutes on 2 vCPUs
    python benchmarks/performance_page.py --json out.json # also keep the raw numbers
    python benchmarks/performance_page.py --render out.json   # re-render, no measuring
    python benchmarks/performance_page.py --smoke --page /tmp/p.md   # seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_cost  # noqa: E402
import profile_step  # noqa: E402

PAGE = HERE.parent / "docs" / "performance.md"
START, END = "<!-- generated: start -->", "<!-- generated: end -->"
DP_METHODS = ["dpclip all-layer", "dpclip layer", "dpclip param"]
GOAL_TIME, GOAL_HOOKS, GOAL_MEMORY = 1.2, 0.6, 1.1


def measure(smoke: bool, repeats: int, phase_steps: int) -> dict:
    args = ["--memory", "--scaling", "--repeats", str(repeats), "--scaling-repeats", "5"]
    if smoke:
        args += ["--smoke", "--workloads", "gpt2", "--methods", "non-private", "dpclip all-layer",
                 "dpclip layer", "opacus hooks"]
    result = dp_cost.main(args)
    result["phases"] = profile_step.phase_times("gpt2", DP_METHODS, 1 if smoke else phase_steps, smoke)
    result["phase_steps"] = 1 if smoke else phase_steps
    return result


def _yes(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def goals(result: dict) -> str:
    """The goals of issue 8 (item 5), each with the measured numbers and whether it holds."""
    wl = result["workloads"]["gpt2"]
    ratio, quart = wl["ratio"], wl.get("ratio_quartiles", {})
    pair = ["dpclip all-layer", "dpclip layer"]

    def r(m):
        q = quart.get(m)
        return f"{ratio[m]:.2f}x" + (f" ({q[0]:.2f}-{q[1]:.2f})" if q else "")

    rows = ["| goal | measured (all-layer, layer-wise) | |", "|---|---|---|"]
    rows.append(f"| DP step ≤ {GOAL_TIME}x non-private | {r(pair[0])}, {r(pair[1])} | "
                f"{_yes(all(ratio[m] <= GOAL_TIME for m in pair))} |")
    hooks = wl.get("ratio_to_opacus_hooks")
    if hooks:
        rows.append(f"| DP step ≤ {GOAL_HOOKS}x Opacus hooks | {hooks[pair[0]]:.2f}x, {hooks[pair[1]]:.2f}x "
                    f"(non-private itself: {hooks['non-private']:.2f}x) | "
                    f"{_yes(all(hooks[m] <= GOAL_HOOKS for m in pair))} |")
    mem = wl.get("memory_mib")
    if mem:
        ref = mem["non-private"]
        rows.append(f"| peak step memory ≤ {GOAL_MEMORY}x non-private | {mem[pair[0]] / ref:.2f}x, "
                    f"{mem[pair[1]] / ref:.2f}x | "
                    f"{_yes(all(mem[m] / ref <= GOAL_MEMORY for m in pair))} |")
        stash = wl.get("stash_peak_mib", {})
        rows.append(f"| layer-wise peak below all-layer peak | process: {mem[pair[1]]:.1f} vs "
                    f"{mem[pair[0]]:.1f} MiB; engine stash: {stash.get(pair[1], float('nan')):.1f} vs "
                    f"{stash.get(pair[0], float('nan')):.1f} MiB | "
                    f"{_yes(mem[pair[1]] < mem[pair[0]])} (process), "
                    f"{_yes(stash.get(pair[1], 0) < stash.get(pair[0], 0))} (stash) |")
    return "\n".join(rows)


def block(result: dict) -> str:
    phases = profile_step.render_phases(result["phases"], markdown=True)
    return "\n\n".join([
        START,
        "### Goals (issue 8, item 5), GPT-2 of docs/performance.md",
        goals(result),
        dp_cost.render(result, markdown=True),
        f"### Where the time goes: GPT-2, median of {result['phase_steps']} interleaved steps",
        phases,
        END,
    ])


def write_page(text: str, page: Path) -> None:
    old = page.read_text() if page.exists() else f"{START}\n{END}\n"
    if START not in old or END not in old:
        raise SystemExit(f"{page} has no {START} ... {END} block to replace")
    head, rest = old.split(START, 1)
    tail = rest.split(END, 1)[1]
    tmp = page.with_suffix(".tmp")
    tmp.write_text(head + text + tail)
    tmp.replace(page)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page", type=Path, default=PAGE)
    ap.add_argument("--json", type=Path, help="also write the raw measurements here")
    ap.add_argument("--render", type=Path, help="render this saved --json file, measure nothing")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--phase-steps", type=int, default=11)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        result = measure(args.smoke, args.repeats, args.phase_steps)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    write_page(block(result), args.page)
    print(f"wrote {args.page}")
    return result


if __name__ == "__main__":
    main()
