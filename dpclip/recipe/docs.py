"""Generate the field reference of docs/recipes.md from the schema itself.

Run ``python -m dpclip.recipe.docs > docs/recipes.md`` after changing the schema; a
test fails when the file and the schema disagree.
"""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from dpclip.engine.policies import policy_specs
from dpclip.recipe import schema

INTRO = """\
# Recipe reference

A recipe is one YAML file that says what to train, on what, and with which privacy. To
write one, start from a shipped recipe, change it, and check it:

```bash
dpclip recipes copy quickstart .                 # quickstart.yaml in this directory
dpclip validate quickstart.yaml                  # ok: ... is a valid recipe (quickstart; 1438 training examples, public, not covered by ε)
dpclip validate quickstart.yaml --show           # the resolved recipe, every default filled in
dpclip validate quickstart.yaml training.optimizer.lr=0.05 clipping.grouping='{uniform: 4}'
```

Any field can be overridden on the command line with `key=value`, parsed as YAML and
validated through the same schema. Unknown keys and wrong values are errors that name the
dotted path of the field and the allowed values:

```
error: clipping.threshold.kind: 'dcsgd_x' is not one of fixed, quantile, dcsgd-p, dcsgd-e, discriminative (from your key=value override, not quickstart.yaml)
```

Rules that need the data (checked by `dpclip account RECIPE` and by training): the
Poisson rate is q = batch_size / N with N the training examples after the split, so
batch_size must not exceed N; `privacy.delta` must be below 1/N. Public data and
continual pre-training (`public:`, `continual:`, `data.public_fraction`; shipped as
`recipes/continual-cnn-digits.yaml` and `recipes/continual-gpt2-text.yaml`):
docs/continual.md.

## Paths

A relative path written in a recipe file (`data.train`, `data.test`, a local `tokenizer`,
`model.pretrained`, a local `data.name` folder of `source: hf`) is relative to the recipe
file's directory, not to where the command runs; a path given as a `key=value` override
is relative to the current directory. A custom model's module is looked for in
`model.module_dir`, the recipe file's directory unless given, so `target:
'mymodel:build'` finds `mymodel.py` beside the recipe. The run directory's `recipe.yaml`
holds the resolved, absolute paths, so `--resume`, `account` and `audit-mia` work from
any directory. (`output_dir` stays relative to the current directory.)

## Fields

This list is generated from the schema (`python -m dpclip.recipe.docs > docs/recipes.md`);
a test fails when the two disagree. A section with variants (data, model, optimizer,
mechanism, threshold) is chosen by its `kind` or `source`; its table says which variants
each field belongs to.
"""


def _type_name(annotation: typing.Any) -> str:
    annotation = schema.annotation_now(annotation)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        members = [a for a in args if a is not type(None)]
        tags = [_variant_tag(a) for a in members]
        if all(tags):
            return "one of " + ", ".join(f"`{t}`" for t in tags) + " (below)"
        text = " \\| ".join(_type_name(a) for a in members)
        return text + (" \\| null" if len(members) < len(args) else "")
    if origin in (list, tuple, dict):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is typing.Any:
        return "see description"
    return getattr(annotation, "__name__", str(annotation))


