"""Modules the engine refuses by type or layout, before anything runs (docs/supported-models.md,
"What is refused, and why"): each error names the module's path and class, with a hint."""

from __future__ import annotations

from torch import nn

from dpclip.errors import EngineError
from dpclip.torch_compat import BatchNormBase, InstanceNormBase

_BATCHNORM_HINT = "replace it with GroupNorm (e.g. nn.GroupNorm(8, C)) or LayerNorm"


def refuse_unsupported(module: nn.Module, name: str, trainable: dict[int, int]) -> None:
    """Raise :class:`EngineError` for ``module`` (at path ``name``) if no rule can make it
    exact; ``trainable``: the ids of the trainable parameters."""
    if isinstance(module, BatchNormBase):
        raise EngineError(
            f"module {name or '<root>'} ({type(module).__name__}) normalises with "
            "batch statistics, which mixes samples: per-sample gradients and the "
            "privacy guarantee would not hold", _BATCHNORM_HINT)
    if (isinstance(module, InstanceNormBase)
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
