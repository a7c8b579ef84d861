"""Modules the engine refuses by type or layout, before anything runs (docs/supported-models.md,
"What is refused, and why"): each error names the module's path and class, with a hint."""

from __future__ import annotations

import functools

from torch import Tensor, nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from dpclip.engine.layers import find_layer_rule
from dpclip.errors import EngineError
from dpclip.torch_compat import BatchNormBase, InstanceNormBase, gradient_hooks

#: the hooks torch.nn.utils sets to recompute a weight before each forward (not a parametrization)
_WEIGHT_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)
_BATCHNORM_HINT = "replace it with GroupNorm (e.g. nn.GroupNorm(8, C)) or LayerNorm"


def refuse_unsupported(module: nn.Module, name: str, trainable: dict[int, int]) -> None:
    """Raise :class:`EngineError` for ``module`` (at path ``name``) if no rule can make it
    exact; ``trainable``: the ids of the trainable parameters."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        # Its reducer puts autograd's own gradients in p.grad (all-reduced over the ranks): seen at
        # the first backward as "received gradients outside the engine's hooks", whose hint misled.
        raise EngineError(
            f"module {name or '<root>'} is wrapped in DistributedDataParallel, whose reducer all-reduces autograd's "
            "raw gradients over the ranks: the engine clips each sample and sums the clipped gradients over the "
            "ranks itself, with the noise drawn once (docs/distributed.md)",
            "pass the unwrapped model (ddp.module): make_private under torchrun (or DPEngine with World's "
            "reducer) is data-parallel already, with no wrapper (docs/python-api.md, 'Several processes')")
    if isinstance(module, BatchNormBase):
        raise EngineError(
            f"module {name or '<root>'} ({type(module).__name__}) normalises with batch statistics in "
            "training mode, which mixes samples, and writes them into its running buffers: per-sample "
            "gradients and the privacy guarantee would not hold (refused in eval mode too: model.train() "
            "switches it back)", _BATCHNORM_HINT)
    complex_params = [n for n, p in module.named_parameters(recurse=False) if id(p) in trainable and p.is_complex()]
    if complex_params:
        raise EngineError(f"module {name or '<root>'} ({type(module).__name__}) has complex parameter "
                          f"{complex_params[0]}: per-sample norms, clipping and noise are defined for real "
                          "parameters", "keep the real and imaginary parts as two real parameters "
                          "(torch.complex(re, im) in the forward)")
    if (isinstance(module, InstanceNormBase)
            and module.track_running_stats):
        raise EngineError(
            f"module {name} ({type(module).__name__}) tracks running statistics "
            "of the private data, released with the model", "set track_running_stats=False")
    hooked = [type(h).__name__ for h in module._forward_pre_hooks.values() if isinstance(h, _WEIGHT_HOOKS)]
    # a layer rule reads the module's weight by name; the torch.func fallback would recompute it by the hook
    trains = any(id(p) in trainable for p in module.parameters(recurse=False))
    if hooked and trains and find_layer_rule(module) is not None:
        raise EngineError(f"module {name or '<root>'} ({type(module).__name__}) computes its weight in a forward "
                          f"pre-hook ({hooked[0]}: torch.nn.utils.prune, or the old weight_norm / spectral_norm), from "
                          "parameters its layer rule does not know", "use torch.nn.utils.parametrizations.weight_norm "
                          "or spectral_norm (supported), or make the pruned weight a parameter: prune.remove(module, "
                          "'weight')")
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and id(module.weight) in trainable:
        raise EngineError(f"module {name or '<root>'} ({type(module).__name__}) has sparse=True: its gradient is a "
                          "sparse tensor, which the per-sample clipping and the noise (dense over the whole table) "
                          "do not take", "set sparse=False (the noisy gradient is dense anyway)")
    if (isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and module.max_norm is not None):
        # Checked for frozen tables too: the renormalisation writes the weight anyway.
        raise EngineError(
            f"module {name or '<root>'} ({type(module).__name__}) has max_norm="
            f"{module.max_norm}: its forward renormalises the looked-up rows in place, "
            "so the weights reveal which tokens were in the private batch",
            "set max_norm=None (clip the gradient instead)")


def refuse_new_trainable(model: nn.Module, privatised: list[nn.Parameter], names: set[str] | None = None) -> None:
    """A parameter trainable now that was not when the engine was built (a layer unfrozen, a module
    or parameter replaced) is not book-kept: autograd would leave its raw gradient in ``p.grad``.
    A privatised parameter frozen since would get the noise alone at every step (it drifts).
    A gradient hook on a trainable parameter is refused: it would get None (never a per-sample,
    clipped or noised gradient), and its own error, or nothing, would follow.
    ``names``: a sharded model's privatised names, compared by name (FSDP swaps the parameter
    objects for unsharded ones around each forward and backward)."""
    known = {id(p) for p in privatised}
    held = {id(p) for p in model.parameters()}
    lost = [tuple(p.shape) for p in privatised if names is None and id(p) not in held]
    new = [name for name, p in model.named_parameters() if p.requires_grad and
           (id(p) not in known if names is None else name not in names)]
    frozen = [name for name, p in model.named_parameters() if names is None and id(p) in known and not p.requires_grad]
    if frozen:
        raise EngineError(f"parameters frozen (requires_grad=False) since the engine was built ({', '.join(frozen[:3])}"
                          f"{', ...' if len(frozen) > 3 else ''}): the engine still privatises them, and they would "
                          "be stepped with noise alone and drift, or a per-layer threshold set for them would go "
                          "unused", "freeze layers before building the engine (make_private, DPTrainer): it "
                          "privatises the parameters trainable then; or make these trainable again "
                          "(requires_grad_(True))")
    hooked = [name for name, p in model.named_parameters() if names is None and p.requires_grad and any(
        not getattr(hook, "dpclip_certificate", False) for hook in gradient_hooks(p))]
    if hooked:   # the per-sample gradients never pass through the parameter: its hooks would get None
        raise EngineError(f"parameter {hooked[0]} has a gradient hook (register_hook or "
                          "register_post_accumulate_grad_hook): the engine computes its per-sample gradients "
                          "itself, so the hook would never see them, nor the clipped and noised sum",
                          "remove the hook (handle.remove()); scale or transform the noised gradient after "
                          "privatize() or optimizer.step(), or change the model's forward")
    if new:
        raise EngineError(f"parameters trainable now that were not when the engine was built ({', '.join(new[:3])}"
                          f"{', ...' if len(new) > 3 else ''}): the engine does not book-keep them, and their "
                          "gradients would reach p.grad unclipped and without noise",
                          "freeze, unfreeze and replace layers before building the engine (make_private, "
                          "DPTrainer), or freeze these again (requires_grad_(False))")
    if lost:   # the model reads something else in their place now: their noisy steps would go nowhere
        raise EngineError(f"{len(lost)} parameter(s) the engine privatises (shapes {lost[:3]}) are no longer in the model "
                          "(a plain tensor or another parameter in their place): the model would go on with a copy the "
                          "optimizer never steps",
                          "do not replace parameters after building the engine: build it (make_private, DPTrainer) "
                          "after the model's last change")


def refuse_outside_leaves(losses: Tensor, params: list[Tensor]) -> None:
    """Refuse per-sample losses that depend on a trainable parameter the engine does not clip: a
    head or a temperature outside the model. autograd would accumulate the batch's raw gradient into
    its ``.grad`` (unclipped, unnoised), and an optimizer holding it would release that. Found by a
    walk of the losses' graph to its leaves (``AccumulateGrad`` nodes), before the backward, and
    into a reentrant checkpoint's function (its parameters are not leaves of this graph). Leaves
    that are not ``nn.Parameter`` are activations or inputs (HF's input-embedding hook under
    gradient checkpointing makes a frozen embedding's output one): nothing steps their ``.grad``."""
    known = {id(p) for p in params}
    seen: set = set()
    todo = [losses.grad_fn] if losses.grad_fn is not None else []
    stray: list[Tensor] = []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            if isinstance(leaf, nn.Parameter) and id(leaf) not in known:
                stray.append(leaf)
            continue
        stray += [p for m in _modules_of(getattr(node, "run_function", None))
                  for p in m.parameters() if p.requires_grad and id(p) not in known]
        todo.extend(child for child, _ in node.next_functions)
    if stray:
        what = ", ".join(f"parameter of shape {list(t.shape)}" for t in stray[:3])
        raise EngineError(f"the per-sample losses depend on {len(stray)} trainable parameter(s) outside the model the "
                          f"engine clips ({what}): their raw gradient of the whole batch, neither clipped nor noised, "
                          "would land in their .grad", "make them part of the model given to the engine (a head or "
                          "a temperature as a submodule or nn.Parameter of it), or freeze them (requires_grad=False)")


def _modules_of(fn) -> list[nn.Module]:
    """The modules a reentrant checkpoint's ``run_function`` calls, as far as they can be seen: the
    module itself, a bound method's, a ``functools.partial``'s, or those its closure holds."""
    if fn is None:
        return []
    if isinstance(fn, nn.Module):
        return [fn]
    if isinstance(getattr(fn, "__self__", None), nn.Module):
        return [fn.__self__]
    if isinstance(fn, functools.partial):
        return _modules_of(fn.func) + [a for a in (*fn.args, *fn.keywords.values()) if isinstance(a, nn.Module)]
    cells = getattr(fn, "__closure__", None) or ()
    return [c.cell_contents for c in cells if isinstance(getattr(c, "cell_contents", None), nn.Module)]


def refuse_detached(*args, **kwargs) -> None:
    """A detached engine's ``backward`` and ``privatize``: its hooks are gone, so nothing is clipped or noised."""
    raise EngineError("the engine was detached from the model (detach()): it clips and noises nothing more",
                      "detach after the last private step; to go on training privately, start again with "
                      "make_private (or a new DPEngine) and the ledger loaded from the run's checkpoint")
