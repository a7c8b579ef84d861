"""Generate the field reference of docs/recipes.md from the schema itself.

Run ``python -m dpclip.recipe.docs > docs/recipes.md`` after changing the schema; a
test fails when the file and the schema disagree.
"""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from dpclip.engine.policies import policy_specs
from dpclip.recipe import schema

INTRO = """\
# Recipe reference

A recipe is one YAML file that says what to train, on what, and with which privacy.
Every field, its type, its default and its meaning are listed below. This page is
generated from the schema (`python -m dpclip.recipe.docs > docs/recipes.md`); a test
fails when the two disagree.

- Unknown keys are errors, and an error names the dotted path of the field and the
  allowed values, e.g. `clipping.threshold.kind: 'dcsgd_x' is not one of fixed,
  quantile, dcsgd-p, dcsgd-e, discriminative`.
- Variants are chosen by `kind` (model, optimizer, schedule, threshold) or by `source`
  (data); each variant has its own fields.
- Any field can be overridden on the command line with `key=value`, parsed as YAML and
  validated through the same schema: `dpclip validate recipes/quickstart.yaml
  training.optimizer.lr=0.05 clipping.grouping='{uniform: 4}'`.
- `dpclip validate FILE --show` prints the resolved recipe with every default filled in.

Paths: a relative path written in a recipe file (`data.train`, `data.test`, a local
`tokenizer`, `model.pretrained`, a local `data.name` folder of `source: hf`) is relative
to the recipe file's directory, not to where the command runs; a path given as a
`key=value` override is relative to the current directory. A custom model's module is
looked for in `model.module_dir`, the recipe file's directory unless given, so
`target: 'mymodel:build'` finds `mymodel.py` beside the recipe. The run directory's
`recipe.yaml` holds the resolved, absolute paths, so `--resume`, `account` and
`audit-mia` work from any directory. (`output_dir` stays relative to the current
directory.)

Public data and continual pre-training (`public:`, `continual:`, `data.public_fraction`;
shipped as `recipes/continual-cnn-digits.yaml` and `recipes/continual-gpt2-text.yaml`):
docs/continual.md.

Rules that need the data (checked by `dpclip account RECIPE` and by training): the
Poisson rate is q = batch_size / N with N the training examples after the split, so
batch_size must not exceed N; `privacy.delta` must be below 1/N.
"""


def _type_name(annotation: typing.Any) -> str:
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


def _section(title: str, model: type[BaseModel], note: str = "") -> list[str]:
    lines = [f"### `{title}`", ""]
    doc = (model.__doc__ or "").strip()
    if doc and not doc.startswith("Base of"):
        lines += [" ".join(doc.split("\n\n")[0].split()), ""]  # the first paragraph
    if note:
        lines += [note, ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        constraint = _constraints(field)
        if constraint:
            description = f"{description} ({constraint})" if description else constraint
        lines.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {description} |")
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
    ("model.lora (kind: hf)", schema.LoRA, "LoRA adapters through peft: docs/export.md"),
    ("model: {kind: custom}", schema.CustomModel, ""),
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
    lines = [INTRO, "## Fields", ""]
    for title, model, note in sections():
        lines += _section(title, model, note)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
