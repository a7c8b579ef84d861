"""`dpclip tune-cost RECIPE [key=value ...]`: what a hyperparameter search costs."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dpclip.cli.render import N_LABEL, json_safe, console, fmt, fmt_upper, print_json


class ProgressBar:
    """A rich progress bar over the measured steps (nothing is drawn for --json)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.progress: Progress | None = None
        self.task = None

    def start(self, total_steps: int) -> None:
        if self.quiet or total_steps == 0:
            return
        self.progress = Progress(TextColumn("measuring"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                 TextColumn("{task.fields[label]}"), TimeElapsedColumn(),
                                 console=console, transient=True)
        self.progress.start()
        self.task = self.progress.add_task("measure", total=total_steps, label="")

    def advance(self, label: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, label=label[:50])

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def tune_cost(
    recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="A recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="key=value recipe overrides, e.g. privacy.epsilon=4"),
    grid: list[str] = typer.Option(None, "--grid", help="key=v1,v2,... (repeatable); replaces the recipe's tuning.grid."),
    random_draws: int = typer.Option(None, "--random", help="Draw N configurations over tuning.ranges."),
    calibration_steps: int = typer.Option(10, "--calibration-steps", help="Timed steps per distinct step cost."),
    warmup_steps: int = typer.Option(2, "--warmup-steps", help="Untimed steps before them."),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="Measure step times (or use --step-seconds)."),
    step_seconds: float = typer.Option(None, "--step-seconds", help="Seconds per step, with --no-measure."),
    run_seconds: float = typer.Option(None, "--run-seconds", min=0.0,
                                      help="Fixed seconds per run outside its steps, with --no-measure (default 0)."),
    dataset_size: int = typer.Option(None, "--dataset-size", "-N", help="Account as if trained on N examples."),
    compare: bool = typer.Option(False, "--compare", help="The same search for each clipping method."),
    run: bool = typer.Option(False, "--run", help="Perform the search (repeat-and-select) and write its ledger."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    out: Path = typer.Option(None, "--out", help="Also write the result to this JSON file (e.g. tune_cost.json)."),
) -> None:
    """How many runs a search takes, how long on this machine, and how much ε.

    [b]Examples[/b]

      dpclip tune-cost recipes/quickstart.yaml --grid training.optimizer.lr=0.1,0.5 --grid clipping.threshold.value=0.1,1,10

      dpclip tune-cost recipes/quickstart.yaml --compare

      dpclip tune-cost recipes/quickstart.yaml --no-measure --step-seconds 0.2 -N 60000
    """
    if out is not None:
        _check_out(out, recipe_path)
    # Lazy: `dpclip --help` and the other commands must not pay for torch and the tuning stack.
    from dpclip.tuning.report import TuneCostOptions, tune_cost_report

    options = TuneCostOptions(grid=tuple(grid or ()), random_draws=random_draws, calibration_steps=calibration_steps,
                              warmup_steps=warmup_steps, measure=measure, step_seconds=step_seconds,
                              run_seconds=run_seconds, dataset_size=dataset_size, compare=compare, run=run)
    report = tune_cost_report(recipe_path, overrides or [], options, ProgressBar(quiet=as_json),
                              on_trial=None if as_json else _show_trial)
    payload = json_safe(report.to_dict())
    if out is not None:
        out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    if as_json:
        print_json(payload)
        return
    _render(report)
    if out is not None:
        console.print(f"written: {out}")


def _check_out(out: Path, recipe_path) -> None:
    """Refuse an ``--out`` that would replace a run's file (`--out RUN/ledger.json` replaced its ledger) or
    the recipe read (checked before the search is priced, which can take minutes)."""
    from dpclip.errors import DpclipError
    from dpclip.rundir.enclosing import enclosing_run

    run = enclosing_run(out)
    if run is not None:
        raise DpclipError(f"--out {out} is inside the run directory {run}, whose files the result must not replace",
                          "write the result outside the run, e.g. --out tune_cost.json")
    if recipe_path is not None and Path(out).resolve() == Path(recipe_path).resolve():
        raise DpclipError(f"--out {out} is the recipe being priced", "write the result elsewhere, e.g. --out "
                          "tune_cost.json")


def _show_trial(number: int, label: str) -> None:
    # The operator's console only: it shows how many trials ran, which the released result does not.
    console.print(f"trial {number}: {label}")


def _runs(count: float) -> str:
    return f"{count:g} run" + ("" if count == 1 else "s")


def _hours(hours: float) -> str:
    if hours < 1 / 60:
        return f"{hours * 3600:.3g} s"
    if hours < 1:
        return f"{hours * 60:.3g} min"
    return f"{hours:.3g} h"


def _render(report) -> None:
    privacy = report.privacy
    console.print(f"[bold]{report.recipe}[/]: {report.configurations} configuration"
                  f"{'' if report.configurations == 1 else 's'}, "
                  f"N = {report.dataset_size} ({N_LABEL}), {privacy.steps} steps per run (q = {fmt(privacy.sample_rate)})")
    if report.space_checked is not None:
        console.print(f"search space: {report.space_checked}", soft_wrap=True)
    _render_compute(report)
    _render_privacy(privacy)
    if report.comparison:
        _render_comparison(report.comparison)
    if report.search is not None:
        _render_search(report.search)


def _render_compute(report) -> None:
    """Seconds per step and per run, and the hours of the search (with a table of the runs when they differ)."""
    privacy = report.privacy
    compute = Table(title="compute", header_style="bold")
    compute.add_column("quantity")
    compute.add_column("value", justify="right")
    source = "measured" if report.measured else "given (--no-measure)"
    compute.add_row(f"seconds per step ({source})", fmt(report.step_seconds))
    compute.add_row("fixed seconds per run (data, model, σ, checkpoints, evaluation, plot)",
                    fmt(report.runs[0].fixed_seconds))
    if report.policy_overhead is not None:
        compute.add_row("threshold policy overhead vs fixed C", f"{100 * report.policy_overhead:+.1f}%")
    compute.add_row("steps per run", str(privacy.steps))
    compute.add_row("time per run", _hours(report.hours_per_run))
    compute.add_row(f"grid search ({_runs(report.configurations)})", _hours(report.search_hours))
    mean = privacy.strategy("repeat-and-select").detail["mean"]
    compute.add_row(f"repeat-and-select (E[K] = {_runs(mean)})", _hours(mean * report.hours_per_run))
    console.print(compute)
    if report.measured:
        from dpclip.tuning.cost import NOT_COVERED_TIMES

        console.print(f"  {NOT_COVERED_TIMES}", soft_wrap=True)

    if len({run.step_seconds for run in report.runs}) > 1:
        runs = Table(title="runs", header_style="bold")
        runs.add_column("configuration")
        runs.add_column("s/step", justify="right")
        runs.add_column("time", justify="right")
        for run in report.runs:
            runs.add_row(run.label, fmt(run.step_seconds), _hours(run.hours))
        console.print(runs)


def _render_privacy(privacy) -> None:
    """The search's ε under each strategy, with a note on each, and how the selection is scored."""
    assumed = "" if not privacy.caveats else " (if the batches were Poisson: see the CAVEAT)"
    eps = Table(title=f"privacy: whole search within ε = {privacy.target_epsilon:g}, δ = {privacy.delta:g}{assumed}",
                header_style="bold")
    eps.add_column("accounting")
    eps.add_column("σ per run", justify="right")
    eps.add_column("σ gradient", justify="right")
    eps.add_column("search ε", justify="right")
    eps.add_column("search δ", justify="right")
    recipe_sigmas = fmt(privacy.recipe_sigma), fmt(privacy.recipe_gradient_sigma)
    eps.add_row("one run, recipe's σ", *recipe_sigmas, fmt_upper(privacy.epsilon_one_run), f"{privacy.delta:g}")
    eps.add_row(f"naive, {_runs(privacy.configurations)}, recipe's σ", *recipe_sigmas,
                fmt_upper(privacy.epsilon_naive_at_recipe_sigma), f"{privacy.delta:g}")
    notes = []
    for strategy in privacy.strategies:
        notes.append(_strategy_note(strategy))
        eps.add_row(strategy.name, fmt(strategy.noise_multiplier), fmt(strategy.gradient_noise_multiplier), fmt_upper(strategy.epsilon),
                    f"{strategy.delta:g}")
    console.print(eps)
    for note in notes:
        console.print(f"  {note}", soft_wrap=True)
    console.print(f"sampling: {privacy.sampling_assumption}", soft_wrap=True)
    for caveat in privacy.caveats:
        console.print(f"[bold red]CAVEAT[/]: {caveat}", soft_wrap=True)
    if privacy.score == "private":
        console.print(f"selection score: private: {privacy.score_meaning}, score_noise = {privacy.score_noise:g}, "
                      "charged to every run", soft_wrap=True)
    else:
        console.print("selection score: public (the held-out split is public data by the recipe's claim; "
                      "nothing is charged for it)", soft_wrap=True)


def _strategy_note(strategy) -> str:
    """One line on how a search strategy was accounted (or why it is infeasible)."""
    detail = strategy.detail
    if "infeasible" in detail:
        return f"{strategy.name}: [red]infeasible[/]: {detail['infeasible']}"
    if strategy.name == "naive":
        return f"naive: {_runs(detail['runs'])} composed ({strategy.accountant})"
    if strategy.name == "liu-talwar":
        return (f"liu-talwar: per run (ε₁, δ₁) = ({fmt_upper(detail['epsilon_run'])}, "
                f"{detail['delta_run']:.4g}), γ = {fmt(detail['gamma'])}, δ₂ = {detail['delta_stop']:g}, "
                f"T = {detail['max_runs']:.1f} ({strategy.accountant})")
    shape = "Poisson" if detail["shape"] is None else f"truncated neg. binomial η = {detail['shape']:g}"
    return f"repeat-and-select: K ~ {shape}, E[K] = {detail['mean']:g} (rdp)"


def _render_comparison(comparison) -> None:
    """--compare: the same search for each clipping method."""
    table = Table(title="clipping methods: the same search", header_style="bold")
    for name, justify in (("method", "left"), ("runs", "right"), ("E[K]", "right"), ("s/step", "right"),
                          ("search", "right"),
                          ("speedup", "right"), ("σ grad. R&S", "right"), ("σ grad. naive", "right")):
        table.add_column(name, justify=justify)
    skipped = []
    for row in comparison:
        if "skipped" in row:
            skipped.append(f"  {row['method']} left out: {row['skipped']}")
            continue
        speedup = row["speedup_vs_fixed"]
        mean = row["repeat_and_select_mean"]
        table.add_row(row["method"], str(row["runs"]), "1" if mean is None else f"{mean:g}",
                      fmt(row["step_seconds"], 3),
                      _hours(row["search_hours"]), "n/a" if speedup is None else f"{speedup:.2f}x",
                      fmt(row["gradient_noise_multiplier_repeat_and_select"]),
                      fmt(row["gradient_noise_multiplier_naive"]))
    console.print(table)
    for line in skipped:
        console.print(line, soft_wrap=True)
    console.print("  speedup: search time of fixed-C DP-SGD over the C grid / this method's; σ grad.: per-run "
                  "gradient noise multiplier keeping the whole search within ε (R&S: repeat-and-select with E[K] trials: "
                  "the recipe's tuning.trials_mean, else the method's runs)",
                  soft_wrap=True)


def _render_search(search) -> None:
    """--run: the search performed, what it released and what it did not."""
    console.print(f"[bold]search[/] {search['search_dir']} ({search['stopped']}): "
                  f"ε = {fmt_upper(search['epsilon'])} at δ = {search['delta']:g} ({search['accountant']}); "
                  f"selected: {search['selected_run'] or 'none'}", soft_wrap=True)
    if search["selected_run"]:
        console.print(f"  released: the selected run ({search['selected_configuration']}) and its score "
                      f"{fmt(search['selected_score'])}; `dpclip account` on it reports the search's ε",
                      soft_wrap=True)
    console.print(f"  not released: {search['not_released']}", soft_wrap=True)
