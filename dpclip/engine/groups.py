"""Grouping styles: which trainable parameters are clipped together.

Group-wise clipping (groupwise-clipping paper §1, Table 1) splits the trainable
parameters into K groups, each clipped to its own threshold C_k. Styles:

``all-layer``        one group (flat clipping, Abadi et al.).
``layer``            one group per module owning parameters (its weight and bias).
``param``            one group per parameter tensor (what Opacus calls per-layer).
``block``            one group per transformer block: the children of the first
                     ``nn.ModuleList``/``nn.Sequential`` (pre-order) holding ≥ 2 children of
                     one class that all have parameters (a fully frozen block forms no
                     group). A parameter outside the blocks goes to the group of the first
                     module on its path that does not contain the blocks (GPT-2: ``transformer.wte``, ``transformer.wpe``,
                     ``transformer.ln_f``; BERT: ``bert.embeddings``, ``bert.pooler``,
                     ``classifier``).
``{uniform: M}``     M contiguous groups of near-equal parameter count, in registration
                     order (``model.named_parameters()``), cut between tensors.
``{groups: [[re]]}`` explicit: a parameter joins the group one of whose regexes
                     ``re.search``-es one of its names; every trainable parameter must land in
                     exactly one group.
``{stages: [re]}``   per-device (pipeline) clipping (adaptive-per-layer paper): each regex
                     names the first module of a stage (first match in ``named_modules()``
                     order); a stage holds the parameters from its first module's first
                     parameter up to the next stage, in registration order.

Order everywhere is registration order; groups are listed in the order of their first
parameter. Tied parameters (GPT-2's ``lm_head.weight is transformer.wte.weight``) appear
once, under their first name; regexes may match any of their names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn
from torch.nn.parameter import is_lazy

from dpclip.errors import EngineError

STYLES = ("all-layer", "layer", "param", "block", "{uniform: M}", "{groups: [[regex, ...], ...]}",
          "{stages: [regex, ...]}")


@dataclass
class ParamInfo:
    """A trainable parameter: its names (first = canonical), tensor and owning module."""

    names: list[str]
    param: nn.Parameter

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def owner(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass
class Groups:
    """K groups over the trainable parameters (indices into ``params``)."""

    names: list[str]
    members: list[list[int]]
    params: list[ParamInfo]

    @property
    def sizes(self) -> list[int]:
        """d_k: number of scalar parameters per group."""
        return [sum(self.params[i].numel for i in m) for m in self.members]

    @property
    def group_of(self) -> list[int]:
        out = [0] * len(self.params)
        for k, m in enumerate(self.members):
            for i in m:
                out[i] = k
        return out

    def __len__(self) -> int:
        return len(self.names)


def trainable_params(model: nn.Module) -> list[ParamInfo]:
    """Trainable parameters in registration order, each once, with all its names."""
    by_id: dict[int, ParamInfo] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) in by_id:
            by_id[id(p)].names.append(name)
        else:
            by_id[id(p)] = ParamInfo([name], p)
    return list(by_id.values())


def build_groups(model: nn.Module, grouping="all-layer",
                 params: list[ParamInfo] | None = None) -> Groups:
    """Split ``model``'s trainable parameters by ``grouping`` (see module doc)."""
    params = trainable_params(model) if params is None else params
    if not params:
        raise EngineError("the model has no trainable parameters", "unfreeze some parameters")
    lazy = [info.name for info in params if is_lazy(info.param)]
    if lazy:   # its shape, and so its group's size and its noise, do not exist yet
        raise EngineError(f"parameter {lazy[0]} is not initialised yet (a lazy module such as nn.LazyLinear): "
                          "its shape, and so its clipping group and its noise, are unknown",
                          "run one forward of the model on dummy or public data before building the engine "
                          "(or calling make_private), so that its lazy modules take their shapes")
    if isinstance(grouping, str):
        style = grouping
        if style == "all-layer":
            return Groups(["all"], [list(range(len(params)))], params)
        if style == "layer":
            return _by_key(params, [p.owner or "<root>" for p in params])
        if style == "param":
            return Groups([p.name for p in params], [[i] for i in range(len(params))], params)
        if style == "block":
            return _blocks(model, params)
    elif isinstance(grouping, dict) and len(grouping) == 1:
        (style, arg), = grouping.items()
        if style == "uniform":
            return _uniform(params, arg)
        if style == "groups":
            return _explicit(params, arg)
        if style == "stages":
            return _stages(model, params, arg)
    raise EngineError(f"unknown grouping {grouping!r}", "use one of: " + ", ".join(STYLES))


def _by_key(params: list[ParamInfo], keys: list[str]) -> Groups:
    names: list[str] = []
    members: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        if key not in members:
            names.append(key)
            members[key] = []
        members[key].append(i)
    return Groups(names, [members[n] for n in names], params)


def find_blocks(model: nn.Module) -> tuple[str, list[str]] | None:
    """(container name, block names) of the first container of ≥ 2 same-class blocks."""
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        # blocks have parameters (frozen or not: freezing a block must not move the blocks)
        if not all(any(True for _ in c.parameters()) for _, c in children):
            continue
        prefix = f"{name}." if name else ""
        return name, [prefix + child for child, _ in children]
    return None


def _blocks(model: nn.Module, params: list[ParamInfo]) -> Groups:
    found = find_blocks(model)
    if found is None:
        raise EngineError("grouping 'block' found no nn.ModuleList/nn.Sequential of two or more "
                          "similar blocks", "use grouping 'layer', {uniform: M} or {groups: ...}")
    container, blocks = found
    ancestors = {""}
    parts = container.split(".") if container else []
    for j in range(len(parts) + 1):
        ancestors.add(".".join(parts[:j]))

    def key(p: ParamInfo) -> str:
        for b in blocks:
            if p.name.startswith(b + "."):
                return b
        pieces = p.name.split(".")
        for j in range(1, len(pieces)):
            prefix = ".".join(pieces[:j])
            if prefix not in ancestors:
                return prefix
        return p.name  # registered directly on an ancestor of the blocks

    return _by_key(params, [key(p) for p in params])


