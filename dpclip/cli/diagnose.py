"""`dpclip diagnose RECIPE|RUN_DIR`: Hessian diagnostics of DP training (docs/hessian-diagnostics.md)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from dpclip.cli.render import console, fmt, print_json


def diagnose(
    target: Path = typer.Argument(..., help="A recipe file (measured at initialisation) or a run directory "
                                  "(measured at its latest checkpoint)."),
    overrides: list[str] = typer.Argument(None, help="key=value recipe overrides (recipe files only)."),
    probes: int = typer.Option(None, "--probes", min=2, help="Hutchinson probes for tr(H) (default: the "
                               "recipe's diagnostics.probes, 20)."),
    per_sample: int = typer.Option(None, "--per-sample", min=2, help="Examples whose gradients estimate tr(HΣ) "
                                   "(default: diagnostics.per_sample, 16)."),
    batch_size: int = typer.Option(None, "--batch-size", min=2, help="Rows the Hessian is measured on "
                                   "(default: training.batch_size)."),
    data: str = typer.Option(None, "--data", help="public or private (default: diagnostics.data, public)."),
    allow_private: bool = typer.Option(False, "--allow-private-not-covered-by-epsilon",
                                       help="Allow --data private: the results are exact functions of the "
                                       "private data and are NOT covered by ε."),
    out: Path = typer.Option(None, "--out", "-o", help="Folder for the plots (default: the run directory for public "
                             "data, else ./diagnose-NAME/; private data never goes into a run)."),
    threads: int = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Measure tr(H) (Hutchinson), GᵀHG, tr(HΣ) and the gradient norms, and print the
    decelerator σ²tr(H)/(Bc²), ΔL*(B) and B*_DP of Bu et al.'s pre-training paper at the
    recipe's σ, B and clipping; write hessian_over_training.png and improvement_vs_batch.png.

    Public data is free. On private data the results are exact, outside ε: refused unless
    --allow-private-not-covered-by-epsilon (or the recipe's diagnostics.private_not_covered),
    then labelled "not covered by ε".

    [b]Example[/b]

      dpclip diagnose recipes/quickstart.yaml --data private --allow-private-not-covered-by-epsilon
    """
    from dpclip.threads import configure
    from dpclip.train.diagnose import diagnose as run_diagnose  # lazy: imports torch

    if data is not None and data not in ("public", "private"):
        from dpclip.errors import DpclipError

        raise DpclipError(f"--data must be public or private, got {data!r}", "e.g. --data public")
    from dpclip.cli.train import thread_count

    configure(None if threads is None else thread_count(str(threads)))
    result = run_diagnose(target, overrides or [], probes=probes, per_sample=per_sample, batch_size=batch_size,
                          data=data, allow_private=allow_private, out=out)
    if as_json:
        print_json(result.to_dict())
        return
    record, diag = result.record, result.diagnostics
    where = "initial weights" if result.source == "recipe" else f"checkpoint step {result.step}"
    label = "[bold red]private data, not covered by ε[/]" if result.private else "public data"
    table = Table(title=f"[bold]{result.name}[/]: Hessian diagnostics at {where}, {label}", show_header=False)
    table.add_row("measured on", f"{diag.batch_size} rows ({diag.per_sample} for the per-sample terms), "
                  f"{diag.probes} Hutchinson probes")
    table.add_row("tr(H)", f"{fmt(diag.trace_h)} ± {fmt(diag.trace_h_stderr, 2)} (standard error)")
    table.add_row("GᵀHG", fmt(diag.gthg))
    table.add_row("tr(HΣ)", fmt(diag.trace_h_sigma))
    table.add_row("|G|²", fmt(diag.grad_norm_sq))
    table.add_row("E‖g_i‖²", fmt(diag.mean_sample_grad_norm_sq))
    table.add_row("σ (gradient noise multiplier)", f"{fmt(record['gradient_noise_multiplier'])} (total {fmt(result.noise_multiplier)})")
    table.add_row("c (typical clip factor)", f"{fmt(record['clip_factor'])} ({record['clip_fn']}, "
                  f"C = {fmt(record['threshold'])})")
    batch = record["batch_size_dp"]
    table.add_row("decelerator σ²tr(H)/(Bc²)", f"{fmt(record['decelerator'])} at B = {batch}")
    table.add_row("B*_DP", _b_star(record["b_star_dp"], diag))
    table.add_row(f"ΔL*(B = {batch})", f"{fmt(record['improvement'])} DP-SGD, "
                  f"{fmt(record['improvement_non_private'])} non-private")
    if record["alpha_star"] is not None:
        table.add_row("α* (public share, eq. 10)", f"{fmt(record['alpha_star'])} at B₀ = {record['public_batch_size']}")
    console.print(table)
    if result.history:
        console.print(f"{result.history} earlier measurements from diagnostics.jsonl are in the plot")
    for plot in result.plots:
        console.print(f"[green]wrote[/] {plot}" + (" (not covered by ε)" if result.private else ""), soft_wrap=True)


def _b_star(value: float | None, diag) -> str:
    if value is not None:
        return fmt(value)
    if diag.gthg <= 0 < diag.trace_h:
        return "∞ (GᵀHG ≤ 0: larger batches always help in the quadratic model)"
    return "undefined (tr(H) < 0: no interior optimum)"
