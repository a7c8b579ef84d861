"""`dpclip validate FILE [key=value ...]`: check a recipe without running it."""

from __future__ import annotations

from pathlib import Path

import typer

from dpclip.cli.render import N_LABEL, console


def validate(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. training.optimizer.lr=0.05"),
    show: bool = typer.Option(False, "--show", help="Print the resolved recipe with every default filled in."),
) -> None:
    """Check a recipe (and overrides) against the schema and, where its size is known, the data."""
    from dpclip.recipe import load_recipe, recipe_to_yaml  # imports torch (the policies' specs)
    from dpclip.planning.plan import check_against_data

    resolved = load_recipe(recipe, overrides or [])
    dataset_size = check_against_data(resolved)
    if show:
        print(recipe_to_yaml(resolved), end="")
    else:
        size = f"{dataset_size} training examples, {N_LABEL}" if dataset_size is not None else "data size checked at training"
        console.print(f"[green]ok[/]: {recipe} is a valid recipe ({resolved.name}; {size})")
