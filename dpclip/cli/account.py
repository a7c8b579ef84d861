"""`dpclip account`: calibrate noise, split the budget, state the privacy guarantee."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from dpclip.cli.render import console, error_console, fmt, fmt_upper, print_json
from dpclip.errors import DpclipError


class AccountantChoice(str, Enum):
    pld = "pld"
    rdp = "rdp"
    both = "both"


class SamplingChoice(str, Enum):
    poisson = "poisson"
    shuffle = "shuffle"


class UnitChoice(str, Enum):
    example = "example"
    user = "user"


class MechanismChoice(str, Enum):
    dp_sgd = "dp-sgd"
    banded_mf = "banded-mf"
    blt = "blt"


def account(
    target: Path = typer.Argument(None, help="A recipe YAML file (its plan) or a run directory (what it spent)."),
    overrides: list[str] = typer.Argument(None, help="key=value recipe overrides, e.g. privacy.epsilon=4"),
    eps: float = typer.Option(None, "--eps", "--epsilon", help="Target ε: calibrate σ to it."),
    delta: float = typer.Option(None, "--delta", help="δ of the (ε, δ) guarantee; must be below 1/N."),
    sigma: float = typer.Option(None, "--sigma", "--noise-multiplier", help="Total noise multiplier: compute ε."),
    sample_rate: float = typer.Option(None, "--sample-rate", "-q", help="Poisson rate q."),
    steps: int = typer.Option(None, "--steps", help="Number of steps."),
    dataset_size: int = typer.Option(None, "--dataset-size", "-N", help="Private training examples N."),
    batch_size: int = typer.Option(None, "--batch-size", "-B", help="Expected batch size B (q = B/N)."),
    epochs: float = typer.Option(None, "--epochs", help="Epochs (steps = ceil(epochs / q))."),
    aux: str = typer.Option(None, "--aux", help="A threshold statistic released with each gradient: quantile "
                            "(adaptive quantile thresholds) or histogram (DC-SGD), or that of another "
                            "registered policy."),
    aux_sigma: float = typer.Option(None, "--aux-sigma", help="Noise std of the statistic."),
    aux_fraction: float = typer.Option(None, "--aux-fraction", help="Budget share r of the statistic, in (0, 1)."),
    bins: int = typer.Option(None, "--bins", help="Deprecated: histogram bins b (--aux histogram). Changes "
                             "nothing: the histogram's sensitivity, so σ and ε, do not depend on b."),
    groups: int = typer.Option(None, "--groups", "-K", help="Clipping groups K (statistic sensitivity grows with "
                               "sqrt(K)); without a recipe only: a recipe's K is counted on its model."),
    accountant: AccountantChoice = typer.Option(AccountantChoice.pld, "--accountant",
                                                help="pld (RDP shown alongside), rdp, or both (σ safe under both)."),
    sampling: SamplingChoice = typer.Option(SamplingChoice.poisson, "--sampling",
                                            help="shuffle adds the caveat that the accounting assumes Poisson."),
    mechanism: MechanismChoice = typer.Option(MechanismChoice.dp_sgd, "--mechanism",
                                              help="dp-sgd (independent noise), banded-mf (noise correlated over "
                                              "--bands steps, cyclic Poisson sampling) or blt (correlated over all "
                                              "steps from --buffers buffers, no amplification: docs/formulas.md)."),
    bands: int = typer.Option(None, "--bands", help="b of --mechanism banded-mf (1 is DP-SGD)."),
    buffers: int = typer.Option(None, "--buffers", help="k of --mechanism blt (1 to 8)."),
    unit: UnitChoice = typer.Option(UnitChoice.example, "--unit", help="What ε protects: one record (example) or "
                                    "all records of one person (user: --users, --users-per-batch, "
                                    "--max-examples-per-user; docs/users.md)."),
    users: int = typer.Option(None, "--users", help="--unit user: the number of people (N in q = B/N)."),
    users_per_batch: int = typer.Option(None, "--users-per-batch", help="--unit user: expected people per batch."),
    max_examples_per_user: int = typer.Option(None, "--max-examples-per-user",
                                              help="--unit user: k, the most records of a person in a step."),
    group_size: int = typer.Option(None, "--group-size", help="Also show the ε that protects a group of k records "
                                   "at once (group privacy: kε, k·e^((k−1)ε)·δ), e.g. all records of one person."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """How much noise a private training needs, or what ε a given noise buys.

    [b]Examples[/b]

      dpclip account --eps 8 --delta 1e-5 --dataset-size 60000 --batch-size 256 --epochs 10

      dpclip account --eps 8 --delta 1e-5 -q 0.004 --steps 2000 --aux quantile --aux-fraction 0.01 -K 4

      dpclip account --eps 8 --delta 1e-5 -q 0.004 --steps 2000 --aux histogram --aux-sigma 5

      dpclip account recipes/quickstart.yaml privacy.epsilon=4

      dpclip account runs/quickstart-20261121-101500
    """
    from dpclip.planning.account import AccountFlags, account_report

    if target is not None and target.is_dir():
        _refuse_plan_options(target, overrides, [eps, delta, sigma, sample_rate, steps, dataset_size, batch_size,
                                                 epochs, aux, aux_sigma, aux_fraction, bins, groups, bands, buffers,
                                                 users, users_per_batch, max_examples_per_user],
                             (accountant, sampling, mechanism, unit))
        _account_directory(target, as_json, group_size)
        return
    flags = AccountFlags(eps=eps, delta=delta, sigma=sigma, sample_rate=sample_rate, steps=steps,
                         dataset_size=dataset_size, batch_size=batch_size, epochs=epochs, aux=aux, aux_sigma=aux_sigma,
                         aux_fraction=aux_fraction, bins=bins, groups=groups, accountant=accountant.value,
                         sampling=sampling.value, mechanism=mechanism.value, bands=bands, buffers=buffers,
                         unit=unit.value, users=users, users_per_batch=users_per_batch,
                         max_examples_per_user=max_examples_per_user, group_size=group_size)
    report = account_report(flags, target, overrides or [], note=_note)
    if as_json:
        print_json(report.to_dict())
    else:
        _render(report)
        if report.group:
            console.print(_group_line(report.group), soft_wrap=True)


def _refuse_plan_options(target: Path, overrides: list[str] | None, options: list, choices: tuple) -> None:
    """A directory's spending comes from its ledger: overrides and plan options given with it would be ignored."""
    defaults = (AccountantChoice.pld, SamplingChoice.poisson, MechanismChoice.dp_sgd, UnitChoice.example)
    if overrides or any(option is not None for option in options) or choices != defaults:
        raise DpclipError(f"{target} is a directory: what a run or search spent comes from its ledger, which "
                          "key=value overrides and the plan's options do not change",
                          "drop them (only --group-size and --json apply to a directory), or pass a recipe file "
                          "to plan a run with them")


