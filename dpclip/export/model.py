"""The weights of an export, in the format their ecosystem loads (docs/export.md).

- transformers models: ``save_pretrained`` (``config.json``, ``model.safetensors`` with tied
  weights as transformers saves them) and the tokenizer;
- peft LoRA models: the adapter as peft saves it (``adapter_config.json``,
  ``adapter_model.safetensors``) and, in ``base/``, the frozen base model it was trained on;
- anything else (mlp, cnn, custom): ``model.safetensors`` with every state-dict name and
  ``model_card.json`` describing how to rebuild the module.

The model is rebuilt from the checkpoint's ``model.json`` (written by
dpclip/train/checkpoint.py), never from the data: exporting reads no private example.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from dpclip.data.tokenizers import ByteTokenizer, load_tokenizer
from dpclip.errors import DpclipError
from dpclip.files import write_json_atomic
from dpclip.models.hf import lora_config
from dpclip.train.checkpoint import load_model_tensors, load_weights

BYTE_TOKENIZER_FILE = "dpclip_tokenizer.json"


def rebuild_hf(info: dict[str, Any], recipe, checkpoint: Path):
    """The checkpoint's transformers (or peft) model, in eval mode, with its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    settings = dict(info["hf_config"])
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    auto = AutoModelForCausalLM if info["task"] == "causal-lm" else AutoModelForSequenceClassification
    model = auto.from_config(config)
    lora = getattr(recipe.model, "lora", None)
    if info.get("peft_config") is not None:
        if lora is None:
            raise DpclipError(f"{checkpoint} holds a LoRA model but the run's recipe has no model.lora",
                              "the run directory was modified: restore recipe.yaml")
        import peft

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="fan_in_fan_out", category=UserWarning)
            model = peft.get_peft_model(model, lora_config(lora, info["task"], model_type))
    load_weights(checkpoint, model)
    return model.eval()


def write_transformers(model, out: Path) -> None:
    model.save_pretrained(str(out))


def write_peft(model, out: Path) -> None:
    """The adapter in ``out`` (``PeftModel.from_pretrained(base, out)``), the base in ``out/base``."""
    model.save_pretrained(str(out))
    base = model.unload()   # the frozen base, adapters removed (not merged)
    base.save_pretrained(str(out / "base"))


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


def write_plain(checkpoint: Path, out: Path) -> None:
    """``model.safetensors`` with every name of the state dict (tied names as copies), so
    ``module.load_state_dict(safetensors.torch.load_file(path))`` restores it."""
    tensors = load_model_tensors(checkpoint / "model.safetensors")
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if id(tensor) in seen:
            tensors[name] = tensor.clone()
        seen.add(id(tensor))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def plain_model_card(info: dict[str, Any], recipe, card: dict[str, Any]) -> dict[str, Any]:
    """``model_card.json`` of a non-transformers model: enough to rebuild it."""
    return {
        "format": "dpclip-model-card/1",
        "model": recipe.model.model_dump(mode="json"),
        "task": info.get("task"),
        "input_shape": info.get("input_shape"),
        "num_classes": info.get("num_classes"),
        "label_names": info.get("label_names"),
        "weights": "model.safetensors",
        "rebuild": "build the module from 'model' (dpclip's recipe model section; sizes from input_shape and "
                   "num_classes), then module.load_state_dict(safetensors.torch.load_file('model.safetensors'))",
        "privacy": {k: card[k] for k in ("epsilon", "delta", "unit_of_privacy", "accountant", "steps",
                                         "noise_multiplier", "not_covered_by_epsilon")},
    }
