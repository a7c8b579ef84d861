"""`dpclip account`: calibrate noise, split the budget, state the privacy guarantee."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from dpclip.cli.render import console, error_console, fmt, print_json


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
    from dpclip.planning import plan as planning

    accountant_name = accountant.value
    if target is not None and target.is_dir():
        _account_directory(target, as_json, group_size)
        return
    if target is not None:
        flags = {"--eps": eps, "--delta": delta, "--sigma": sigma, "--sample-rate": sample_rate, "--steps": steps,
                 "--batch-size": batch_size, "--epochs": epochs, "--aux": aux, "--aux-sigma": aux_sigma,
                 "--aux-fraction": aux_fraction, "--bins": bins, "--groups": groups}
        given = [name for name, value in flags.items() if value is not None]
        if given:
            from dpclip.errors import AccountingError

            raise AccountingError(f"{', '.join(given)} cannot be combined with a recipe",
                                  "change the recipe with key=value overrides, e.g. privacy.epsilon=4 (its "
                                  "clipping groups K are counted on its model)")
        from dpclip.recipe import load_recipe

        recipe = load_recipe(target, overrides or [])
        plan = planning.plan_for_recipe(recipe, dataset_size=dataset_size)
        if accountant == AccountantChoice.pld:
            accountant_name = recipe.privacy.accountant
        bins = getattr(recipe.clipping.threshold, "bins", None)
        title = f"recipe {recipe.name}"
    else:
        if overrides:
            from dpclip.errors import AccountingError

            raise AccountingError(f"unexpected arguments: {' '.join(overrides)}",
                                  "key=value overrides need a recipe: dpclip account RECIPE.yaml key=value")
        aux_spec = None
        if bins is not None:
            from dpclip.errors import AccountingError

            if aux != "histogram":
                raise AccountingError("--bins belongs to the DC-SGD histogram preset",
                                      "use it with --aux histogram, e.g. --aux histogram --aux-sigma 5")
            if bins < 2:
                raise AccountingError(f"--bins must be at least 2, got {bins}", "the DC-SGD paper uses 20 bins")
            error_console.print("[yellow]note:[/] --bins is deprecated and changes nothing: the histogram's "
                                "sensitivity, so σ and ε, do not depend on the number of bins", soft_wrap=True)
        if aux is not None:
            aux_spec = _statistic(aux, groups or 1, aux_sigma, aux_fraction)
        elif aux_sigma is not None or aux_fraction is not None:
            from dpclip.errors import AccountingError

            raise AccountingError("--aux-sigma / --aux-fraction need --aux histogram|quantile",
                                  "e.g. --aux quantile --aux-fraction 0.01")
        if (mechanism is MechanismChoice.banded_mf) != (bands is not None):
            from dpclip.errors import AccountingError

            raise AccountingError("--bands goes with --mechanism banded-mf, and banded-mf needs --bands",
                                  "e.g. --mechanism banded-mf --bands 8")
        if unit is UnitChoice.user:
            dataset_size, batch_size = _user_flags(users, users_per_batch, max_examples_per_user, dataset_size,
                                                   batch_size, sample_rate)
        elif users is not None or users_per_batch is not None or max_examples_per_user is not None:
            from dpclip.errors import AccountingError

            raise AccountingError("--users, --users-per-batch and --max-examples-per-user go with --unit user",
                                  "e.g. --unit user --users 10000 --users-per-batch 256 --max-examples-per-user 8")
        if (mechanism is MechanismChoice.blt) != (buffers is not None):
            from dpclip.errors import AccountingError

            raise AccountingError("--buffers goes with --mechanism blt, and blt needs --buffers",
                                  "e.g. --mechanism blt --buffers 2")
        plan = planning.plan_from_flags(delta=delta, epsilon=eps, noise_multiplier=sigma, sample_rate=sample_rate,
                                        steps=steps, dataset_size=dataset_size, batch_size=batch_size,
                                        epochs=epochs, accountant="pld", sampling=sampling.value, aux=aux_spec,
                                        bands=1 if bands is None else bands, buffers=buffers or 0,
                                        unit=unit.value, max_examples_per_user=max_examples_per_user)
        title = None
    result = planning.solve_plan(plan, accountant_name)
    group = None if group_size is None else _group(result.epsilon, plan.delta, group_size, plan.unit)
    if as_json:
        print_json(_as_dict(plan, result, accountant_name, title, bins) | ({"group": group} if group else {}))
    else:
        _render(plan, result, accountant_name, title, bins)
        if group:
            console.print(_group_line(group), soft_wrap=True)


def _user_flags(users, users_per_batch, max_examples_per_user, dataset_size, batch_size, sample_rate):
    """(N, B) of a user-level plan from its flags: people and expected people per batch."""
    from dpclip.errors import AccountingError

    if dataset_size is not None or batch_size is not None:
        raise AccountingError("--unit user counts people: give --users and --users-per-batch, not --dataset-size "
                              "and --batch-size", "e.g. --unit user --users 10000 --users-per-batch 256")
    if max_examples_per_user is None:
        raise AccountingError("--unit user needs --max-examples-per-user (k, the most records of a person in a step)",
                              "e.g. --max-examples-per-user 8")
    if sample_rate is None and (users is None or users_per_batch is None):
        raise AccountingError("--unit user needs --users and --users-per-batch (or --sample-rate, people per batch / "
                              "people)", "e.g. --unit user --users 10000 --users-per-batch 256")
    return users, users_per_batch


def _group(epsilon: float, delta: float, group_size: int, unit: str = "example") -> dict:
    from dpclip.accounting.group import group_privacy

    group_epsilon, group_delta = group_privacy(epsilon, delta, group_size)
    return {"group_size": group_size, "of": "people" if unit == "user" else "records", "epsilon": group_epsilon,
            "delta": group_delta}


def _group_line(group: dict) -> str:
    whose = " (e.g. one person's)" if group["of"] == "records" else ""
    return (f"group privacy: a group of {group['group_size']} {group['of']}{whose} is protected at "
            f"ε = {fmt(group['epsilon'])}, δ = {group['delta']:.3g} (kε, k·e^((k−1)ε)·δ; docs/users.md)")


def _statistic(alias: str, groups: int, sigma: float | None, fraction: float | None):
    """What the planner charges for the statistic ``alias`` of a registered threshold policy."""
    # Lazy: the policy registry lives in the engine package, which imports torch.
    from dpclip.engine.policies import statistic_aliases, statistic_spec
    from dpclip.errors import AccountingError

    spec = statistic_spec(alias)
    if spec is None:
        raise AccountingError(f"unknown --aux statistic {alias!r}", "use one of: " + ", ".join(statistic_aliases()))
    return spec.aux_spec(groups, sigma, fraction)


def _account_directory(target: Path, as_json: bool, group_size: int | None = None) -> None:
    """What a run directory, or a search directory of `tune-cost --run`, has spent."""
    from dpclip.rundir.searchdir import headline
    from dpclip.tuning.search import is_search_dir, read_search

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
    group = None if group_size is None else _group(statement.epsilon, statement.delta, group_size, unit)
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
                  f"search's ε = {fmt(found.epsilon)} at δ = {found.delta:g}", soft_wrap=True)
    for line in found.statement.lines():
        console.print(f"  {line}", soft_wrap=True)
    console.print(f"  this run's own ledger ({ledger.steps} steps, ε = {fmt(statement.epsilon)}) understates what "
                  "was spent: it leaves out the other trials and the selection", soft_wrap=True)


def _selected(search) -> str | None:
    return None if search.selected_run is None else str(search.selected_run)


def _as_dict(plan, result, accountant: str, title: str | None, bins: int | None = None) -> dict:
    split = result.split
    return {
        "source": title or "flags",
        "accountant": accountant,
        "sample_rate": plan.sample_rate,
        "steps": plan.steps,
        "bands": plan.bands,
        "mechanism": plan.mechanism,
        "buffers": plan.buffers,
        "groups": plan.groups,
        "delta": plan.delta,
        "target_epsilon": plan.target_epsilon,
        "epsilon": result.epsilon,
        "epsilon_rdp": result.epsilon_rdp,
        "noise": {
            "noise_multiplier": split.noise_multiplier,
            "gradient_noise_multiplier": split.gradient_noise_multiplier,
            "sigma_aux": split.sigma_aux,
            "aux_sensitivity": split.aux_sensitivity,
            "aux_fraction": split.aux_fraction,
            "inflation": split.inflation,
            "bins": bins,
        },
        "fallback_reason": result.fallback_reason,
        "statement": result.statement.to_dict(),
    }


def _render(plan, result, accountant: str, title: str | None, bins: int | None = None) -> None:
    split = result.split
    if title:
        console.print(f"[bold]{title}[/]")
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
    eps.add_row(main_name, fmt(result.epsilon), f"{plan.delta:g}")
    if result.epsilon_rdp is not None and main_name != "rdp":
        eps.add_row("rdp", fmt(result.epsilon_rdp), f"{plan.delta:g}")
    if plan.target_epsilon is not None:
        eps.caption = f"target ε = {plan.target_epsilon:g}"
    console.print(eps)
    console.print("[bold]statement[/]")
    for line in result.statement.lines():
        console.print(f"  {line}", soft_wrap=True)
