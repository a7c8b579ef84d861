"""The model card of an export: ``privacy.json`` (machine-readable) and ``README.md``.

Everything here is a released quantity (docs/accounting.md, "Threat model"): the privacy
statement of what the run spent (the same as ``dpclip account RUN_DIR``), the recipe's
name, the exported checkpoint's step, the run's planned steps and how it stopped (as
``dpclip report`` says). No training loss, no held-out metrics, no canaries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpclip import __version__
from dpclip.accounting.statement import SEEDED_RANDOMNESS_WARNING, bound_text
from dpclip.export.paths import local_name
from dpclip.rundir.run import UNFINISHED, RunDir, planned_step

LABEL_NAMES_NOTE = ("label names: the class names of the data's label column, published as they are "
                    "(not covered by ε)")


def released_statement(run_dir: Path) -> tuple[Any, dict[str, Any] | None]:
    """(statement, search) of what publishing the run costs: :func:`dpclip.rundir.searchdir.headline`
    (for a run selected by a ``tune-cost --run`` search, the search's statement)."""
    from dpclip.rundir.searchdir import headline

    found = headline(run_dir)
    selected_by = found.selected_by()
    search = None if selected_by is None else {"search_dir": local_name(selected_by["search_dir"]),
                                               "run_epsilon_alone": selected_by["run_epsilon_alone"]}
    return found.statement, search


def run_progress(run_dir: Path, recipe, steps_done: int) -> tuple[int, str]:
    """(planned steps, how the run stopped) as ``dpclip report`` says: ``completed``, ``budget``,
    ``interrupted``, or ``unfinished`` (killed, crashed or still running: no summary of its last step)."""
    _, planned = planned_step(run_dir, recipe)
    return planned, RunDir(run_dir).stopped(steps_done)


def progress_line(steps: int, steps_planned: int, stopped: str, checkpoint_step: int) -> str:
    """One sentence: how far the run got, and where the exported checkpoint sits in it."""
    why = "unfinished: killed, crashed or still running" if stopped == UNFINISHED else stopped
    line = f"The run released {steps} of its {steps_planned} planned steps ({why})"
    if checkpoint_step < steps:
        return (line + f"; this checkpoint (step {checkpoint_step}) precedes its last released step, and ε "
                f"counts all {steps} released steps.")
    return line + "."


def privacy_card(statement, *, recipe_name: str, checkpoint: str, checkpoint_step: int, steps_planned: int,
                 stopped: str, label_names: list[str] | None, search: dict[str, Any] | None) -> dict[str, Any]:
    """``privacy.json``: the statement's facts, one key each, and its lines: every field from the one
    statement object the printed statement comes from (the same as ``dpclip account RUN_DIR``), and
    how far the run got (:func:`run_progress`)."""
    facts = statement.to_dict()
    card = {
        "format": "dpclip-privacy/1",
        "dpclip": __version__,
        "recipe": recipe_name,
        "checkpoint": checkpoint,
        "checkpoint_step": checkpoint_step,
        "epsilon": facts["epsilon"],
        "delta": facts["delta"],
        "unit_of_privacy": facts["unit"],
        "neighbouring": facts["neighbouring"],
        "accountant": facts["accountant"],
        "conversion": facts["conversion"],
        "sampling": facts["sampling"],
        "sampling_assumption": statement.sampling_assumption(),
        "mechanism": statement.mechanism(),
        "processes": facts["world_size"],
        "distribution": statement.distribution(),
        "sample_rate": facts["sample_rate"],
        "steps": facts["steps"],
        "steps_planned": steps_planned,
        "stopped": stopped,
        "progress": progress_line(facts["steps"], steps_planned, stopped, checkpoint_step),
        "noise_multiplier": facts["noise_multiplier"],
        "gradient_noise_multiplier": facts["gradient_noise_multiplier"],
        "seeded_randomness": facts["seeded_randomness"],
        "warning": SEEDED_RANDOMNESS_WARNING if facts["seeded_randomness"] else None,
        "caveats": list(facts["caveats"]),
        "not_covered_by_epsilon": list(facts["not_covered"]) + ([LABEL_NAMES_NOTE] if label_names else []),
        "statement": statement.lines(),
        "covers": ("the exported weights: a post-processing of the noisy releases counted in the ledger "
                   "(docs/accounting.md)"),
    }
    if search is not None:
        card["selected_by_search"] = search
    return card


def readme(card: dict[str, Any], *, kind: str, how_to_load: str, base_note: str | None = None) -> str:
    """``README.md``: Hugging Face's model-card layout (YAML header, then text)."""
    library = {"transformers": "transformers", "peft": "peft"}.get(kind)
    header = ["---"] + ([f"library_name: {library}"] if library else []) + \
        ["tags:", "- differential-privacy", "- dpclip", "---", ""]
    eps = "∞" if card["epsilon"] is None else bound_text(card['epsilon'])
    lines = header + [
        f"# {card['recipe']} (differentially private, ε = {eps}, δ = {card['delta']:g})", "",
        f"Trained with dpclip {card['dpclip']}; this is checkpoint `{card['checkpoint']}` "
        f"(step {card['checkpoint_step']}). {card['progress']}", "",
    ]
    if card["warning"]:
        lines += [f"**{card['warning']}**", ""]
    lines += ["## Privacy", "", f"The guarantee covers {card['covers']}.", ""]
    lines += [f"- {line}" for line in card["statement"] if line != card["warning"]]
    lines += ["", "### Not covered by ε", ""]
    lines += [f"- {item}" for item in card["not_covered_by_epsilon"]] or ["- nothing"]
    lines += ["", "No training loss, held-out metric or audit material is included: they are exact "
              "functions of the private data, not covered by ε (docs/export.md in dpclip).", ""]
    if base_note:
        lines += ["## Base model", "", base_note, ""]
    lines += ["## How to load", "", "```python", how_to_load.strip(), "```", ""]
    return "\n".join(lines)