def _variant_tag(model: typing.Any) -> str | None:
    """'source: builtin' for a union member chosen by its tag field, else None."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    for tag in ("kind", "source"):
        field = model.model_fields.get(tag)
        if field is not None and typing.get_origin(field.annotation) is typing.Literal:
            return f"{tag}: {typing.get_args(field.annotation)[0]}"
    return None


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{value!r}`" if value is not None else "null"


def _constraints(field) -> str:
    parts = []
    for item in field.metadata:
        for name, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            bound = getattr(item, name, None)
            if bound is not None:
                parts.append(f"{symbol} {bound}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _summary(model: type[BaseModel], note: str) -> str:
    """The model docstring's first paragraph (not a base class's), then the note."""
    doc = (model.__doc__ or "").strip()
    first = " ".join(doc.split("\n\n")[0].split()) if doc and not doc.startswith("Base of") else ""
    return " ".join(part for part in (first, note) if part)


def _cells(field) -> tuple[str, str, str]:
    """Type, default and description (with its constraints) of one field."""
    description = (field.description or "").replace("|", "\\|")
    constraint = _constraints(field)
    if constraint:
        description = f"{description} ({constraint})" if description else constraint
    return _type_name(field.annotation), _default(field), description


def _section(title: str, model: type[BaseModel], note: str = "") -> list[str]:
    lines = [f"### `{title}`", ""]
    summary = _summary(model, note)
    if summary:
        lines += [summary, ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        lines.append(f"| `{name}` | " + " | ".join(_cells(field)) + " |")
    return lines + [""]


_VARIANT = re.compile(r"^(?P<parent>.+): \{(?P<tag>kind|source): (?P<value>[^}]+)\}$")


def _variants_section(parent: str, tag: str, variants: list[tuple[str, type[BaseModel], str]]) -> list[str]:
    """One table for the variants of a section chosen by ``tag``: a field that several
    variants share (same type, default and description) is one row naming them all."""
    values = [value for value, _, _ in variants]
    lines = [f"### `{parent}`", "", f"Chosen by `{tag}`: " + ", ".join(f"`{value}`" for value in values) + ".", ""]
    summaries = [(value, _summary(model, note)) for value, model, note in variants]
    lines += [f"- `{tag}: {value}`: {summary}" for value, summary in summaries if summary]
    if any(summary for _, summary in summaries):
        lines.append("")
    rows: dict[tuple[str, ...], list[str]] = {}
    for value, model, _ in variants:
        for name, field in model.model_fields.items():
            if name != tag:
                rows.setdefault((name, *_cells(field)), []).append(value)
    lines += [f"| field | {tag} | type | default | description |", "|---|---|---|---|---|"]
    for (name, *cells), owners in rows.items():
        which = "all" if len(owners) == len(values) else ", ".join(owners)
        lines.append(f"| `{name}` | {which} | " + " | ".join(cells) + " |")
    return lines + [""]


POLICIES = object()   # where the registered threshold policies' sections go

_SECTIONS: list = [
    ("recipe (top level)", schema.Recipe, ""),
    ("data: {source: builtin}", schema.BuiltinData, ""),
    ("data: {source: hf}", schema.HFData, ""),
    ("data: {source: files}", schema.FilesData, ""),
    ("model: {kind: mlp}", schema.MLPModel, ""),
    ("model: {kind: cnn}", schema.CNNModel, ""),
    ("model: {kind: hf}", schema.HFModel, ""),
    ("model: {kind: custom}", schema.CustomModel, ""),
    ("model.lora (kind: hf)", schema.LoRA, ""),
    ("training", schema.Training, ""),
    ("training.optimizer: {kind: sgd}", schema.SGD, ""),
    ("training.optimizer: {kind: adam}", schema.Adam, ""),
    ("training.optimizer: {kind: adamw}", schema.AdamW, ""),
    ("training.schedule", schema.Schedule, ""),
    ("privacy", schema.Privacy, "Give `epsilon` (σ is calibrated to it) or `noise_multiplier` (ε follows); "
                                "with both, ε is a cap that training never exceeds."),
    ("privacy.mechanism: {kind: dp-sgd}", schema.DpSgd, "Independent Gaussian noise at every step (the default)."),
    ("privacy.mechanism: {kind: banded-mf}", schema.BandedMF,
     "Banded matrix factorization: noise correlated over `bands` steps, cyclic Poisson sampling, any "
     "threshold policy; docs/methods.md, \"Correlated noise\"."),
    ("privacy.mechanism: {kind: blt}", schema.Blt,
     "Buffered linear Toeplitz: noise correlated over all steps through `buffers` buffers, the data cut into "
     "⌊1/q⌋ groups taken in turn, no amplification by sampling, any threshold policy; docs/methods.md, "
     "\"Correlated noise\"."),
    ("clipping", schema.Clipping, "`grouping` is one of: `all-layer` (one group), `layer` (weight and bias of "
                                  "a module), `param` (each tensor), `block` (transformer blocks), `{uniform: M}` "
                                  "(M contiguous groups of near-equal size), `{groups: [[regex, ...], ...]}` "
                                  "(explicit), `{stages: [regex, ...]}` (per-device stages)."),
    POLICIES,
    ("eval", schema.Eval, ""),
    ("checkpoint", schema.Checkpoint, ""),
    ("logging", schema.Logging, "Plots, TensorBoard tags and `dpclip report`: docs/training.md, "
                                "\"Plots and logging\"."),
    ("audit", schema.Audit, ""),
    ("audit.canaries", schema.Canaries, ""),
    ("audit.exposure", schema.Exposure, ""),
    ("tuning", schema.Tuning, ""),
    ("tuning.ranges.KEY", schema.RandomRange, ""),
    ("diagnostics", schema.Diagnostics, "Measured on private data they are exact and not covered by ε: "
                                        "`data: private` needs `private_not_covered: true`."),
    ("continual", schema.Continual, ""),
    ("continual.switch", schema.SwitchRule, ""),
    ("continual.at_switch", schema.AtSwitch, ""),
]


def sections() -> list[tuple[str, type[BaseModel], str]]:
    """Every documented section; one per registered threshold policy (dpclip/engine/policies/)."""
    out = []
    for section in _SECTIONS:
        if section is POLICIES:
            out += [(f"clipping.threshold: {{kind: {spec.kind_name()}}}", spec, spec.recipe_note)
                    for spec in policy_specs()]
        else:
            out.append(section)
    return out


def render_markdown() -> str:
    """The page: the intro, then one section per schema section, the variants of a section
    chosen by ``kind`` or ``source`` (titles ``parent: {tag: value}``) in one table."""
    lines = [INTRO]
    listed = sections()
    i = 0
    while i < len(listed):
        match = _VARIANT.match(listed[i][0])
        if match is None:
            lines += _section(*listed[i])
            i += 1
            continue
        parent, tag, variants = match["parent"], match["tag"], []
        while i < len(listed) and (m := _VARIANT.match(listed[i][0])) and (m["parent"], m["tag"]) == (parent, tag):
            variants.append((m["value"], listed[i][1], listed[i][2]))
            i += 1
        lines += _variants_section(parent, tag, variants)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
