"""Checkpoints without pickle: safetensors for tensors, JSON for everything else.

A checkpoint folder ``checkpoints/step_000500/`` holds

- ``model.safetensors``: the weights. Tied weights (GPT-2's ``lm_head.weight`` is
  ``transformer.wte.weight``) are stored once, under the first name of the model's
  ``state_dict`` (the name transformers saves), and the file's metadata ``dpclip_tied``
  maps every other name to it, so loading restores them all;
- ``model.json``: what an export needs to rebuild the model without the data
  (:func:`dpclip.models.build.model_info`: sizes, label names, the transformers config,
  the peft adapter config) and the tied names (docs/export.md);
- ``state.json`` + ``state.safetensors``: optimizer, scheduler, sampler, engine (noise
  generator, threshold policy), torch's global RNG and the ledger, as a JSON tree whose
  tensors are replaced by ``{"__tensor__": key}`` references into the safetensors file.

It is written to a hidden staging folder and renamed into place, then ``LATEST`` is
replaced atomically, so a crash at any moment leaves the previous checkpoint usable.
Loading never unpickles: a checkpoint from an untrusted source cannot run code.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file

from dpclip import layout
from dpclip.accounting.ledger import Ledger
from dpclip.errors import DpclipError
from dpclip.models.build import model_info
from dpclip.interrupt import shielded
from dpclip.files import (owner_only, private_dir, read_json, replace_dir_atomic, sync, write_json_atomic,
                          write_text_atomic)

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_INT_KEYS = "__int_keys__"
_STEP_DIR = re.compile(r"step_[0-9]{6,}")
_TIED = "dpclip_tied"


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, tied): the state dict with each shared tensor once, under its first name,
    and ``{other name: first name}`` for the names left out."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in first:
            tied[name] = first[id(value)]
            continue
        first[id(value)] = name
        tensors[name] = value.detach().cpu().contiguous()
    return tensors, tied


def save_model_weights(model: torch.nn.Module, path: Path) -> dict[str, str]:
    """``model.safetensors`` at ``path`` (tied weights once, see module doc); returns the tied names."""
    tensors, tied = model_tensors(model)
    save_file(tensors, str(path), metadata={"format": "pt", _TIED: json.dumps(tied)})
    owner_only(path)
    return tied


def load_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every name of the model's state dict, tied names included, from ``model.safetensors``."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    tensors = load_file(str(path))
    tied = json.loads(metadata.get(_TIED, "{}"))
    if not isinstance(tied, dict) or not all(isinstance(name, str) and name in tensors for name in tied.values()):
        raise ValueError(f"its {_TIED} metadata is not a map of names to its own tensors' names")
    for alias, name in tied.items():
        tensors[alias] = tensors[name]
    return tensors


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)   # e.g. a torch.dtype or an enum in a transformers / peft config


def flatten_state(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state (dicts, lists, tensors, numbers) into JSON and named tensors."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            key = path or "root"
            tensors[key] = node.detach().cpu().contiguous()
            return {_TENSOR: key}
        if isinstance(node, dict):
            int_keys = all(isinstance(k, int) for k in node) and bool(node)
            if not int_keys and not all(isinstance(k, str) for k in node):
                raise TypeError(f"state keys at {path!r} must be all str or all int")
            out = {str(k): walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
            return {_INT_KEYS: out} if int_keys else out
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot store {type(node).__name__} at {path!r} in a checkpoint")

    return walk(tree, ""), tensors


def unflatten_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        if set(tree) == {_TUPLE}:
            return tuple(unflatten_state(v, tensors) for v in tree[_TUPLE])
        if set(tree) == {_INT_KEYS}:
            return {int(k): unflatten_state(v, tensors) for k, v in tree[_INT_KEYS].items()}
        return {k: unflatten_state(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten_state(v, tensors) for v in tree]
    return tree


step_dir_name = layout.step_dir_name  # checkpoints/step_000500


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint ``step`` atomically, point LATEST at it, keep the newest ``keep``.

    Signals wait until it is written (:func:`~dpclip.interrupt.shielded`); a staging folder
    that an earlier process left behind (killed mid-write) is removed."""
    with shielded():
        return _save_checkpoint(run_dir, step, model, state, keep)


