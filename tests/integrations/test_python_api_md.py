"""docs/python-api.md keeps up with the API it documents: its `make_private(...)` signature
names real parameters with their real defaults, and every parameter of make_private and every
field of DPTrainer's PrivacyArguments is named on the page."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import dpclip

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def shown_signature(text: str) -> dict[str, object]:
    """The "Arguments" section's `make_private(...)`: each parameter and its shown default
    (``inspect.Parameter.empty`` for none; ``a | b`` shows two parameters, one of them given)."""
    section = text.split("## Arguments", 1)[1]
    args = re.search(r"`make_private\((.*?)\)`", section, re.S).group(1)
    shown = {}
    for part in (p.strip() for p in args.replace("\n", " ").split(",")):
        if part == "*":
            continue
        name, _, default = part.partition("=")
        for alternative in name.split("|"):
            shown[alternative.strip()] = ast.literal_eval(default) if default else inspect.Parameter.empty
    return shown


def test_the_arguments_signature_names_real_parameters_with_their_real_defaults():
    real = {name: p.default for name, p in inspect.signature(dpclip.make_private).parameters.items()}
    shown = shown_signature(PAGE.read_text(encoding="utf-8"))
    assert set(shown) <= set(real), f"not parameters of make_private: {sorted(set(shown) - set(real))}"
    wrong = {n: (d, real[n]) for n, d in shown.items() if d is not inspect.Parameter.empty and d != real[n]}
    assert not wrong, f"python-api.md shows these defaults (shown, real): {wrong}"


def test_every_make_private_parameter_and_privacy_argument_is_named_on_the_page():
    from dpclip.integrations.transformers import PrivacyArguments

    text = PAGE.read_text(encoding="utf-8")
    names = list(inspect.signature(dpclip.make_private).parameters)
    names += [f.name for f in dataclasses.fields(PrivacyArguments)]
    missing = [n for n in names if not re.search(rf"`[^`]*\b{n}\b[^`]*`", text)]
    assert not missing, f"docs/python-api.md does not name {missing}"


def test_the_signature_check_sees_a_renamed_parameter_and_a_changed_default():
    text = '## Arguments\n\n`make_private(model, *, criterion, target_eps | noise_multiplier, accountant="rdp")`'
    shown = shown_signature(text)
    assert "target_eps" in shown and shown["accountant"] == "rdp" and shown["criterion"] is inspect.Parameter.empty
