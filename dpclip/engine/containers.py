"""Parameters held in containers (nn.ParameterDict / nn.ParameterList) for another module's forward.

peft keeps its adapters' weights so (``lora_embedding_A``, IA3's ``ia3_l``, LoHa's ``hada_w1_a``,
AdaLoRA's ``lora_E``): the container is never called; the adapter layer's own forward reads them.
The engine gives them to that layer's unit, whose torch.func fallback differentiates its whole
forward (docs/layer-rules.md, "One backward pass: book-keeping").
"""

from __future__ import annotations

from torch import nn

from dpclip.engine.layers import find_layer_rule


def is_container(module: nn.Module) -> bool:
    """nn.ParameterDict / nn.ParameterList: parameters held for another module's forward (peft's
    ``lora_embedding_A``, ``ia3_l``, ``hada_w1_a``): never called itself."""
    return isinstance(module, (nn.ParameterDict, nn.ParameterList))


def owned_parameters(module: nn.Module, contained: bool) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``module``'s forward reads as its own: its direct ones, and with
    ``contained`` those of its container children, by dotted name ("ia3_l.default")."""
    out = list(module.named_parameters(recurse=False))
    if contained:
        for child_name, child in module.named_children():
            if is_container(child):
                out += [(f"{child_name}.{n}", p) for n, p in child.named_parameters(recurse=False)]
    return out


def contained_by(owner: nn.Module, sub: nn.Module) -> bool:
    return is_container(sub) and any(child is sub for child in owner.children())


def container_owner(model: nn.Module, name: str) -> nn.Module | None:
    """The module whose torch.func fallback reads the container ``name``'s parameters (its
    parent), or None where the parent has a layer rule of its own (which would not read them)."""
    if not name:
        return None
    parent = model.get_submodule(name.rpartition(".")[0])
    return parent if find_layer_rule(parent) is None else None


def without_aliases_below(module: nn.Module, name: str, params: list[tuple[str, nn.Parameter, int]]):
    """The torch.func rule differentiates the module's whole forward, so it would also count the
    uses of a parameter by a submodule holding the same tensor (BERT's ``predictions.bias is
    predictions.decoder.bias``), which that submodule's unit delivers itself: the parameter
    belongs to the submodule alone. A use by this module's own forward then reaches ``p.grad``
    and is refused. Returns (the parameters kept, (index, note) for each left to the submodule)."""
    below = {id(p) for sub in module.modules() if sub is not module and not contained_by(module, sub)
             for p in sub.parameters(recurse=False)}
    kept, notes = [], []
    for pname, p, idx in params:
        if id(p) in below:
            notes.append((idx, f"{f'{name}.{pname}' if name else pname} ({type(module).__name__} holds it and "
                               "has no layer rule; a submodule holding the same tensor owns it)"))
        else:
            kept.append((pname, p, idx))
    return kept, notes
