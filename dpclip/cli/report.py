"""`dpclip report RUN_DIR [--out FILE.html] [--json]`: a run's summary and its one-page report."""

from __future__ import annotations

from pathlib import Path

import typer

from dpclip.cli.render import console, fmt, fmt_upper, print_json


def report(
    run_dir: Path = typer.Argument(..., help="A run directory (created by dpclip train)."),
    out: Path = typer.Option(None, "--out", "-o", help="Where to write the HTML page (default RUN_DIR/report.html)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Print a run's summary and write one self-contained HTML page with every plot of the
    run (training, thresholds, audit) and its privacy statement."""
    from dpclip.train.report import write_report  # imports torch (the run's plan)

    summary, path = write_report(run_dir, out)
    if as_json:
        print_json({**summary, "report": str(path)})
        return
    console.print(f"[bold]{summary['name']}[/]  {summary['run_dir']}")
    console.print(f"steps: {summary['steps_done']} of {summary['steps_planned']}   stopped: {summary['stopped']}")
    cap = "" if summary["epsilon_cap"] is None else f" (cap {fmt(summary['epsilon_cap'])})"
    console.print(f"ε = {fmt_upper(summary['epsilon'])} at δ = {summary['delta']:g}{cap}, {summary['accountant']} accountant")
    selected_by = summary.get("selected_by_search")
    if selected_by is not None:
        console.print(f"  the ε of the search {selected_by['search_dir']} that selected this run; this run's own "
                      f"ledger (ε = {fmt_upper(selected_by['run_epsilon_alone'])}) understates it", soft_wrap=True)
    if summary["final_eval"]:
        metrics = ", ".join(f"{k} {fmt(v)}" for k, v in summary["final_eval"].items())
        console.print(f"final held-out metrics ([red]not covered by ε[/]): {metrics}")
    console.print("[bold]privacy statement[/]")
    for line in summary["statement"]:
        console.print(f"  {line}", markup=False)
    console.print(f"[green]wrote[/] {path}")