def _note(text: str) -> None:
    error_console.print(f"[yellow]note:[/] {text}", soft_wrap=True)


def _group_line(group: dict) -> str:
    whose = " (e.g. one person's)" if group["of"] == "records" else ""
    if group["delta"] >= 1:   # "protected at δ = 1" protects nothing
        return (f"group privacy: a group of {group['group_size']} {group['of']}{whose} has no guarantee: the bound "
                "(kε, k·e^((k−1)ε)·δ) reaches δ = 1 (docs/users.md)")
    return (f"group privacy: a group of {group['group_size']} {group['of']}{whose} is protected at "
            f"ε = {fmt_upper(group['epsilon'])}, δ = {fmt_upper(group['delta'], 3)} (kε, k·e^((k−1)ε)·δ; docs/users.md)")


def _account_directory(target: Path, as_json: bool, group_size: int | None = None) -> None:
    """What a run directory, or a search directory of `tune-cost --run`, has spent."""
    from dpclip.planning.account import group_guarantee
    from dpclip.rundir.searchdir import headline
    from dpclip.rundir.searchdir import is_search_dir, read_search

    if is_search_dir(target):
        search = read_search(target)
        if as_json:
            print_json({"source": str(target), "kind": "search", "ledger": search.ledger.to_dict(),
                        "statement": search.statement.to_dict(), "selected_run": _selected(search)})
            return
        console.print(f"[bold]search {target}[/]: repeat-and-select; selected run: {_selected(search) or 'none'}",
                      soft_wrap=True)
        for line in search.statement.lines():
            console.print(f"  {line}", soft_wrap=True)
        return
    # A run selected by a search costs what the search spent: its own ledger covers its
    # training alone, not the other trials nor the selection.
    found = headline(target)
    ledger, statement = found.run_ledger, found.run_statement
    selected_by = found.selected_by()
    unit = "user" if statement.unit.startswith("user-level") else "example"
    group = None if group_size is None else group_guarantee(statement.epsilon, statement.delta, group_size, unit)
    if selected_by is None:
        if as_json:
            print_json({"source": str(target), "ledger": ledger.to_dict(), "statement": statement.to_dict(),
                        "lines": statement.lines()} | ({"group": group} if group else {}))
        else:
            console.print(f"[bold]run {target}[/]: {ledger.steps} steps recorded")
            for line in statement.lines():
                console.print(f"  {line}", soft_wrap=True)
            if group:
                console.print(_group_line(group), soft_wrap=True)
        return
    if as_json:
        print_json({"source": str(target), "kind": "selected run", "ledger": found.ledger.to_dict(),
                    "statement": found.statement.to_dict(), "lines": found.statement.lines(),
                    "selected_by_search": selected_by,
                    "run_ledger": ledger.to_dict(), "run_statement": statement.to_dict()})
        return
    console.print(f"[bold]run {target}[/]: selected by the search {found.search_dir}; publishing it costs the "
                  f"search's ε = {fmt_upper(found.epsilon)} at δ = {found.delta:g}", soft_wrap=True)
    for line in found.statement.lines():
        console.print(f"  {line}", soft_wrap=True)
    console.print(f"  this run's own ledger ({ledger.steps} steps, ε = {fmt_upper(statement.epsilon)}) understates what "
                  "was spent: it leaves out the other trials and the selection", soft_wrap=True)


