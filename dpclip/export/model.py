"""The weights of an export, in the format their ecosystem loads (docs/export.md).

- transformers models: ``save_pretrained`` (``config.json``, ``model.safetensors`` with tied
  weights as transformers saves them) and the tokenizer;
- peft LoRA models: the adapter as peft saves it (``adapter_config.json``,
  ``adapter_model.safetensors``: every tensor trained under DP, the head included) and, in
  ``base/``, the public starting model, rebuilt from its public source (:func:`public_lora_base`);
- anything else (mlp, cnn, custom): ``model.safetensors`` with every state-dict name and
  ``model_card.json`` describing how to rebuild the module.

The model is rebuilt from the checkpoint's ``model.json`` (written by
dpclip/rundir/checkpoint.py), never from the data: exporting reads no private example.
A damaged checkpoint file, or weights that do not fit the rebuilt model (their names and
shapes; for a custom model, whose factory an export does not import, not checked), are
refused before anything is written (:func:`damaged`, :func:`check_plain`), and so are LoRA
settings of the recipe other than those the checkpoint was trained with (:func:`rebuild_hf`).
A LoRA base is rebuilt from the recipe's public source and seed, and written only when it
equals the checkpoint's frozen tensors bit for bit.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from dpclip import layout
from dpclip.data.tokenizers import ByteTokenizer, load_tokenizer
from dpclip.errors import DpclipError
from dpclip.export.load import build_described
from dpclip.export.paths import local_name, model_without_local_paths
from dpclip.files import owner_only, write_json_atomic
from dpclip.models.build import seeded_init
from dpclip.models.hf import lora_config
from dpclip.rundir.checkpoint import load_model_tensors, load_weights

BYTE_TOKENIZER_FILE = "dpclip_tokenizer.json"

#: what reading a damaged (cut short, emptied, edited) safetensors or JSON file raises
DAMAGE = (SafetensorError, ValueError, KeyError, TypeError)


def damaged(checkpoint: Path, file: str, exc: BaseException) -> DpclipError:
    """The refusal of a checkpoint whose ``file`` cannot be read, with the run's other checkpoints."""
    others = sorted(p.name for p in checkpoint.parent.glob("step_*")
                    if p.is_dir() and p.name != checkpoint.name and (p / layout.MODEL_WEIGHTS).is_file())
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}" if str(exc) else type(exc).__name__
    hint = (f"export another checkpoint with --checkpoint {others[-1]} (available: {', '.join(others)}), or "
            if others else "") + "restore the run directory from a backup (it was cut short or modified)"
    return DpclipError(f"{checkpoint / file} is damaged or incomplete ({reason})", hint)


def sound_model_info(info: Any) -> bool:
    """Whether ``model.json`` holds what an export reads of it (a transformers model's config)."""
    if not isinstance(info, dict):
        return False
    config = info.get("hf_config")
    return config is None or (isinstance(config, dict) and isinstance(config.get("model_type"), str)
                              and isinstance(info.get("task"), str))


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's ``model.safetensors``; a damaged file refused (:func:`damaged`)."""
    try:
        return load_model_tensors(checkpoint / layout.MODEL_WEIGHTS)
    except DAMAGE as exc:
        raise damaged(checkpoint, layout.MODEL_WEIGHTS, exc) from None


