"""`dpclip export RUN_DIR OUT_DIR`: a run's checkpoint as a model directory (docs/export.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from dpclip.cli.render import console, fmt_upper, print_json


def export(
    run_dir: Path = typer.Argument(..., help="A run directory written by `dpclip train`."),
    out_dir: Path = typer.Argument(..., help="Folder to write (must be absent or empty unless --force)."),
    checkpoint: str = typer.Option(None, "--checkpoint", help="Which checkpoint, e.g. step_000500 (default: the latest)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists and is not empty."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Write a trained model the ecosystem loads, with its privacy statement.

    transformers models: save_pretrained output (config, weights, tokenizer); LoRA runs: the
    peft adapter and its base; other models: model.safetensors and model_card.json. Always
    README.md and privacy.json (ε, δ, unit, accountant, what is not covered by ε).

    [b]Example[/b]

      dpclip export runs/gpt2-tiny-text-20261121-101500 exported/gpt2-tiny
    """
    from dpclip.export import export_run  # lazy: imports torch and transformers

    result = export_run(run_dir, out_dir, checkpoint=checkpoint, force=force)
    if as_json:
        print_json(result.to_dict())
        return
    privacy = result.privacy
    console.print(f"[green]exported[/] {result.checkpoint} of {run_dir} to {result.out_dir} ({result.kind}): "
                  f"{', '.join(result.files)}", soft_wrap=True)
    console.print(f"  ε = {fmt_upper(privacy['epsilon'])} at δ = {privacy['delta']:g} ({privacy['unit_of_privacy']}, "
                  f"{privacy['accountant']}); the model card is README.md and privacy.json", soft_wrap=True)