def _selected(search) -> str | None:
    return None if search.selected_run is None else str(search.selected_run)


def _render(report) -> None:
    """The noise and privacy tables of an :class:`~dpclip.planning.account.AccountReport`, and its statement."""
    plan, result, split, bins = report.plan, report.result, report.result.split, report.bins
    if report.title:
        console.print(f"[bold]{report.title}[/]")
    table = Table(show_header=True, header_style="bold", title="noise")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("meaning")
    if split.sigma_aux is None:
        table.add_row("σ", fmt(split.noise_multiplier), "noise multiplier of the clipped gradient (std = σ × sensitivity)")
    else:
        table.add_row("σ total", fmt(split.noise_multiplier), "one joint Gaussian release per step (gradient + statistic)")
        table.add_row("σ gradient", fmt(split.gradient_noise_multiplier), "noise multiplier of the clipped gradient")
        table.add_row("σ statistic", fmt(split.sigma_aux), f"noise std of the statistic (sensitivity {fmt(split.aux_sensitivity)})")
        if bins is not None:
            table.add_row("histogram bins", str(bins), "b bins per group, N(0, σ_statistic²) each; "
                          "the sensitivity does not depend on b")
        table.add_row("budget share r", fmt(split.aux_fraction), "share of the budget spent on the statistic")
        table.add_row("noise inflation", fmt(split.inflation), "σ gradient / σ total")
    console.print(table)
    eps = Table(show_header=True, header_style="bold", title="privacy")
    eps.add_column("accountant")
    eps.add_column("ε", justify="right")
    eps.add_column("δ", justify="right")
    main_name = result.statement.accountant
    eps.add_row(main_name, fmt_upper(result.epsilon), f"{plan.delta:g}")
    if result.epsilon_rdp is not None and main_name != "rdp":
        eps.add_row("rdp", fmt_upper(result.epsilon_rdp), f"{plan.delta:g}")
    if plan.target_epsilon is not None:
        eps.caption = f"target ε = {plan.target_epsilon:g}"
    console.print(eps)
    console.print("[bold]statement[/]")
    for line in result.statement.lines():
        console.print(f"  {line}", soft_wrap=True)