def _save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict[str, Any], keep: int) -> Path:
    root = layout.checkpoints_dir(run_dir)
    private_dir(root)
    final = root / step_dir_name(step)
    staging = root / f".{final.name}.staging"
    for stale in root.glob(".step_*.staging"):
        shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(mode=0o700)   # nothing in it readable by others while it is written
    tied = save_model_weights(model, staging / layout.MODEL_WEIGHTS)
    write_json_atomic(staging / layout.MODEL_INFO, _jsonable({**model_info(model), "tied": tied}))
    tree, tensors = flatten_state(state)
    save_file(tensors, str(staging / layout.STATE_TENSORS))
    owner_only(staging / layout.STATE_TENSORS)   # the generators' states: secret
    write_json_atomic(staging / layout.STATE, tree)
    for written in (layout.MODEL_WEIGHTS, layout.STATE_TENSORS):   # (safetensors does not sync): on disk before
        sync(staging / written)                                    # LATEST can name the folder after a power loss
    sync(staging)
    replace_dir_atomic(staging, final)
    write_text_atomic(root / layout.LATEST, final.name + "\n")   # (durable: syncs root, with the rename above)
    # By step number: past step 999,999 the names grow a digit and sort before the older ones.
    kept = sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)),
                  key=lambda p: int(p.name[5:]))
    for old in kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def missing_checkpoint_hint(run_dir: Path) -> str:
    """The hint for a run directory without a checkpoint: not yet trained, or its checkpoints
    removed after training (its ledger.json or summary.json says it trained)."""
    run_dir = Path(run_dir)
    if _released_nothing(run_dir):
        return (f"the run stopped before its first checkpoint and released nothing (its ledger holds no step): "
                f"delete {run_dir} and train again")
    if (run_dir / layout.LEDGER).exists() or (run_dir / layout.SUMMARY).exists():
        return (f"the run trained, but {layout.checkpoints_dir(run_dir)} holds no complete checkpoint: "
                "restore that folder from a backup")
    return "train the run first (dpclip train RECIPE)"


def _released_nothing(run_dir: Path) -> bool:
    """A ledger.json that reads as no step and no summary.json: killed before step 0's checkpoint.
    An unreadable ledger counts as a run that trained (its hint asks for the backup)."""
    if (run_dir / layout.SUMMARY).exists() or not (run_dir / layout.LEDGER).exists():
        return False
    try:
        return Ledger.from_dict(read_json(run_dir / layout.LEDGER)).steps == 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


def checkpointed_steps(run_dir: Path) -> int:
    """The highest step of a checkpoint folder of the run (``step_NNNNNN`` with weights; 0: none)."""
    folder = layout.checkpoints_dir(run_dir)
    steps = [int(p.name[5:]) for p in folder.glob("step_*") if _STEP_DIR.fullmatch(p.name)
             and (p / layout.MODEL_WEIGHTS).is_file()] if folder.is_dir() else []
    return max(steps, default=0)


def newer_checkpoints(checkpoint: Path) -> list[Path]:
    """Complete checkpoint folders of the same run after ``checkpoint`` (a crash between writing
    one and pointing LATEST at it, or LATEST edited by hand)."""
    step = int(checkpoint.name[5:])
    return sorted((p for p in checkpoint.parent.iterdir() if _STEP_DIR.fullmatch(p.name) and int(p.name[5:]) > step
                   and all((p / f).is_file() for f in layout.CHECKPOINT_FILES)), key=lambda p: int(p.name[5:]))


