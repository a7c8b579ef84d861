"""`dpclip train RECIPE [key=value ...] [--resume RUN_DIR] [--dry-run] [--json] [--nproc N]`."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dpclip.cli.render import N_LABEL, console, fmt, fmt_upper, print_json


def _short(values, limit: int = 3) -> str:
    if not values:
        return "-"
    shown = ",".join(f"{v:.3g}" for v in values[:limit])
    return shown + (f" (+{len(values) - limit})" if len(values) > limit else "")


def _rate_row(info) -> tuple[str, str]:
    """The sample rate's row, named for how the loader draws batches: "Poisson" only when it
    samples Poisson batches (a shuffled loader is accounted as if Poisson: the statement's caveat)."""
    if info.get("cyclic_groups", 1) > 1:
        return "sample rate q", (f"{fmt(info['sample_rate'])} (cyclic over {info['cyclic_groups']} groups, one group a "
                                 "step: see the statement's mechanism line)")
    if info.get("sampling", "poisson") == "poisson":
        return "Poisson rate q", fmt(info["sample_rate"])
    return "sample rate q", f"{fmt(info['sample_rate'])} (fixed-size shuffled batches, accounted as if Poisson)"


class RichObserver:
    """Progress bar with step, loss, ε spent, thresholds and clip fraction."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.progress: Progress | None = None
        self.task = None
        self.epsilon = None

    def on_start(self, info):
        if self.quiet:
            return
        table = Table(show_header=False, box=None, title=f"[bold]{info['name']}[/]" + (" (dry run)" if info["dry_run"] else ""))
        table.add_row("run directory", info["run_dir"] or "-")
        if info.get("num_users") is not None:   # user-level: q = B / people (docs/users.md)
            table.add_row("people N", f"{info['num_users']} ({info['num_train']} records; {N_LABEL})")
        else:
            table.add_row("training examples N", f"{info['num_train']} ({N_LABEL})")
        table.add_row(*_rate_row(info))
        table.add_row("steps", str(info["steps"]))
        groups = info["groups"]
        table.add_row("clipping groups", f"{len(groups)}: " + ", ".join(groups[:4]) + (" …" if len(groups) > 4 else ""))
        table.add_row("trainable parameters", f"{info['parameters']:,}")
        table.add_row("device", info.get("device", "cpu"))  # training.device, resolved (docs/training.md)
        table.add_row("σ gradient", fmt(info["gradient_noise_multiplier"]))
        if info["sigma_aux"] is not None:
            table.add_row("σ statistic", fmt(info["sigma_aux"]))
        table.add_row("planned ε", f"{fmt_upper(info['planned_epsilon'])} at δ = {info['delta']:g} ({info['accountant']})")
        console.print(table)
        if info.get("sigma_change"):
            console.print(f"[bold yellow]warning:[/] {_sigma_line(info['sigma_change'])}", soft_wrap=True)
        if info.get("correlated_noise_note"):
            console.print(f"[bold yellow]warning:[/] {info['correlated_noise_note']}", soft_wrap=True)
        if info.get("resume_changes"):
            changed = ", ".join(f"{key} {_value(old)} -> {_value(new)}"
                                for key, (old, new) in info["resume_changes"].items())
            console.print(f"resumed from step {info.get('start_step', 0)} with changed fields: {changed}",
                          soft_wrap=True)
        if info.get("seeded_randomness"):
            from dpclip.accounting.statement import SEEDED_RANDOMNESS_WARNING

            console.print(f"[bold red]{SEEDED_RANDOMNESS_WARNING}[/]", soft_wrap=True)
        if info.get("exact_diagnostics"):
            console.print("loss, clip %, eval figures and time remaining below are computed without noise from "
                          "private data: "
                          "not covered by ε (privacy.exact_diagnostics: false turns them off)", soft_wrap=True)
        if info.get("continual"):
            console.print(_continual_line(info["continual"]), soft_wrap=True)
        if info["dry_run"]:
            return
        self.progress = Progress(
            BarColumn(bar_width=16), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            # Time remaining follows the step times, which follow the realised (private) batch
            # sizes: shown only with the other exact diagnostics, labelled with them above.
            *([TimeRemainingColumn()] if info.get("exact_diagnostics") else []), console=console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("train", total=info["steps"], completed=info.get("start_step", 0),
                                           status="")

    def on_step(self, record):
        if self.progress is None:
            return
        if record["epsilon"] is not None:
            self.epsilon = record["epsilon"]
        status = f"ε {fmt_upper(self.epsilon, 3)} C {_short(record['thresholds'], 1)}"
        if "phase" in record:
            status = f"phase {record['phase']}" + (f" α {record['alpha']:.2f}" if record["phase"] == "mixed" else "") \
                + (" (linear probe)" if record.get("probe") else "") + f" {status}"
        diag = record.get("diagnostics")
        if diag is not None:
            clip = diag["clip_fraction"]
            clip_text = "n/a" if clip is None else f"{100 * sum(clip) / max(len(clip), 1):.0f}%"
            status = f"loss {diag['train_loss']:.3f} {status} clip {clip_text}"
        self.progress.update(self.task, completed=record["step"], status=status)

    def on_phase(self, record):
        """A public-phase record (public steps, the switch rule's evaluations, the switch)."""
        if self.progress is None:
            return
        if record.get("kind") == "switch":
            self.progress.console.print(f"[bold]switch[/] after {record['public_step']} public steps: "
                                        f"{record['reason']}", soft_wrap=True)
        elif "public_eval" in record:
            metrics = "  ".join(f"{k} {v:.4g}" for k, v in record["public_eval"].items())
            self.progress.console.print(f"public step {record['public_step']}: public validation {metrics}")
        elif "public_loss" in record:
            self.progress.update(self.task, status=f"phase public: step {record['public_step']} "
                                 f"loss {record['public_loss']:.3f} (public data, ε 0)")

    def on_eval(self, record):
        if self.progress is not None:
            metrics = "  ".join(f"{k} {v:.4g}" for k, v in record["eval"].items())
            self.progress.console.print(f"step {record['step']}: eval {metrics}")

    def on_end(self, result):
        if self.progress is not None:
            self.progress.stop()


def _summary(result) -> None:
    table = Table(show_header=False, title="[bold]summary[/]")
    table.add_row("stopped", result.stopped)
    table.add_row("steps", f"{result.steps_done} / {result.steps_planned}")
    table.add_row("ε spent", f"{fmt_upper(result.epsilon)} at δ = {result.delta:g}")
    table.add_row("ε (RDP)", fmt_upper(result.epsilon_rdp))
    for key, value in result.final_eval.items():
        table.add_row(f"test {key} (not covered by ε)", fmt(value))
    table.add_row("run directory", str(result.run_dir))
    console.print(table)
    if result.stopped == "budget":
        console.print(f"[bold yellow]warning:[/] {budget_stop_line(result.steps_done, result.steps_planned)}",
                      soft_wrap=True)
    console.print("[bold]statement[/]")
    for line in result.statement:
        console.print(f"  {line}", soft_wrap=True)


def budget_stop_line(done: int, planned: int) -> str:
    """Why a run capped by privacy.epsilon stopped short, and what to change."""
    if done == 0:
        return ("no step was taken: the first step alone would take ε above privacy.epsilon. Raise "
                "privacy.noise_multiplier or privacy.epsilon, or leave noise_multiplier null to calibrate σ")
    return (f"stopped after {done} of {planned} steps: the next step would take ε above privacy.epsilon "
            "(the weights are those of the last step taken)")


def _continual_line(continual) -> str:
    """e.g. "continual: switch schedule, public data builtin:digits (144 train + 36 validation rows)"."""
    line = f"continual: {continual['schedule']} schedule"
    if continual["public_source"]:
        line += (f", public data {continual['public_source']} ({continual['public_train']} train + "
                 f"{continual['public_validation']} validation rows, declared public by you: not covered by ε)")
    if continual["schedule"] in ("switch", "only-public"):
        line += f"; public phase ends by rule {continual['rule']} or at {continual['max_public_steps']} public steps"
        if continual["public_step"]:
            line += f" (resumed at public step {continual['public_step']}, phase {continual['phase']})"
    return line


def _value(value) -> str:
    if value is None:   # a field the other mechanism does not have (DP-SGD has no bands)
        return "unset"
    return fmt(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _sigma_line(change) -> str:
    """e.g. "training.epochs 30 -> 1: σ 1.07 -> 0.53 for ε = 8" (ε is what the recipe fixes)."""
    moved = ", ".join(f"{key} {_value(old)} -> {_value(new)}" for key, (old, new) in change["changed"].items())
    if change["calibrated"]:
        return (f"{moved}: σ {fmt(change['sigma_file'], 3)} -> {fmt(change['sigma'], 3)} "
                f"for ε = {fmt(change.get('target_epsilon', change['epsilon']), 3)} "   # the recipe's target, not
                "(ε stays fixed; the noise per step changes)")                         # its calibrated 7.96
    return f"{moved}: ε {fmt(change['epsilon_file'], 3)} -> {fmt(change['epsilon'], 3)} at σ = {fmt(change['sigma'], 3)}"


def thread_count(threads: str | int | None) -> str | int:
    """--threads: "auto" (also when absent) or a whole number; configure() checks the number. A
    number typed on the command line may not exceed the machine's logical CPUs: 100000 threads
    exhausted the process's memory (a traceback). A resume's recorded count (an int) is kept."""
    if threads is None or threads == "auto" or isinstance(threads, int):
        return threads or "auto"
    from dpclip.errors import DpclipError

    try:
        count = int(threads)
    except ValueError:
        raise DpclipError(f"--threads takes a whole number or 'auto', got {threads!r}",
                          "e.g. --threads 1 beside other jobs; leave it out for auto") from None
    cpus = os.cpu_count() or 1
    if count > cpus:
        raise DpclipError(f"--threads {count} is more than the {cpus} logical CPUs of this machine",
                          f"more threads than CPUs only wait on each other: use --threads {cpus} or fewer, or auto")
    return count


def train(
    recipe: str = typer.Argument(None, metavar="[RECIPE]",
                                 help="Recipe YAML file (optional with --resume, whose overrides then follow)."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. training.optimizer.lr=0.05"),
    resume: Path = typer.Option(None, "--resume", help="Continue the run in this directory from its LATEST checkpoint; "
                                "key=value overrides of non-privacy fields apply from there."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Build data, model, engine and plan; do not train."),
    as_json: bool = typer.Option(False, "--json", help="Print the final summary as JSON (no progress bar)."),
    threads: str = typer.Option(None, "--threads", help="torch threads: a number, or auto (the default: the cores "
                                "the machine's load leaves free); --resume reuses the run's count."),
    nproc: int = typer.Option(None, "--nproc", help="Train data-parallel in N processes on this machine (torchrun's "
                              "launcher; see docs/distributed.md). A resume needs the run's own N."),
    master_port: int = typer.Option(None, "--master-port", help="With --nproc: the port the ranks meet on "
                                    "(default: a free one)."),
) -> None:
    """Train a model with differential privacy from a recipe.

    [b]Examples[/b]

      dpclip train recipes/quickstart.yaml

      dpclip train recipes/quickstart.yaml training.optimizer.lr=0.3 --dry-run

      dpclip train --resume runs/quickstart-20261121-101500

      dpclip train --resume runs/quickstart-20261121-101500 training.optimizer.lr=0.1

      dpclip train recipes/quickstart.yaml --nproc 2

    SIGTERM and Ctrl-C stop at the next step boundary with a checkpoint; resume with --resume.
    """
    # Lazy: `dpclip --help` and the other commands must not pay for torch and the training stack.
    from dpclip.distributed import errors_to_launcher, joined_world
    from dpclip.threads import configure
    from dpclip.train.launch import (launch_ranks, raise_if_interrupted, run_threads, spawns_ranks,
                                     training_recipes)
    from dpclip.train.workflow import train as run_training

    if spawns_ranks(nproc):
        thread_count(threads)  # what every rank would refuse, refused once before any starts
        training_recipes(recipe, overrides or [], resume)
        launch_ranks(recipe, overrides or [], resume=resume, as_json=as_json, threads=threads, dry_run=dry_run,
                     nproc=nproc, master_port=master_port)
        return
    with errors_to_launcher():  # a rank of --nproc leaves its error to the launcher, which prints one
        configure(thread_count(run_threads(threads, resume)))
        loaded, file_recipe = training_recipes(recipe, overrides or [], resume)
        with joined_world() as world:  # one of several ranks under torchrun, or None
            result = run_training(loaded, resume=resume, dry_run=dry_run, observer=RichObserver(quiet=as_json),
                                  file_recipe=file_recipe, world=world)
            if world is None or world.main:  # rank 0 shows the result
                _show(result, as_json, dry_run)
            raise_if_interrupted(result, world)


def _show(result, as_json: bool, dry_run: bool) -> None:
    if as_json:
        print_json(result.to_dict())
    elif not dry_run:
        _summary(result)
    else:
        console.print("[bold]statement (planned)[/]")
        for line in result.statement:
            console.print(f"  {line}", soft_wrap=True)
