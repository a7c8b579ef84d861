"""Checkpoints without pickle: safetensors for tensors, JSON for everything else.

A checkpoint folder ``checkpoints/step_000500/`` holds

- ``model.safetensors``: the weights (tied weights are stored once);
- ``state.json`` + ``state.safetensors``: optimizer, scheduler, sampler, engine (noise
  generator, threshold policy), torch's global RNG and the ledger, as a JSON tree whose
  tensors are replaced by ``{"__tensor__": key}`` references into the safetensors file.

It is written to a hidden staging folder and renamed into place, then ``LATEST`` is
replaced atomically, so a crash at any moment leaves the previous checkpoint usable.
Loading never unpickles: a checkpoint from an untrusted source cannot run code.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from dpclip.errors import DpclipError
from dpclip.files import read_json, replace_dir_atomic, write_json_atomic, write_text_atomic

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_INT_KEYS = "__int_keys__"
_STEP_DIR = re.compile(r"step_[0-9]{6,}")


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


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint ``step`` atomically, point LATEST at it, keep the newest ``keep``."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    staging = root / f".{final.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    save_model(model, str(staging / "model.safetensors"))
    tree, tensors = flatten_state(state)
    save_file(tensors, str(staging / "state.safetensors"))
    write_json_atomic(staging / "state.json", tree)
    replace_dir_atomic(staging, final)
    write_text_atomic(root / "LATEST", final.name + "\n")
    kept = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint folder LATEST names, or None before the first checkpoint.

    LATEST is read as untrusted input: it must name a ``step_NNNNNN`` folder of this run's
    ``checkpoints/`` (no path, no ``..``), and that folder must be complete."""
    pointer = Path(run_dir) / "checkpoints" / "LATEST"
    if not pointer.exists():
        return None
    name = pointer.read_text(encoding="utf-8", errors="replace").strip()
    if not _STEP_DIR.fullmatch(name):
        raise DpclipError(f"{pointer} names {name[:80]!r}, which is not a checkpoint of this run",
                          "LATEST must hold a folder name like step_000500 inside checkpoints/; the run "
                          "directory was modified: restore it or start a new run")
    path = pointer.parent / name
    if not all((path / f).is_file() for f in ("state.json", "state.safetensors", "model.safetensors")):
        raise DpclipError(f"{pointer} points to {path.name}, which is missing or incomplete",
                          "the run directory was modified by hand; restore the checkpoint or start a new run")
    return path


def load_checkpoint(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load weights into ``model`` (in place) and return the state tree."""
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if missing or unexpected:  # pragma: no cover - strict=True raises first
        raise DpclipError(f"checkpoint {path} does not match the model", "was the recipe's model changed?")
    tensors = load_file(str(path / "state.safetensors"))
    state = unflatten_state(read_json(path / "state.json"), tensors)
    if not isinstance(state, dict) or state.get("step") != int(path.name.split("_")[1]):
        raise DpclipError(f"checkpoint {path} does not hold step {path.name.split('_')[1].lstrip('0') or 0}",
                          "the run directory was modified: restore it or start a new run")
    return state
