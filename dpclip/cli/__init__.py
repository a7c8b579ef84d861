"""Command-line interface: Typer parsing and rich rendering only."""
