"""`dpclip audit-mia RUN_DIR|CHECKPOINT_DIR [--attack ...] [--shadows N] [--json]`."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dpclip import layout
from dpclip.cli.render import console, fmt, fmt_upper, fmt_lower, print_json


class AttackChoice(str, Enum):
    loss = "loss"
    logistic = "logistic"
    lira = "lira"
    rmia = "rmia"
    one_run = "one-run"
    exposure = "exposure"
    all = "all"


class ShadowProgress:
    """One progress bar per shadow model (the train observer interface)."""

    def __init__(self, progress: Progress, index: int, total: int):
        self.progress, self.label = progress, f"shadow {index + 1}/{total}"
        self.task = None

    def on_start(self, info):
        self.task = self.progress.add_task(self.label, total=info["steps"], completed=info.get("start_step", 0),
                                           status="resumed" if info.get("start_step") else "")

    def on_step(self, record):
        self.progress.update(self.task, completed=record["step"],
                             status=f"loss {record['diagnostics']['train_loss']:.3f} (not covered by ε)")

    def on_eval(self, record):
        pass

    def on_end(self, result):
        self.progress.update(self.task, status="done")


def _table(report: dict) -> None:
    from dpclip.audit.report import dp_bound_at, summary_rows

    ledger = report["ledger"]
    # every figure below is measured on private data (audit/report.json is labelled so too)
    title = (f"[bold]membership inference[/] (not covered by ε) — {report['checkpoint']} (step {report['step']}), "
             f"ledger ε = {fmt_upper(ledger['epsilon'])} at δ = {ledger['delta']:g}")
    if report["attacks"]:
        table = Table(title=title)
        for column in ("attack", "AUC [95% CI]", "TPR@0.1%FPR", "TPR@1%FPR", "bal. acc.", "advantage"):
            table.add_column(column, justify="left" if column == "attack" else "right")
        for row in summary_rows(report):
            low, high = row["auc_ci95"]
            ci = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
            table.add_row(row["attack"], f"{row['auc']:.3f}{ci}", f"{row['tpr_0.1']:.3f}", f"{row['tpr_1']:.3f}",
                          f"{row['balanced_accuracy']:.3f}", f"{row['advantage']:.3f}")
        table.add_row("DP bound", "", f"≤ {fmt_upper(dp_bound_at(report, 0.001), 3)}", f"≤ {fmt_upper(dp_bound_at(report, 0.01), 3)}",
                      "", "", style="dim")
        console.print(table)
        first = next(iter(report["attacks"].values()))
        console.print(f"  null AUC standard error ≈ {first['auc_null_std']:.3f} "
                      f"({first['members']} members, {first['non_members']} non-members)")
    else:
        console.print(title)
    one_run = report.get("one_run")
    if one_run:
        verdict = "[bold red]exceeds the ledger's ε[/]" if report.get("flagged") else "within the ledger's ε"
        console.print(f"  one-run audit: {one_run['correct']}/{one_run['guesses']} guesses right on "
                      f"{one_run['canaries']} {one_run['kind']} canaries → ε ≥ {fmt_lower(one_run['epsilon_lower_bound'])} "
                      f"at {100 * one_run['confidence']:.0f}% confidence, {verdict}", soft_wrap=True)
        fdp = one_run.get("fdp")
        if fdp:
            from dpclip.audit.one_run import FDP_CONDITION

            console.print(f"  f-DP one-run audit (Gaussian trade-off curve): {fdp['correct']}/{fdp['guesses']} right "
                          f"→ μ ≥ {fmt_lower(fdp['mu_lower_bound'])}, ε ≥ {fmt_lower(fdp['epsilon_lower_bound'])} "
                          f"({FDP_CONDITION})", soft_wrap=True)
    exposure = report.get("exposure")
    if exposure:
        planted = ", ".join(f"{row['exposure']:.1f} ({row['repetitions']}x{'' if row['how'] != 'extrapolated' else ', extrapolated'})"
                            for row in exposure["planted"])
        console.print(f"  canary exposure (bits, of at most {exposure['max_exposure']:.1f}; ranked among "
                      f"{exposure['ranked']}): planted {planted}; {exposure['controls']['count']} never-planted "
                      f"controls {fmt(exposure['controls']['mean_exposure'])} on average "
                      f"(chance {exposure['chance']:.2f})", soft_wrap=True)
    for note in report["notes"]:
        console.print(f"  [yellow]note:[/] {note}", soft_wrap=True)
    plot = f", plot: {layout.ROC_PLOT}" if report["attacks"] else ""
    console.print(f"  report: {layout.audit_dir(report['run_dir']) / layout.AUDIT_REPORT}{plot}")


def _attacks_to_run(chosen: list[str], target: Path) -> tuple[list[str], list[str]]:
    """(the attacks to run, notes): ``all`` leaves out the one-run audit and canary exposure on a
    run without their answer keys, and says why of the one-run audit."""
    from dpclip.audit import ATTACKS
    from dpclip.data.canaries import read_canary_secret
    from dpclip.data.exposure import read_exposure_secret

    if "all" not in chosen:
        return [name for name in ATTACKS if name in chosen], []
    names, notes = list(ATTACKS), []
    if target.is_dir():
        from dpclip.audit.report import resolve_target
        from dpclip.rundir.run import load_run_recipe

        run_dir, _ = resolve_target(target)
        if read_canary_secret(run_dir) is None:
            names.remove("one-run")
            if load_run_recipe(run_dir).audit.canaries is None:
                notes.append("one-run audit skipped: the run has no canaries (add audit.canaries to the recipe)")
            else:
                notes.append(f"one-run audit skipped: the run's answer key {layout.canaries_file(run_dir)} was "
                             "deleted (restore it from a backup of the run directory to run it)")
        if read_exposure_secret(run_dir) is None:
            names.remove("exposure")
    return names, notes


def audit_mia(
    target: Path = typer.Argument(..., help="A run directory, or one of its checkpoints/step_NNNNNN folders."),
    attack: list[AttackChoice] = typer.Option([AttackChoice.all], "--attack", "-a",
                                              help="Attack(s) to run; repeat the option for several."),
    shadows: int = typer.Option(8, "--shadows", help="LiRA and RMIA: shadow models trained from the run's recipe "
                                "(shared: RMIA's reference models are LiRA's shadows)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seeds the attack's splits, bootstrap and shadow subsets."),
    bootstrap: int = typer.Option(200, "--bootstrap", help="Bootstrap rounds of the AUC interval (0: none)."),
    confidence: float = typer.Option(0.95, "--confidence", help="Of the one-run ε lower bounds; auditing n "
                                     "checkpoints of one run, use 1 − 0.05/n (Bonferroni)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (no table, no progress bar)."),
    fail_if_flagged: bool = typer.Option(False, "--fail-if-flagged",
                                         help="Exit with code 3 when the one-run audit flags the run (its ε lower "
                                         "bound above the ledger's ε), after printing and writing the report; "
                                         "a CI gate. Needs the one-run audit (a run with audit.canaries)."),
) -> None:
    """Attack a finished run with membership inference and set the result beside its ε.

    [b]Examples[/b]

      dpclip audit-mia runs/quickstart-20261121-101500 --attack loss --attack logistic

      dpclip audit-mia runs/quickstart-20261121-101500 --attack lira --shadows 16

      dpclip audit-mia runs/quickstart-20261121-101500 --attack rmia --shadows 2

      dpclip audit-mia runs/canaries-20261121-101500/checkpoints/step_000600 --attack one-run --json

      dpclip audit-mia runs/gpt2-tiny-text-20261126-101500 --attack exposure
    """
    from dpclip.audit.report import audit
    from dpclip.errors import DpclipError

    names, notes = _attacks_to_run([a.value for a in attack], Path(target))
    if bootstrap < 0:
        raise DpclipError(f"--bootstrap must be ≥ 0, got {bootstrap}", "e.g. --bootstrap 200")
    if fail_if_flagged and "one-run" not in names:   # a gate that cannot fail would pass silently
        raise DpclipError("--fail-if-flagged needs the one-run audit, which this audit does not run"
                          + (f" ({notes[0].removeprefix('one-run audit skipped: ')})" if notes else ""),
                          "add --attack one-run (or --attack all) on a run trained with audit.canaries, e.g. "
                          "`audit: {canaries: {count: 200, kind: ood}}`")
    progress = None
    observer_for = None
    if {"lira", "rmia"} & set(names) and not as_json:
        progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=16), MofNCompleteColumn(),
                            TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console)
        progress.start()

        def observer_for(index, total):
            return ShadowProgress(progress, index, total)
    try:
        report = audit(Path(target), names, shadows=shadows, seed=seed, bootstrap=bootstrap, confidence=confidence,
                       shadow_observer=observer_for)
    finally:
        if progress is not None:
            progress.stop()
    report["notes"] = notes + report["notes"]
    if as_json:
        print_json(report)
    else:
        _table(report)
    if fail_if_flagged and report.get("flagged"):
        _fail_flagged(report)


def _fail_flagged(report: dict) -> None:
    """``--fail-if-flagged`` on a flagged report: ``error:`` and ``hint:``, exit code 3."""
    from dpclip.errors import AuditFlagged

    one_run, ledger = report["one_run"], report["ledger"]
    raise AuditFlagged(f"the one-run audit flagged the run: ε ≥ {fmt_lower(one_run['epsilon_lower_bound'])} at "
                       f"{100 * one_run['confidence']:.0f}% confidence, above the ledger's ε = "
                       f"{fmt_upper(ledger['epsilon'])} (--fail-if-flagged; report: "
                       f"{layout.audit_dir(report['run_dir']) / layout.AUDIT_REPORT})",
                       "the run may leak more than its accounting allows (a privacy bug or a wrong ledger); "
                       f"a correct run is flagged in at most {100 * (1 - one_run['confidence']):.2g}% of audits: "
                       "do not release it until the cause is found (docs/auditing.md)")
