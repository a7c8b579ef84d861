"""Parameters no unit of their own can book-keep, taken by an enclosing torch.func unit.

The torch.func rule recomputes a module's whole call per sample and differentiates it with
respect to the parameters it owns, so a parameter used only inside that module's calls is
exact there, however the call uses it (docs/supported-models.md, "Mixture-of-experts and state-space
models", "Learned tables shared by all samples"). Two kinds are handed over:

- **Read without a call** (Mamba's mixer passes its ``conv1d.weight`` to ``F.conv1d``;
  LFM2's short convolution reads ``conv.weight``; DeBERTa-v2's encoder reads its relative
  position table ``rel_embeddings.weight``): the probes saw which modules' calls were in
  progress when an op read them; the nearest enclosing module whose call read them all takes
  them. A reader without a unit gets one if no module of the forward has run yet
  (``at_start``); one with a rule of its own leaves them to be refused as stray gradients.
- **A shared feeder** (DeBERTa-v3's LayerNorm over that table, whose output is the input of
  every layer's position projections): a layer fed a tensor shared by all samples whose
  output feeds other layers has no per-sample output gradient of its own; an enclosing
  torch.func unit that already exists takes its parameters, at the start of a forward only.

The child's unit is removed: its module runs its own forward, inside the owner's call, with
the owner's detached copies of the parameters.
"""

from __future__ import annotations

from dpclip.engine.layers import find_layer_rule
from dpclip.engine.layers.functorch import FUNCTORCH_RULE


def adopt(keeper, called: set[int], reads: dict[int, set[int]], at_start: bool,
          feeders: frozenset[int] | set[int] = frozenset()) -> bool:
    """Hand each never-called unit whose parameters were read (``reads``: parameter id -> the
    modules whose calls were in progress) and each shared feeder (unit ids) to its owner.
    Returns True when the units changed (their calls must be probed again)."""
    by_module = {id(u.module): u for u in keeper.units}
    # a tied table (T5's `shared`, read through the called `embed_tokens` and `lm_head`) is
    # delivered by the units called with it: the never-called one keeps nothing to adopt
    delivered = {id(p) for u in keeper.units if id(u) in called for _, p, _ in u.params}
    changed = False
    for unit in list(keeper.units):
        if unit.derived or not unit.params:
            continue
        if id(unit) in feeders:
            if not at_start or keeper.strict:
                continue
            owner, created = _owner(keeper, by_module, unit, readers=None, create=False)
        elif (id(unit) not in called and getattr(unit.module, "padding_idx", None) is None   # padding rows stay noise-free
              and not any(id(p) in delivered for _, p, _ in unit.params)):
            read = [reads[id(p)] for _, p, _ in unit.params if id(p) in reads]
            if not read:
                continue
            owner, created = _owner(keeper, by_module, unit, set.intersection(*read), create=at_start and not keeper.strict)
        else:
            continue
        if owner is None:
            continue
        changed = changed or created or id(unit) in feeders
        prefix = unit.name[len(owner.name) + 1:] if owner.name else unit.name
        owner.params.extend((f"{prefix}.{pname}", p, idx) for pname, p, idx in unit.params)
        keeper.drop_unit(unit, owner)
    return changed


def _owner(keeper, by_module: dict, unit, readers: set[int] | None, create: bool) -> tuple:
    """(the nearest enclosing module's torch.func unit, whether made now): only a module whose
    call read the parameters, if ``readers`` is given; made if ``create`` and the module has
    neither unit nor rule; None if a unit with another rule comes first."""
    name = unit.name
    while name:
        name = name.rpartition(".")[0]
        module = keeper.model.get_submodule(name)
        if readers is not None and id(module) not in readers:
            continue
        owner, created = by_module.get(id(module)), False
        if owner is None and create and find_layer_rule(module) is None:
            owner = by_module[id(module)] = keeper.new_unit(module, name)
            created = True
        if owner is None and readers is None:
            continue   # a feeder's owner may sit further up
        return (owner, created) if owner is not None and owner.rule is FUNCTORCH_RULE else (None, False)
    return None, False
