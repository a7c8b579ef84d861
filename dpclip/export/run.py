""":func:`export_run`: which checkpoint, which folder, written atomically (docs/export.md)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpclip import layout
from dpclip.errors import DpclipError
from dpclip.export import card as cards
from dpclip.export import model as weights
from dpclip.export.paths import cut_in_text, local_name, local_paths, without_local_paths
from dpclip.files import made_private, narrow, owner_only, read_json, replace_dir_atomic, write_json_atomic, write_text_atomic
from dpclip.rundir.checkpoint import latest_checkpoint, missing_checkpoint_hint
from dpclip.rundir.run import RunDir
from dpclip.rundir.searchdir import is_search_dir

_STEP_DIR = re.compile(r"step_[0-9]{6,}")

LOAD_TRANSFORMERS = """\
from transformers import {auto}
model = {auto}.from_pretrained("OUT_DIR")
"""
LOAD_PEFT = """\
from peft import PeftModel
from transformers import {auto}
base = {auto}.from_pretrained("OUT_DIR/base")
model = PeftModel.from_pretrained(base, "OUT_DIR")
"""
LOAD_PLAIN = """\
from safetensors.torch import load_file
module = ...  # rebuild the architecture described in model_card.json
module.load_state_dict(load_file("OUT_DIR/model.safetensors"))
"""


@dataclass
class ExportResult:
    out_dir: Path
    checkpoint: str
    kind: str                 # "transformers", "peft" or "safetensors"
    files: list[str]
    privacy: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "checkpoint": self.checkpoint, "kind": self.kind,
                "files": self.files, "privacy": self.privacy}


EXPORT_RECIPE_HEADER = """\
# The recipe of the run this model was exported from, for reading (docs/export.md):
# what was trained, on which data, with which privacy settings. Its `seed` and `audit`
# settings are left out: the model does not need them, and they are the audit's secrets.
# Paths on the exporting machine keep their last part only: (local path)/NAME.
"""

# Left out of every export's recipe, audited or not (so that their absence says nothing).
SECRET_RECIPE_KEYS = ("audit", "seed")


def export_recipe(recipe) -> dict[str, Any]:
    """The run's recipe as an export releases it: all of it but ``audit`` and ``seed``.

    Why an export carries a recipe at all: its users need the model section to rebuild a
    plain (mlp, cnn, custom) module, the data section for the tokenizer, input shape and
    labels, and the training, privacy and clipping sections to read what the privacy
    statement is about. They need nothing of the audit: ``audit.canaries`` (count, kind,
    seed, domain) lets whoever holds it rebuild the canaries and, through their seed, the
    inclusion bits, the audit's answer key (docs/accounting.md, "Threat model"). Without
    ``audit.canaries.seed`` the canaries come from OS entropy (runs before 2026-11-26 derived
    them from the recipe's ``seed``: :func:`dpclip.data.canaries.canary_seed`), and ``seed``
    goes too; the exported weights do not need it (it governs the initial weights and
    dropout; the split's key is OS entropy). Dropping it hides little: a LoRA export's
    ``base/`` (a seeded initial head) gives it back to whoever tries seeds (docs/export.md).
    Both are dropped from every export, audited or not, so that their absence does not tell
    which runs were audited. The run directory keeps the full recipe.
    """
    released = recipe.model_dump(mode="json")
    for key in SECRET_RECIPE_KEYS:
        released.pop(key, None)
    return without_local_paths(released)


def export_recipe_yaml(recipe) -> str:
    return EXPORT_RECIPE_HEADER + yaml.safe_dump(export_recipe(recipe), sort_keys=False)


def _checkpoint(run: RunDir, name: str | None) -> Path:
    if name is None:
        path = latest_checkpoint(run.path)
        if path is None:
            raise DpclipError(f"{run.path} has no checkpoint to export", missing_checkpoint_hint(run.path))
        return path
    available = sorted(p.name for p in run.checkpoints.glob("step_*") if p.is_dir()) if run.checkpoints.is_dir() else []
    path = run.checkpoints / name
    if not _STEP_DIR.fullmatch(name) or not (path / layout.MODEL_WEIGHTS).is_file():
        raise DpclipError(f"{run.path} has no checkpoint {name!r}",
                          "available: " + (", ".join(available) if available else "none"))
    return path


def _check_out_dir(out_dir: Path, run_dir: Path, force: bool) -> Path:
    """``out_dir`` as an absolute path (``.`` and ``..`` spelled out, so it has a name), refused
    when it overlaps the run directory, symlinks followed: ``--force`` replaces OUT_DIR as a whole,
    so OUT_DIR the run, inside it or above it would delete the run (its ledger, meta.json and
    checkpoints) or its siblings."""
    out, run = out_dir.resolve(), run_dir.resolve()
    if out == run or run in out.parents or out in run.parents:
        where = "is" if out == run else "is inside" if run in out.parents else "contains"
        raise DpclipError(f"OUT_DIR {out_dir} {where} the run directory {run_dir}",
                          "choose an OUT_DIR outside the run directory and not above it, e.g. exported/NAME: "
                          "the export is written as a new folder (--force replaces all of it)")
    here = Path.cwd().resolve()
    if out == here or out in here.parents:
        raise DpclipError(f"OUT_DIR {out_dir} is {'the' if out == here else 'above the'} current directory",
                          "name a folder to create, e.g. exported/NAME: the export is renamed into place, which "
                          "would replace the folder your shell is in")
    if out.exists() and not out.is_dir():
        raise DpclipError(f"{out_dir} exists and is not a folder", "choose another OUT_DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DpclipError(f"{out_dir} exists and is not empty", "choose another OUT_DIR, or pass --force to replace it")
    return Path(os.path.abspath(out_dir))


def _model_info(checkpoint: Path, recipe) -> dict[str, Any]:
    path = checkpoint / layout.MODEL_INFO
    if path.is_file():
        try:
            info = read_json(path)
        except ValueError as exc:   # not JSON, not UTF-8
            raise weights.damaged(checkpoint, layout.MODEL_INFO, exc) from None
        if not weights.sound_model_info(info):
            raise weights.damaged(checkpoint, layout.MODEL_INFO, ValueError("not a model description"))
        return info
    if recipe.model.kind == "hf":
        raise DpclipError(f"{checkpoint} has no model.json (written by dpclip before export existed)",
                          "resume the run (dpclip train --resume RUN_DIR) to write a new checkpoint, then export it")
    return {"kind": recipe.model.kind, "model": recipe.model.model_dump(mode="json")}


def _not_a_run_hint(run: RunDir) -> str:
    """Where to point instead: a search directory's selected run (its ε is the search's), else a run folder."""
    if is_search_dir(run.path):
        selected = run.summary().get("selected_run_dir")
        if selected:
            return (f"{run.path} is a search directory (dpclip tune-cost --run): export the run it selected, "
                    f"{run.path / selected} (its card states the search's ε)")
        return f"{run.path} is a search directory whose search selected no run: there is no model to export"
    return "pass the folder that `dpclip train` created under runs/"


def export_run(run_dir: str | Path, out_dir: str | Path, *, checkpoint: str | None = None,
               force: bool = False) -> ExportResult:
    """Write checkpoint ``checkpoint`` (default: the latest) of ``run_dir`` to ``out_dir``
    with its model card; ``out_dir`` must be absent or empty unless ``force``."""
    run = RunDir(run_dir)
    if not run.recipe_file.is_file():
        raise DpclipError(f"{run.path} is not a run directory (no recipe.yaml)", _not_a_run_hint(run))
    out_dir = Path(out_dir)
    target = _check_out_dir(out_dir, run.path, force)
    recipe = run.recipe()
    path = _checkpoint(run, checkpoint)
    statement, search = cards.released_statement(run.path)
    info = _model_info(path, recipe)
    steps_planned, stopped = cards.run_progress(run.path, recipe, statement.steps)
    card = cards.privacy_card(statement, recipe_name=recipe.name, checkpoint=path.name,
                              checkpoint_step=int(path.name.split("_")[1]), steps_planned=steps_planned,
                              stopped=stopped, search=search,
                              label_names=None if getattr(recipe.data, "labels", None) else info.get("label_names"))
    card = cut_in_text(card, local_paths(recipe.model_dump(mode="json")))   # the statement names data files

    made_private(target.parent)
    remove_dead_stagings(target)
    # this export's own (two exports to one OUT_DIR at once write apart; the last renamed in wins)
    staging = target.parent / f".{target.name}.export-staging-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir(mode=0o700)
    try:
        kind = _write_model(info, recipe, path, staging, card)
        write_json_atomic(staging / "privacy.json", card)
        write_text_atomic(staging / layout.RECIPE, export_recipe_yaml(recipe))
        files = sorted(str(p.relative_to(staging)) for p in owner_only(staging).rglob("*") if p.is_file())
        narrow([p for p in staging.rglob("*") if p.is_dir()])   # save_pretrained's base/: the umask's mode
        replace_dir_atomic(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(out_dir, path.name, kind, files, card)


def remove_dead_stagings(target: Path) -> None:
    """Remove the staging folders of exports to ``target`` whose process is gone (killed mid-way):
    each is named by its process id, so one of a live export is left alone."""
    for folder in target.parent.glob(f".{target.name}.export-staging-*-*"):
        pid = folder.name.rsplit("-", 2)[-2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (PermissionError, OverflowError):   # alive under another user, or no pid at all: not ours
            continue


def _write_model(info: dict[str, Any], recipe, checkpoint: Path, out: Path, card: dict[str, Any]) -> str:
    if "hf_config" not in info:
        tensors = weights.checkpoint_tensors(checkpoint)
        weights.check_plain(info, recipe, tensors, checkpoint)
        weights.write_plain(tensors, out)
        write_json_atomic(out / "model_card.json", weights.plain_model_card(info, recipe, card))
        write_text_atomic(out / "README.md", cards.readme(card, kind="safetensors", how_to_load=LOAD_PLAIN))
        return "safetensors"
    model = weights.rebuild_hf(info, recipe, checkpoint)
    auto = "AutoModelForCausalLM" if info["task"] == "causal-lm" else "AutoModelForSequenceClassification"
    tokenizer = weights.write_tokenizer(recipe.data.tokenizer, getattr(recipe.data, "max_length", None), out)
    token_note = "" if tokenizer == "transformers" else \
        f"# tokenizer: dpclip's byte tokenizer, described in {weights.BYTE_TOKENIZER_FILE}\n"
    if info.get("peft_config") is not None:
        weights.write_peft(model, weights.public_lora_base(info, recipe, checkpoint), out)
        base = local_name(recipe.model.pretrained)
        note = ("`base/` holds the public model the adapter was trained on, as it was before training"
                + (f" (the weights of `{base}`" if base else " (randomly initialised from the recipe's "
                   "model.config and seed") + ", with the classification head's initial weights, if any): it "
                "carries no information about the private data. Everything trained under DP, the adapters "
                "and the trained head (peft's modules_to_save), is in the adapter files.")
        write_text_atomic(out / "README.md", cards.readme(card, kind="peft", base_note=note,
                                                          how_to_load=LOAD_PEFT.format(auto=auto) + token_note))
        return "peft"
    weights.write_transformers(model, out)
    write_text_atomic(out / "README.md", cards.readme(card, kind="transformers",
                                                      how_to_load=LOAD_TRANSFORMERS.format(auto=auto) + token_note))
    return "transformers"
