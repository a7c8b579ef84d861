"""Modules the engine refuses by type or layout, before anything runs (docs/engine.md,
"What is refused, and why"): each error names the module's path and class, with a hint."""

from __future__ import annotations

from torch import nn

from dpclip.errors import EngineError

_BATCHNORM_HINT = "replace it with GroupNorm (e.g. nn.GroupNorm(8, C)) or LayerNorm"


def refuse_unsupported(module: nn.Module, name: str, trainable: dict[int, int]) -> None:
    """Raise :class:`EngineError` for ``module`` (at path ``name``) if no rule can make it
    exact; ``trainable``: the ids of the trainable parameters."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        raise EngineError(
            f"module {name or '<root>'} ({type(module).__name__}) normalises with "
            "batch statistics, which mixes samples: per-sample gradients and the "
            "privacy guarantee would not hold", _BATCHNORM_HINT)
    if (isinstance(module, nn.modules.instancenorm._InstanceNorm)
            and module.track_running_stats):
        raise EngineError(
            f"module {name} ({type(module).__name__}) tracks running statistics "
            "of the private data, released with the model", "set track_running_stats=False")
    if (isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and module.max_norm is not None):
        # Checked for frozen tables too: the renormalisation writes the weight anyway.
        raise EngineError(
            f"module {name or '<root>'} ({type(module).__name__}) has max_norm="
            f"{module.max_norm}: its forward renormalises the looked-up rows in place, "
            "so the weights reveal which tokens were in the private batch",
            "set max_norm=None (clip the gradient instead)")
    _refuse_shared_position_projection(module, name, trainable)


def _refuse_shared_position_projection(module: nn.Module, name: str,
                                       trainable: dict[int, int]) -> None:
    """Architectures whose forward mixes a computation shared by all samples into each
    sample in a way no hook can take apart, refused by name before anything runs."""
    if (type(module).__name__ == "DisentangledSelfAttention"      # DeBERTa, DeBERTa-v2, SEW-D
            and getattr(module, "relative_attention", False) and getattr(module, "pos_att_type", None)
            and any(id(p) in trainable for p in module.parameters())):
        raise EngineError(
            f"module {name} ({type(module).__name__}) projects the relative-position table, "
            "shared by all samples, with its own query/key projections and repeats the result "
            "over the batch: the samples' gradients of that use are summed before any hook sees "
            "them, so its per-sample gradients cannot be separated",
            "set pos_att_type=[] (or relative_attention=False) in the model's config, freeze "
            "its attention, or use an encoder without relative-position projections "
            "(BERT, RoBERTa, ELECTRA)")