def _uniform(params: list[ParamInfo], m) -> Groups:
    """M contiguous groups; cut k lands at the tensor boundary nearest k/M of the total."""
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise EngineError(f"uniform grouping needs a positive integer M, got {m!r}", None)
    n = len(params)
    if m > n:
        raise EngineError(f"uniform grouping asks for {m} groups but the model has only {n} "
                          "trainable tensors", f"use M ≤ {n}")
    cum = [0]
    for p in params:
        cum.append(cum[-1] + p.numel)
    total = cum[-1]
    cuts = [0]
    for k in range(1, m):
        target = total * k / m
        lo, hi = cuts[-1] + 1, n - (m - k)   # every group keeps at least one tensor
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(cum[i] - target), i)))
    cuts.append(n)
    members = [list(range(cuts[k], cuts[k + 1])) for k in range(m)]
    return Groups([f"uniform{k}" for k in range(m)], members, params)


def _compile(patterns, what: str) -> list[re.Pattern]:
    if not isinstance(patterns, (list, tuple)) or not patterns:
        raise EngineError(f"{what} must be a non-empty list of regexes, got {patterns!r}", None)
    out = []
    for pat in patterns:
        try:
            out.append(re.compile(pat))
        except (re.error, TypeError) as exc:
            raise EngineError(f"bad regex {pat!r} in {what}: {exc}", None) from exc
    return out


def _explicit(params: list[ParamInfo], groups) -> Groups:
    if not isinstance(groups, (list, tuple)) or not groups:
        raise EngineError("grouping {groups: ...} needs a list of regex lists", None)
    compiled = [_compile(g if isinstance(g, (list, tuple)) else [g], f"groups[{k}]")
                for k, g in enumerate(groups)]
    members: list[list[int]] = [[] for _ in compiled]
    orphans, dupes = [], []
    for i, p in enumerate(params):
        hits = [k for k, pats in enumerate(compiled)
                if any(r.search(name) for r in pats for name in p.names)]
        if not hits:
            orphans.append(p.name)
        elif len(hits) > 1:
            dupes.append(f"{p.name} (groups {hits})")
        else:
            members[hits[0]].append(i)
    if orphans or dupes:
        msg = []
        if orphans:
            msg.append("in no group: " + ", ".join(orphans))
        if dupes:
            msg.append("in several groups: " + ", ".join(dupes))
        raise EngineError("every trainable parameter must be in exactly one group; "
                          + "; ".join(msg), "adjust the regexes of clipping.grouping.groups")
    empty = [k for k, m in enumerate(members) if not m]
    if empty:
        raise EngineError(f"groups {empty} match no trainable parameter", "remove them")
    names = ["|".join(r.pattern for r in pats) for pats in compiled]
    return Groups(names, members, params)


def _stages(model: nn.Module, params: list[ParamInfo], stages) -> Groups:
    compiled = _compile(stages, "stages")
    modules = [name for name, _ in model.named_modules()]
    starts = []
    for r in compiled:
        module = next((m for m in modules if r.search(m)), None)
        if module is None:
            named = ", ".join(m for m in modules[1:6] if m)
            raise EngineError(f"stage regex {r.pattern!r} matches no module",
                              f"each of clipping.grouping.stages names the module a stage starts at, e.g. of: {named}")
        prefix = f"{module}." if module else ""
        first = next((i for i, p in enumerate(params)
                      if any(n.startswith(prefix) for n in p.names)), None)
        if first is None:
            raise EngineError(f"stage starting at module {module!r} has no trainable parameter",
                              "start the stage at a module that holds trainable parameters")
        starts.append(first)
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise EngineError("stages must start at modules in increasing forward order with "
                          "at least one trainable parameter each", "reorder clipping.grouping.stages")
    starts[0] = 0  # parameters before the first named module belong to the first stage
    bounds = starts + [len(params)]
    members = [list(range(bounds[k], bounds[k + 1])) for k in range(len(starts))]
    return Groups([f"stage{k}:{r.pattern}" for k, r in enumerate(compiled)], members, params)


def sole_user_groups(units, members: list[list[int]], count: int) -> list[bool]:
    """Per parameter (``count`` of them): is its group finalized as soon as its own backward
    is done? True when one module is the only user of every parameter in the group (layer-
    and param-wise grouping); the norm rule may then instantiate per-sample gradients that
    live only until that module's clip factors are known
    (:func:`dpclip.engine.factors.choose_ghost`). A policy that waits for all groups
    (per-sample thresholds) makes none transient: the engine asks only otherwise."""
    transient = [False] * count
    users: dict[int, set[int]] = {}
    for unit in units:
        for _, _, idx in unit.params:
            users.setdefault(idx, set()).add(id(unit))
    for group in members:
        modules = set().union(*(users.get(idx, set()) for idx in group))
        if len(modules) == 1:
            for idx in group:
                transient[idx] = True
    return transient



def untied_padding_rows(units) -> dict[int, int]:
    """Embedding padding rows never get a gradient; keep noise off them too, unless
    the weight is also used elsewhere (a tied head does train that row)."""
    users: dict[int, int] = {}
    for unit in units:
        for _, _, idx in unit.params:
            users[idx] = users.get(idx, 0) + 1
    rows = {}
    for unit in units:
        m = unit.module
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            for name, _, idx in unit.params:
                if name == "weight" and users[idx] == 1:
                    rows[idx] = m.padding_idx
    return rows
