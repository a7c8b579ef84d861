"""Parametrized weights (``torch.nn.utils.parametrize``): per-sample gradients of the originals.

A parametrized module reads its weight as a function of parameters only,
``W = P(original0, original1, ...)`` (``weight_norm``, ``spectral_norm``, ``orthogonal``, a
user's own parametrization). Its layer rule treats W like any weight and hands over sample
i's gradient G_i = ∂ℓ_i/∂W (as factors, or instantiated). The chain rule through P is linear
in G_i, and P's Jacobian J_k depends on no sample:

    ∂ℓ_i/∂original_k = J_k(originals)ᵀ G_i

So the engine instantiates G_i ``[B, *W.shape]`` and takes the vector-Jacobian product of the
very W the module's forward computed, batched over the samples
(``torch.autograd.grad(..., is_grads_batched=True)``): the originals get ordinary
:class:`~dpclip.engine.factors.Dense` uses, norms and clipping as for any parameter
(docs/layer-rules.md, "Parametrized weights"). P runs once per module call, as without the engine:
the call reads W under ``parametrize.cached()``, and its backward reads that same W again
(:func:`pinned`), so a parametrization with state (spectral_norm's power iteration) advances
once per forward, as in non-private training.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from dpclip.engine.factors import Bilinear, Dense, Use, instantiate, widened_use
from dpclip.errors import EngineError
from dpclip.torch_compat import parametrization_cache

#: (tensor name, [(original's name, parameter, engine index)]) for each parametrized tensor
Derived = list[tuple[str, list[tuple[str, nn.Parameter, int]]]]


def is_parametrization(module: nn.Module) -> bool:
    """A module that holds a parametrized tensor's originals and computes P: its parameters
    are delivered by the parametrized module's unit, not by a unit of their own."""
    return isinstance(module, parametrize.ParametrizationList)


def derived_tensors(module: nn.Module, name: str, index_of: dict[int, int]) -> Derived:
    """The parametrized tensors of ``module`` with a trainable original, and those originals.

    Refuses a parametrization that owns trainable parameters besides the originals (P would
    then depend on parameters this rule does not differentiate)."""
    if not parametrize.is_parametrized(module):
        return []
    derived: Derived = []
    for tensor_name, plist in module.parametrizations.items():
        originals = [(n, p, index_of[id(p)]) for n, p in plist.named_parameters(recurse=False)
                     if id(p) in index_of]
        inner = [n for n, p in plist.named_parameters() if id(p) in index_of and "." in n]
        if inner:
            raise EngineError(f"module {name or '<root>'}: the parametrization of {tensor_name!r} has trainable "
                              f"parameters of its own ({', '.join(inner[:3])})",
                              "freeze them, or make them originals of the parametrization (docs/layer-rules.md, "
                              "\"Parametrized weights\")")
        if originals:
            derived.append((tensor_name, originals))
    return derived


def per_sample_gradient(use: Use, shape: torch.Size) -> Tensor:
    """G_i of one use, instantiated: ``[B, *shape]`` (half-precision factors in float32)."""
    if isinstance(use, Dense):
        return use.grad
    assert isinstance(use, Bilinear)
    wide = widened_use(use, torch.promote_types(use.right.dtype, torch.float32))
    return instantiate(wide).reshape(use.right.shape[0], *shape)


def original_uses(weight: Tensor, originals: list[Tensor], use: Use) -> list[Dense]:
    """The originals' per-sample gradients J_kᵀ G_i from ``use`` (sample i's G_i with respect
    to ``weight``, the W one call computed; its graph back to the originals is kept)."""
    grads = per_sample_gradient(use, weight.shape)
    per = torch.autograd.grad([weight], originals, [grads.to(weight.dtype)], retain_graph=True,
                              allow_unused=True, is_grads_batched=True)
    batch = grads.shape[0]
    return [Dense(torch.zeros(batch, *o.shape, dtype=o.dtype, device=o.device) if g is None else g)
            for o, g in zip(originals, per)]


@contextmanager
def pinned(module: nn.Module, weights: dict[str, Tensor]) -> Iterator[None]:
    """Reads of ``module.<name>`` return ``weights[name]`` (the W of the call being
    differentiated) instead of evaluating P again in the backward.

    parametrize keeps its cache in a module-level dict keyed by (id(module), name); it is filled
    here inside ``cached()``, which empties it on leaving."""
    if not weights:
        yield
        return
    keys = [(id(module), name) for name in weights]
    with parametrize.cached():
        before = {k: parametrization_cache().get(k) for k in keys}   # a user's own cached() block
        parametrization_cache().update(zip(keys, weights.values()))
        try:
            yield
        finally:
            for k, w in before.items():
                if w is None:
                    parametrization_cache().pop(k, None)
                else:
                    parametrization_cache()[k] = w


def functional_call(module: nn.Module, tensors: dict[str, Tensor], args: tuple, kwargs: dict):
    """``torch.func.functional_call`` that also takes a parametrized tensor by its own name.

    functional_call would assign such a tensor through the parametrization's right inverse,
    writing the originals in place (and breaking the graph the call's W was built on): the
    module reads it from parametrize's cache instead (:func:`pinned`)."""
    derived = {n: t for n, t in tensors.items() if parametrize.is_parametrized(module, n)}
    rest = {n: t for n, t in tensors.items() if n not in derived}
    with pinned(module, derived):
        return torch.func.functional_call(module, rest, args, kwargs)