def finish_interrupted_save(run_dir: Path) -> Path | None:
    """The checkpoint a save killed between renaming its folder into place and replacing LATEST
    left (LATEST names the one before it, or, the run's first, nothing), with LATEST now naming it
    as the save would have; None when there is none. More than one complete checkpoint newer than
    LATEST is no such crash: left to the resume to refuse."""
    root = layout.checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    if (root / layout.LATEST).exists():
        latest = latest_checkpoint(run_dir)
        newer = [] if latest is None else newer_checkpoints(latest)
    else:
        newer = [p for p in root.iterdir() if p.name == step_dir_name(0)
                 and all((p / f).is_file() for f in layout.CHECKPOINT_FILES)]
    if len(newer) != 1:
        return None
    write_text_atomic(root / layout.LATEST, newer[0].name + "\n")
    return newer[0]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint folder LATEST names, or None before the first checkpoint.

    LATEST is read as untrusted input: it must name a ``step_NNNNNN`` folder of this run's
    ``checkpoints/`` (no path, no ``..``), and that folder must be complete."""
    pointer = layout.checkpoints_dir(run_dir) / layout.LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text(encoding="utf-8", errors="replace").strip()
    if not _STEP_DIR.fullmatch(name):
        raise DpclipError(f"{pointer} names {name[:80]!r}, which is not a checkpoint of this run",
                          "LATEST must hold a folder name like step_000500 inside checkpoints/; the run "
                          "directory was modified: restore it or start a new run")
    path = pointer.parent / name
    if not all((path / f).is_file() for f in layout.CHECKPOINT_FILES):
        previous = path.with_name(f".{name}.old")   # a crash while the checkpoint was rewritten
        if all((previous / f).is_file() for f in layout.CHECKPOINT_FILES):
            raise DpclipError(f"{pointer} points to {path.name}, which is missing: the run stopped while it was "
                              f"rewritten", f"its complete previous copy is {previous.name}: rename it back "
                              f"(mv {previous} {path}), then resume")
        raise DpclipError(f"{pointer} points to {path.name}, which is missing or incomplete",
                          "the run directory was modified by hand; restore the checkpoint from a backup of the "
                          "run (starting a new run spends ε on the same data again)")
    return path


def load_checkpoint(path: Path, model: torch.nn.Module,
                    check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Load weights into ``model`` (in place) and return the state tree; ``check(state)`` runs
    on the state tree before any weight is loaded (a resume's refusals)."""
    try:
        tensors = load_file(str(path / layout.STATE_TENSORS))
        state = unflatten_state(read_json(path / layout.STATE), tensors)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        raise _damaged(path, exc) from None
    if not isinstance(state, dict) or state.get("step") != int(path.name.split("_")[1]):
        raise DpclipError(f"checkpoint {path} does not hold step {path.name.split('_')[1].lstrip('0') or 0}",
                          "the run directory was modified: restore it or start a new run")
    if check is not None:
        check(state)
    try:
        load_weights(path, model)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        raise _damaged(path, exc) from None
    return state


def _damaged(path: Path, exc: BaseException) -> DpclipError:
    return DpclipError(f"checkpoint {path} is damaged or incomplete ({type(exc).__name__})",
                       "it was cut short (a full disk, an interrupted copy): restore the run directory from a "
                       f"backup, or, if {path.name}'s weights were never used or shared, delete it and write the "
                       f"previous checkpoint's folder name into {layout.CHECKPOINTS}/{layout.LATEST} (the steps "
                       "after it are redone with the noise they were drawn with)")


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """The weights of checkpoint folder ``path`` into ``model`` (in place, strict)."""
    weights = path / layout.MODEL_WEIGHTS
    try:
        with safe_open(str(weights), framework="pt") as f:
            written_by_dpclip = _TIED in (f.metadata() or {})
        if written_by_dpclip:
            model.load_state_dict(load_model_tensors(weights), strict=True)
        else:   # checkpoints written by safetensors' save_model (dpclip before 0.x, CHANGELOG)
            load_model(model, str(weights), strict=True)
    except RuntimeError as exc:
        raise DpclipError(f"checkpoint {path} does not match the model: {str(exc).splitlines()[0]}",
                          "was the recipe's model changed?") from None
