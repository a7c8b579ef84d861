"""`dpclip recipes list|show|copy`: the recipes shipped with dpclip."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from dpclip.cli.render import console

app = typer.Typer(help="List, show and copy the shipped recipes.", no_args_is_help=True)


@app.command("list")
def list_recipes() -> None:
    """List the shipped recipes with what each one shows."""
    from dpclip.recipe.shipped import shipped_names, shipped_summary  # the recipe package imports torch
    table = Table(show_header=True, header_style="bold")
    table.add_column("recipe")
    table.add_column("what it shows")
    for name in shipped_names():
        table.add_row(name, shipped_summary(name))
    console.print(table)


@app.command("show")
def show(name: str = typer.Argument(..., help="Recipe name, e.g. quickstart.")) -> None:
    """Print a shipped recipe."""
    from dpclip.recipe.shipped import shipped_text  # the recipe package imports torch
    print(shipped_text(name), end="")


@app.command("copy")
def copy(
    name: str = typer.Argument(..., help="Recipe name, e.g. quickstart."),
    destination: Path = typer.Argument(Path("."), help="File or folder to copy to."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Copy a shipped recipe to edit it."""
    from dpclip.recipe.shipped import copy_shipped  # the recipe package imports torch
    path = copy_shipped(name, destination, overwrite=force)
    console.print(f"copied {name} to {path}")
