"""Regenerate the measured parts of docs/performance.md and benchmarks/README.md in one command.

Runs benchmarks/dp_cost.py (timing, step memory, GPT-2 scaling; the gpt2, cnn, mlp and
gpt2-small workloads) and benchmarks/profile_step.py --phases (GPT-2, and GPT-2 small at
both of its shapes) on this machine, then rewrites two blocks in place. In
docs/performance.md, between the ``<!-- generated -->`` markers: the goals of issues 8 and
16 checked against the measurements (computed here, not typed) and the result tables of the
two GPT-2 workloads. In benchmarks/README.md (the lab notes), between the ``<!-- generated
lab -->`` markers: the other workloads' tables (the digits CNN, the MLP), the GPT-2 scaling
table, the norm method per layer, the phase profiles, and for GPT-2 small where the extra
time of each private step goes (from the profile of the same shape).

    python benchmarks/performance_page.py                 # about 50 minutes on 2 vCPUs
    python benchmarks/performance_page.py --json out.json # also keep the raw numbers
    python benchmarks/performance_page.py --render out.json   # re-render, no measuring
    python benchmarks/performance_page.py --smoke --page /tmp/p.md --lab-page /tmp/l.md  # a minute (slow tests)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_cost  # noqa: E402
import profile_step  # noqa: E402

PAGE = HERE.parent / "docs" / "performance.md"
LAB_PAGE = HERE / "README.md"
START, END = "<!-- generated: start -->", "<!-- generated: end -->"
LAB_START, LAB_END = "<!-- generated lab: start -->", "<!-- generated lab: end -->"
DP_METHODS = ["dpclip all-layer", "dpclip layer", "dpclip param"]
GOAL_TIME, GOAL_HOOKS, GOAL_MEMORY = 1.2, 0.6, 1.1
# issue 16, GPT-2 small: step time at each (B, T) and step memory, x non-private
SMALL_TIME = {(4, 256): 1.10, (2, 1024): 1.05}
SMALL_MEMORY = 1.15
# the workloads whose tables docs/performance.md shows (the goals' own); the rest go to the lab notes
PAGE_WORKLOADS = ("gpt2", "gpt2-small")


def measure(smoke: bool, repeats: int, phase_steps: int, small_phase_steps: int = 2,
            small_repeats: int = 3) -> dict:
    args = ["--memory", "--scaling", "--repeats", str(repeats), "--scaling-repeats", "5",
            "--gpt2-small-repeats", str(small_repeats), "--workloads", *dp_cost.WORKLOADS]
    if smoke:
        args += ["--smoke", "--workloads", "gpt2", "gpt2-small", "--methods", "non-private",
                 "dpclip all-layer", "dpclip layer", "opacus hooks"]
    result = dp_cost.main(args)
    steps = 1 if smoke else phase_steps
    result["phases"] = profile_step.phase_times("gpt2", DP_METHODS, steps, smoke)
    result["phase_steps"] = steps
    small_steps = 1 if smoke else small_phase_steps
    table = dp_cost.SMOKE if smoke else dp_cost.FULL
    result["phases_small"] = {key: {"sizes": sizes, "times": small_phases(key, small_steps, smoke)}
                              for key, sizes in dp_cost.instances("gpt2-small", table["gpt2-small"])}
    result["phase_steps_small"] = small_steps
    return result


def small_phases(key: str, steps: int, smoke: bool) -> dict:
    """profile_step.py --phases on one GPT-2 small shape, in a fresh process: the heap of a
    B 2, T 1024 step (kept by the allocator setting) then dies with it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "phases.json"
        cmd = [sys.executable, str(HERE / "profile_step.py"), "--phases", "--workload", key,
               "--steps", str(steps), "--methods", *DP_METHODS, "--json", str(out)]
        subprocess.run(cmd + (["--smoke"] if smoke else []), check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


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


def small_goals(result: dict) -> str | None:
    """The goals of issue 16 on GPT-2 small, each with the measured numbers and whether it
    holds; None when the run has no gpt2-small rows."""
    small = {k: wl for k, wl in result["workloads"].items() if wl.get("workload") == "gpt2-small"}
    if not small:
        return None
    pair = ["dpclip all-layer", "dpclip layer"]
    rows = ["| goal | configuration | measured (all-layer, layer-wise) | |", "|---|---|---|---|"]
    for key, wl in small.items():
        shape = (wl["sizes"]["batch"], wl["sizes"]["seq"])
        limit = SMALL_TIME.get(shape)
        where = f"B {shape[0]}, T {shape[1]}"
        if limit is not None:
            ratio, quart = wl["ratio"], wl.get("ratio_quartiles", {})
            text = ", ".join(f"{ratio[m]:.2f}x" + (f" ({quart[m][0]:.2f}-{quart[m][1]:.2f})"
                                                   if m in quart else "") for m in pair)
            rows.append(f"| DP step ≤ {limit:.2f}x non-private | {where} | {text} | "
                        f"{_yes(all(ratio[m] <= limit for m in pair))} |")
        mem = wl.get("memory_mib")
        if mem:
            ref = mem["non-private"]
            rows.append(f"| step memory ≤ {SMALL_MEMORY:.2f}x non-private | {where} | "
                        f"{mem[pair[0]] / ref:.2f}x, {mem[pair[1]] / ref:.2f}x | "
                        f"{_yes(all(mem[m] / ref <= SMALL_MEMORY for m in pair))} |")
    slower = []
    for key, wl in result["workloads"].items():
        for ref in ("opacus hooks", "opacus ghost"):
            against = wl.get(f"ratio_to_{ref.replace(' ', '_')}")
            if against is None:
                continue
            slower += [f"{m.split(' ', 1)[1]} vs {ref.split()[1]} on {key} ({against[m]:.2f}x)"
                       for m in pair if against.get(m, 0) >= 1]
    compared = [k for k, wl in result["workloads"].items() if "ratio_to_opacus_hooks" in wl
                or "ratio_to_opacus_ghost" in wl]
    if compared:
        rows.append(f"| DP step faster than both Opacus modes | {', '.join(compared)} | "
                    f"{'slower: ' + '; '.join(slower) if slower else 'faster everywhere'} | "
                    f"{_yes(not slower)} |")
    return "\n".join(rows)


def extra_time(times: dict, method: str) -> str:
    """One line: how far ``method``'s step is above non-private's in a phase profile, and
    which phases the difference is in. The parts add up to the difference: the forward, the
    per-sample norms, the rest of the backward (autograd plus clipped sums and input
    gradients, which replace autograd's weight gradients), the noise, the optimizer. Each
    phase is a median over steps, so the sum can differ slightly from the totals' difference."""
    base, dp = times["non-private"], times[method]
    parts = {"forward": dp["forward"] - base["forward"],
             "per-sample norms": dp.get("  per-sample norms", 0.0),
             "rest of the backward": dp["backward"] - dp.get("  per-sample norms", 0.0) - base["backward"],
             "noise and p.grad": dp["noise and p.grad"] - base["noise and p.grad"],
             "optimizer": dp["optimizer step"] - base["optimizer step"]}
    text = ", ".join(f"{name} {ms:+.0f} ms" for name, ms in parts.items())
    return f"{method}: {sum(parts.values()):+.0f} ms per step over non-private: {text}"


def split_workloads(result: dict) -> tuple[dict, dict]:
    """The run's workloads for the page (PAGE_WORKLOADS) and for the lab notes, in run order."""
    page, lab = {}, {}
    for key, wl in result["workloads"].items():
        (page if wl.get("workload", key) in PAGE_WORKLOADS else lab)[key] = wl
    return page, lab


def block(result: dict) -> str:
    """docs/performance.md's block: the goals tables and the GPT-2 workloads' result tables."""
    parts = [START, "### Goals (issue 8, item 5), GPT-2 of docs/performance.md", goals(result)]
    small = small_goals(result)
    if small:
        parts += ["### Goals (issue 16), GPT-2 small", small]
    parts += [dp_cost.render({**result, "workloads": split_workloads(result)[0], "scaling": None},
                             markdown=True)]
    return "\n\n".join(parts + [END])


def lab_block(result: dict) -> str:
    """benchmarks/README.md's block: the other workloads' tables, the GPT-2 scaling and
    norm-method tables (dp_cost's rendering), and the phase profiles."""
    parts = [LAB_START, dp_cost.render({**result, "workloads": split_workloads(result)[1], "skipped": None},
                                       markdown=True)]
    parts += [f"### Where the time goes: GPT-2, median of {result['phase_steps']} interleaved steps",
              profile_step.render_phases(result["phases"], markdown=True)]
    for phases in result.get("phases_small", {}).values():
        sizes = phases["sizes"]
        parts += [f"### Where the time goes: GPT-2 small, B {sizes['batch']}, T {sizes['seq']}, "
                  f"median of {result['phase_steps_small']} interleaved steps",
                  profile_step.render_phases(phases["times"], markdown=True),
                  "Extra time of each private step, by phase:\n\n" + "\n".join(
                      f"- {extra_time(phases['times'], m)}" for m in DP_METHODS)]
    return "\n\n".join(parts + [LAB_END])


def write_page(text: str, page: Path, start: str = START, end: str = END) -> None:
    old = page.read_text() if page.exists() else f"{start}\n{end}\n"
    if start not in old or end not in old:
        raise SystemExit(f"{page} has no {start} ... {end} block to replace")
    head, rest = old.split(start, 1)
    tail = rest.split(end, 1)[1]
    tmp = page.with_suffix(".tmp")
    tmp.write_text(head + text + tail)
    tmp.replace(page)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page", type=Path, default=PAGE)
    ap.add_argument("--lab-page", type=Path, default=LAB_PAGE,
                    help="the lab notes that take the scaling tables and the phase profiles")
    ap.add_argument("--json", type=Path, help="also write the raw measurements here")
    ap.add_argument("--render", type=Path, help="render this saved --json file, measure nothing")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--phase-steps", type=int, default=11)
    ap.add_argument("--small-phase-steps", type=int, default=2,
                    help="interleaved steps of the GPT-2 small phase profiles (seconds each)")
    ap.add_argument("--gpt2-small-repeats", type=int, default=3,
                    help="interleaved timing rounds of GPT-2 small (each about 1-2.5 minutes)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        result = measure(args.smoke, args.repeats, args.phase_steps, args.small_phase_steps,
                         args.gpt2_small_repeats)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    write_page(block(result), args.page)
    write_page(lab_block(result), args.lab_page, LAB_START, LAB_END)
    print(f"wrote {args.page} and {args.lab_page}")
    return result


if __name__ == "__main__":
    main()