def check_plain(info: dict[str, Any], recipe, tensors: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Refuse weights that do not load (strictly: names and shapes) into the mlp or cnn that
    ``model_card.json`` describes, as :func:`dpclip.export.load_exported` will rebuild it."""
    if recipe.model.kind not in ("mlp", "cnn") or info.get("input_shape") is None:
        return   # a custom factory is not imported here; a model.json-less checkpoint has no sizes
    try:
        module = build_described(recipe.model, info.get("task"), info["input_shape"], info.get("num_classes"))
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:   # sizes edited: not ints, negative, huge
        raise damaged(checkpoint, layout.MODEL_INFO, exc) from None
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:300]
        others = damaged(checkpoint, layout.MODEL_WEIGHTS, exc).hint
        raise DpclipError(f"{checkpoint / layout.MODEL_WEIGHTS} does not fit the {recipe.model.kind} its recipe and "
                          f"{layout.MODEL_INFO} describe ({detail})", others) from None


def _hf_config(info: dict[str, Any]):
    from transformers import AutoConfig

    settings = dict(info["hf_config"])
    model_type = settings.pop("model_type")
    return AutoConfig.for_model(model_type, **settings), model_type


def _auto_class(task: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification


def _add_lora(model, lora, task: str, model_type: str):
    import peft

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fan_in_fan_out", category=UserWarning)
        return peft.get_peft_model(model, lora_config(lora, task, model_type))


def rebuild_hf(info: dict[str, Any], recipe, checkpoint: Path):
    """The checkpoint's transformers (or peft) model, in eval mode, with its weights."""
    config, model_type = _hf_config(info)
    model = _auto_class(info["task"]).from_config(config)
    lora = getattr(recipe.model, "lora", None)
    if info.get("peft_config") is not None:
        if lora is None:
            raise DpclipError(f"{checkpoint} holds a LoRA model but the run's recipe has no model.lora",
                              "the run directory was modified: restore recipe.yaml")
        model = _add_lora(model, lora, info["task"], model_type)
        _refuse_edited_lora(model.peft_config["default"].to_dict(), info["peft_config"], checkpoint)
    try:
        load_weights(checkpoint, model)
    except DAMAGE as exc:
        raise damaged(checkpoint, layout.MODEL_WEIGHTS, exc) from None
    return model.eval()


#: the adapter settings that change what a LoRA model computes (its weights' names and shapes aside)
LORA_SETTINGS = ("r", "lora_alpha", "target_modules", "task_type", "modules_to_save", "use_rslora", "use_dora",
                 "bias", "fan_in_fan_out", "layers_to_transform", "rank_pattern", "alpha_pattern")


def _refuse_edited_lora(rebuilt: dict[str, Any], trained: dict[str, Any], checkpoint: Path) -> None:
    """Refuse adapter settings of the run's recipe that differ from those the checkpoint was trained
    with (``model.json``'s ``peft_config``): ``lora.alpha`` scales every adapter and still loads, a
    target added gets a fresh adapter; the export would describe a model that was not trained."""
    def plain(value: Any) -> Any:
        return sorted(value) if isinstance(value, (set, list, tuple)) else value
    edited = [key for key in LORA_SETTINGS if key in rebuilt and key in trained
              and plain(rebuilt[key]) != plain(trained[key])]
    if edited:
        key = edited[0]
        raise DpclipError(f"{checkpoint}: the run's recipe.yaml gives LoRA {key} = {plain(rebuilt[key])!r} but the "
                          f"checkpoint was trained with {plain(trained[key])!r} ({layout.MODEL_INFO})",
                          "the run directory was modified: restore its recipe.yaml (model.lora) as it was trained")


def public_lora_base(info: dict[str, Any], recipe, checkpoint: Path):
    """A LoRA run's base model as its public source gives it, before any training: built
    from the transformers config with the recipe seed's initial weights (the same
    :func:`dpclip.models.build.seeded_init` as training), or loaded from
    ``model.pretrained`` (a fresh head drawn from the seed, as in training).

    Every tensor of it is then checked bit for bit against the checkpoint's frozen tensors
    (those peft does not train), so the adapter applies to the base it was trained on;
    the tensors trained under DP (the adapters and peft's ``modules_to_save``, a
    classifier's head) stay with the adapter. When the two differ the export refuses:
    it cannot show that ``base/`` holds nothing trained on the private data."""
    config, model_type = _hf_config(info)
    auto = _auto_class(info["task"])
    source = recipe.model.pretrained
    if source is not None and not Path(source).is_dir():
        raise DpclipError(f"the LoRA run's base model {source!r} (model.pretrained) is not a directory here",
                          "export where the pretrained directory the run was trained from is available: base/ "
                          "is written from that public source, never from the checkpoint")
    with seeded_init(recipe.seed):
        if source is None:
            base = auto.from_config(config)
        else:
            base = auto.from_pretrained(source, config=config, local_files_only=True,
                                        ignore_mismatched_sizes=True)
    differing = _frozen_tensors_differing(base, recipe.model.lora, info["task"], model_type, checkpoint)
    if differing:
        origin = f"model.pretrained {source!r}" if source else "model.config and seed"
        raise DpclipError(
            f"{checkpoint}: {len(differing)} frozen base tensor(s) differ from the public model the recipe's "
            f"{origin} builds (e.g. {differing[0]!r}); base/ cannot be shown to carry no private information",
            "export with the recipe and pretrained directory the run was trained with (unchanged); "
            "a base that is not the public starting model is not exported")
    return base.eval()


def _frozen_tensors_differing(base, lora, task: str, model_type: str, checkpoint: Path) -> list[str]:
    """Names of the tensors that peft keeps frozen on ``base`` whose checkpoint value differs."""
    with torch.random.fork_rng(devices=[]):   # the adapters' own init draws from the global RNG
        wrapped = _add_lora(copy.deepcopy(base), lora, task, model_type)
    trained = {name for name, param in wrapped.named_parameters() if param.requires_grad}
    saved = checkpoint_tensors(checkpoint)
    return [name for name, tensor in wrapped.state_dict().items()
            if name not in trained and (name not in saved or not torch.equal(saved[name], tensor))]


def write_transformers(model, out: Path) -> None:
    model.save_pretrained(str(out))


def write_peft(model, public_base, out: Path) -> None:
    """The adapter in ``out`` (``PeftModel.from_pretrained(base, out)``): every tensor trained
    under DP, the adapters and peft's ``modules_to_save``; in ``out/base`` the public base
    (:func:`public_lora_base`), never the checkpoint's: peft's ``unload()`` would put the
    trained head there."""
    for settings in model.peft_config.values():   # peft records the base's folder: cut to its name
        settings.base_model_name_or_path = local_name(settings.base_model_name_or_path)
    model.save_pretrained(str(out))
    public_base.save_pretrained(str(out / "base"))


def write_tokenizer(spec: str, max_length: int | None, out: Path) -> str:
    """The data's tokenizer next to the weights; returns how it was written."""
    if spec == "byte":
        byte = ByteTokenizer()
        write_json_atomic(out / BYTE_TOKENIZER_FILE, {
            "kind": "byte", "vocab_size": byte.vocab_size, "pad_token_id": byte.pad_token_id,
            "bos_token_id": byte.bos_token_id, "eos_token_id": byte.eos_token_id, "max_length": max_length,
            "padding": "right", "truncation": "keep the beginning",
            "encoding": "bos, then the text's UTF-8 bytes as ids 0..255, then eos; padded with pad_token_id "
                        "to max_length; attention_mask 1 on real tokens",
        })
        return "byte"
    tokenizer = load_tokenizer(spec)   # the same settings as training: pad = eos if none, right padding
    tokenizer.hf_tokenizer.save_pretrained(str(out))
    return "transformers"


def write_plain(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """``model.safetensors`` with every name of the state dict (tied names as copies), so
    ``module.load_state_dict(safetensors.torch.load_file(path))`` restores it."""
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if id(tensor) in seen:
            tensors[name] = tensor.clone()
        seen.add(id(tensor))
    save_file(tensors, str(out / layout.MODEL_WEIGHTS), metadata={"format": "pt"})
    owner_only(out / layout.MODEL_WEIGHTS)


def plain_model_card(info: dict[str, Any], recipe, card: dict[str, Any]) -> dict[str, Any]:
    """``model_card.json`` of a non-transformers model: enough to rebuild it."""
    return {
        "format": "dpclip-model-card/1",
        "model": model_without_local_paths(recipe.model.model_dump(mode="json")),
        "task": info.get("task"),
        "input_shape": info.get("input_shape"),
        "num_classes": info.get("num_classes"),
        "label_names": info.get("label_names"),
        "weights": layout.MODEL_WEIGHTS,
        "rebuild": "build the module from 'model' (dpclip's recipe model section; sizes from input_shape and "
                   "num_classes), then module.load_state_dict(safetensors.torch.load_file('model.safetensors'))",
        "privacy": {k: card[k] for k in ("epsilon", "delta", "unit_of_privacy", "neighbouring", "accountant",
                                         "mechanism", "sampling_assumption", "steps", "noise_multiplier",
                                         "not_covered_by_epsilon")},
    }
