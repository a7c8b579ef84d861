"""`dpclip bench RECIPE [key=value ...]`: what does DP cost on this model and batch?"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from dpclip.cli.render import console, print_json


def bench(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. training.batch_size=128"),
    repeats: int = typer.Option(5, "--repeats", min=1, help="Timed steps per configuration (median reported)."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Untimed steps per configuration first."),
    threads: str = typer.Option(None, "--threads", help="torch threads: a number, or auto (the default, as "
                                "dpclip train: the cores the machine's load leaves free)."),
    memory: bool = typer.Option(True, "--memory/--no-memory",
                                help="Measure step memory, one fresh process per configuration (Linux)."),
    floor: bool = typer.Option(True, "--floor/--no-floor",
                               help="Set each private step against its floor: the fewest extra flops of "
                                    "exact per-sample clipping plus the measured noise draw."),
    breaks: bool = typer.Option(False, "--graph-breaks",
                                help="Also trace the compiled micro-batch (training.compile) and list where its "
                                     "graph breaks, if anywhere (benchmarks/README.md, \"Graph breaks\")."),
    compiled: bool = typer.Option(False, "--compiled",
                                  help="Also time the steps compiled: the private step as training.compile runs it, "
                                       "the non-private one with its model under torch.compile (docs/compiled.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Step time and step memory of private training (per grouping style) against
    non-private training, for the recipe's model and batch size."""
    from dpclip.bench import CHECKED, NON_PRIVATE, NOT_COVERED, bench_recipe
    from dpclip.cli.train import thread_count

    result = bench_recipe(recipe, overrides or [], repeats=repeats, warmup=warmup,
                          threads=thread_count(threads), memory=memory, floor=floor, breaks=breaks,
                          compiled=compiled)
    if as_json:
        print_json(result.to_dict())
        return
    settings = result.settings
    allocator = "freed memory kept" if settings["keep_freed_memory"] else "glibc default allocator"
    device = settings.get("device", "cpu")
    table = Table(title=f"{result.recipe}: batch {result.batch_size}, {result.threads} threads, {allocator}, "
                        f"{settings['precision']}" + ("" if device == "cpu" else f", {device}")
                        + f", median of {result.repeats} interleaved steps")
    table.add_column("step")
    table.add_column("median s", justify="right")
    table.add_column("x non-private", justify="right")
    if result.ratio_compiled:
        table.add_column("x non-private compiled", justify="right")
    gap = result.floor.get("gap")
    if gap:
        table.add_column("x floor", justify="right")
    if result.memory_mib:
        table.add_column("step memory MiB", justify="right")
        table.add_column("x non-private", justify="right")
    ref_mem = result.memory_mib.get(NON_PRIVATE)
    for name, seconds in result.median_s.items():
        row = [name, f"{seconds:.4f}", f"{result.ratio[name]:.2f}"]
        if result.ratio_compiled:
            row.append(f"{result.ratio_compiled[name]:.2f}" if name in result.ratio_compiled else "-")
        if gap:
            row.append(f"{gap[name]:.3f}" if name in gap else "-")
        if result.memory_mib:
            mib = result.memory_mib.get(name)
            row += ["-", "-"] if mib is None else [f"{mib:.1f}", f"{mib / ref_mem:.2f}" if ref_mem and ref_mem > 0 else "-"]
        table.add_row(*row)
    console.print(table)
    console.print(f"{CHECKED.strip(', ').capitalize()}: a step that also runs the certificate, as the first step of "
                  "a run and of each new batch shape do (docs/certificate.md).")
    if result.floor:
        console.print(floor_text(result.floor))
    if not result.memory_mib:
        pass
    elif device != "cpu":
        console.print("Step memory: peak allocated on the GPU during two steps above what was allocated "
                      "before them (activations, gradients, per-sample quantities; weights excluded).")
    else:
        console.print("Step memory: peak resident-set rise during the steps in a fresh process "
                      "(activations, gradients, per-sample quantities; weights and imports excluded).")
    if result.graph_breaks:
        console.print(breaks_text(result.graph_breaks))
    console.print(NOT_COVERED[0].upper() + NOT_COVERED[1:] + ".")


def breaks_text(found: dict, top: int = 8) -> str:
    """The compiled micro-batch under torch.compile: its graphs, breaks and their commonest reasons."""
    lines = [f"torch.compile of the compiled micro-batch (training.compile): {found['graphs']} graph(s), "
             f"{found['breaks']} graph breaks" + (" (compiled whole: 1 and 0)" if found["breaks"] else "")]
    lines += [f"  {count} x {reason} ({where})" for count, reason, where in found["reasons"][:top]]
    return "\n".join(lines)


def floor_text(floor: dict) -> str:
    """What the floor column means, with its two parts (docs/performance.md, "The floor")."""
    noise = (f"the noise draw {floor['noise_share']:.3f} of a non-private step "
             "(one Gaussian per parameter, the faster of two ways, measured in the same rounds)")
    if floor.get("floor") is None:
        return f"Floor: no flops counted for this model's step; {noise}."
    text = (f"Floor: {floor['floor']:.3f}x = {floor['flop_ratio']:.4f}x in flops (the fewest an exact "
            f"per-sample norm and clipped sum add: {floor['extra_flops'] / 1e9:.3g} GFLOP on "
            f"{floor['nonprivate_flops'] / 1e9:.3g}) + {noise}; memory traffic and memory limits are "
            "not counted. x floor = (x non-private) / floor, median over rounds.")
    if floor["unmodelled"]:
        shown = ", ".join(floor["unmodelled"][:5]) + (", ..." if len(floor["unmodelled"]) > 5 else "")
        text += f" Not modelled, counted at no extra cost (the floor stays a lower bound): {shown}."
    return text
