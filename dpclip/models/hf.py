"""transformers models (``model.kind: hf``): random init from a config, or a local checkpoint.

- ``config: {model_type: gpt2, n_layer: 2, ...}`` builds ``AutoConfig.for_model`` with
  random weights. Token ids come from the data's tokenizer: ``vocab_size``,
  ``pad_token_id``, ``bos_token_id`` and ``eos_token_id`` are filled in unless the
  config sets them.
- ``pretrained: DIR`` loads a local directory with ``local_files_only=True``.
- ``lora: {r, alpha, dropout, target_modules}`` wraps the model with peft's LoRA adapters
  (docs/export.md, "LoRA"): the base weights are frozen, so the engine clips and noises
  only the adapters (and a sequence classifier's head, peft's ``modules_to_save``).

A sequence classifier's ``id2label`` / ``label2id`` hold the data's label names when it
has them, so an exported model names its classes.

Remote code is never trusted (no ``trust_remote_code``): a recipe must not be able to run
arbitrary code from the hub.
"""

from __future__ import annotations

from dpclip.errors import DpclipError


def _require_text(config, data) -> None:
    if not data.is_text:
        raise DpclipError("model.kind 'hf' needs text data (input_ids), but the data is a table or images",
                          "set data.text_field (or use builtin synthetic-text / format: text), "
                          "or use model.kind: mlp / cnn")
    if config.task == "causal-lm" and data.task != "causal-lm":
        raise DpclipError(f"model.task 'causal-lm' needs unlabelled text, but the data is {data.task}",
                          "use model.task: sequence-classification, or remove data.label_field")
    if config.task == "sequence-classification" and data.task == "causal-lm":
        raise DpclipError("model.task 'sequence-classification' needs labels, but the data is unlabelled text",
                          "set data.label_field, or use model.task: causal-lm")


def _auto_class(task: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # lazy: slow import

    return AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification


def _num_labels(data) -> int:
    # One output means regression for transformers' sequence classifiers.
    return data.num_classes if data.task == "classification" else 1


def _from_config(config, data):
    from transformers import AutoConfig  # lazy: transformers takes seconds to import

    settings = dict(config.config)
    model_type = settings.pop("model_type", None)
    if model_type is None:
        raise DpclipError("model.config has no 'model_type'",
                          "add model_type (e.g. gpt2, bert, llama) and the sizes, "
                          "e.g. {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 2}")
    if "trust_remote_code" in settings:
        raise DpclipError("model.config may not set trust_remote_code", "only built-in transformers models are allowed")
    tokenizer = data.tokenizer
    token_ids = {"vocab_size": data.vocab_size, "pad_token_id": data.pad_token_id,
                 "bos_token_id": getattr(tokenizer, "bos_token_id", None),
                 "eos_token_id": getattr(tokenizer, "eos_token_id", None)}
    for key, value in token_ids.items():
        if value is not None:
            settings.setdefault(key, value)
    if config.task == "sequence-classification":
        settings.setdefault("num_labels", _num_labels(data))
    try:
        hf_config = AutoConfig.for_model(model_type, **settings)
    except (ValueError, KeyError) as exc:
        raise DpclipError(f"transformers cannot build a {model_type!r} config: {exc}",
                          "check model.config.model_type (gpt2, bert, llama, ...) and its keys") from None
    return _auto_class(config.task).from_config(hf_config)


def _from_pretrained(config, data):
    kwargs = {"local_files_only": True}
    if config.task == "sequence-classification":
        # A new classification head (or one with another label count) is initialised fresh.
        kwargs.update(num_labels=_num_labels(data), ignore_mismatched_sizes=True)
    try:
        model = _auto_class(config.task).from_pretrained(config.pretrained, **kwargs)
    except (OSError, ValueError) as exc:
        raise DpclipError(f"cannot load a {config.task} model from {config.pretrained!r}: {exc}",
                          "model.pretrained must be a local directory written by save_pretrained "
                          "(nothing is downloaded)") from None
    if model.config.pad_token_id is None and data.pad_token_id is not None:
        # Sequence classifiers such as GPT-2's find each example's last token by its padding.
        model.config.pad_token_id = data.pad_token_id
    return model


def _check_fits_data(model, data) -> None:
    vocab_size = model.get_input_embeddings().num_embeddings
    if data.vocab_size is not None and data.vocab_size > vocab_size:
        raise DpclipError(f"the tokenizer has {data.vocab_size} tokens but the model embeds only {vocab_size}",
                          "use the model's own tokenizer (data.tokenizer: the model directory), "
                          "or raise vocab_size in model.config")
    max_positions = getattr(model.config, "max_position_embeddings", None)
    length = data.input_shape[0]
    if max_positions is not None and max_positions < length:
        raise DpclipError(f"the model handles {max_positions} positions but examples have {length} tokens",
                          "lower data.max_length or raise the model's positions (n_positions / "
                          "max_position_embeddings)")


def _name_labels(model, data) -> None:
    if data.task == "classification" and data.label_names:
        model.config.id2label = dict(enumerate(data.label_names))
        model.config.label2id = {name: i for i, name in enumerate(data.label_names)}


def lora_config(lora, task: str, model_type: str):
    """peft's ``LoraConfig`` for a recipe's ``model.lora`` block."""
    import peft  # lazy: peft imports transformers

    targets = lora.target_modules
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        targets = defaults.get(model_type)
        if targets is None:
            raise DpclipError(f"peft has no default LoRA target modules for model type {model_type!r}",
                              "set model.lora.target_modules to the names of the linear layers to adapt, "
                              "e.g. [q_proj, v_proj]")
    kwargs = {}
    if task == "sequence-classification":
        # SEQ_CLS makes peft train the (new) classification head as modules_to_save.
        kwargs["task_type"] = "SEQ_CLS" if lora.train_head else None
    else:
        kwargs["task_type"] = "CAUSAL_LM"
    return peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(targets), **kwargs)


def add_lora(model, lora, task: str):
    """``model`` wrapped in peft LoRA adapters; only the adapters (and the head) train."""
    import warnings

    import peft

    settings = lora_config(lora, task, model.config.model_type)
    try:
        with warnings.catch_warnings():
            # GPT-2's Conv1D layers: peft switches fan_in_fan_out on itself and says so.
            warnings.filterwarnings("ignore", message="fan_in_fan_out", category=UserWarning)
            return peft.get_peft_model(model, settings)
    except ValueError as exc:
        raise DpclipError(f"peft cannot add LoRA adapters: {exc}",
                          "model.lora.target_modules must name linear layers of the model "
                          "(print the model to see their names)") from None


def build_hf(config, data):
    """A transformers model for ``config.task`` sized to the data's tokenizer and labels."""
    _require_text(config, data)
    model = _from_config(config, data) if config.pretrained is None else _from_pretrained(config, data)
    _check_fits_data(model, data)
    _name_labels(model, data)
    if config.gradient_checkpointing:
        checkpoint_layers(model)
    if config.lora is not None:
        model = add_lora(model, config.lora, config.task)
    return model


def checkpoint_layers(model) -> None:
    """Activation checkpointing on every layer of a transformers model, non-reentrant (the
    engine follows the recomputation in either setting; non-reentrant finalizes groups early:
    docs/supported-models.md, "Gradient checkpointing")."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise DpclipError(f"{type(model).__name__} does not support gradient checkpointing in transformers",
                          "set model.gradient_checkpointing: false")
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:   # transformers before 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
