"""The floor: the fewest extra flops exact per-sample clipping must add to a training step.

A private step computes everything a non-private step does, plus each sample's gradient
norm, and it replaces each weight gradient Σ_i G_i with the clipped Σ_i c_i G_i. This
model counts, per layer and for a given batch B and sequence length T, the non-private
flops and the cheapest way to get an exact norm and the clipped sum, and reports

    floor ratio = (non-private flops + floor extra flops) / non-private flops,

and beside it the all-ghost ratio: every weight ghost-normed, no per-sample gradient
ever held (what a step must cost when memory rules out instantiation).

A measured ratio can only approach it from above: it adds the noise draw, memory
traffic and overheads that flops do not count. One flop is one addition or one
multiplication (a multiply-add is 2).

Non-private flops (only matmuls and parameter operations; elementwise work, softmax
and the loss are left out: under 2% of a GPT-2 small step at these shapes, and counting
them would lower every floor ratio a little):

    dense p x d layer over B·T tokens  forward 2·B·T·p·d, backward 2·B·T·p·d (weight
                                       gradient) + 2·B·T·p·d (input gradient, when the
                                       layer's input needs one: not for a model's first layer)
    embedding V x d                    forward 0 (a gather), backward B·T·d (scatter-add)
    vector n (bias, LayerNorm affine)  forward B·T·n, backward 2·B·T·n
    attention (no parameters)          forward 4·B·T²·d per layer (QKᵀ and AV, all heads),
                                       backward 8·B·T²·d (two gradients of each); counted in
                                       full, as eager attention computes it

Extra flops of one parameter, the cheaper of (Bu et al. 2023, "Differentially private
optimization on large model at small cost", ICML, Table 2 (complexity of ghost norm and
per-sample instantiation); docs/layer-rules.md):

    ghost        dense (factors L_i: T x m, R_i: T x n):
                     ||L_iᵀ R_i||² = <L_i L_iᵀ, R_i R_iᵀ>
                     full:      2·B·T²·(m+n) (two Grams) + 2·B·T² (their inner product)
                     symmetric: B·T(T+1)·(m+n) + B·T(T+1) (only the T(T+1)/2 entries on and
                                above the diagonal of each Gram, the off-diagonal ones twice)
                     + B·T·min(m, n) to scale the thinner factor by c_i; the clipped sum
                     Lᵀ diag(c) R then costs what the weight gradient did: 0 extra
                 ids (embedding): the one-hot Gram is an id-equality test (comparisons, no
                     flops, no V cost): B·T(T+1)·d + B·T(T+1)/2 symmetric (2·B·T²·d + B·T²
                     full), + B·T·d to scale
    instantiate  dense: G_i = L_iᵀ R_i costs 2·B·T·m·n, exactly the non-private weight
                     gradient it replaces (the same products, not summed over samples);
                     then ||G_i||² 2·B·m·n and Σ_i c_i G_i 2·B·m·n: 4·B·m·n extra
                 ids: G_i has at most u = min(T, V) non-zero rows; summing a sample's rows
                     by id replaces the non-private scatter: 4·B·u·d extra (u = T: every
                     id distinct, the most a sample can have)
    vector       per-sample sums over a sample's tokens are the non-private sum split by
                 sample: 4·B·n extra (norm and clipped sum)

The floor takes the symmetric count (``--gram full`` the other): exact Gram work cannot
go below one product per entry on and above the diagonal. The engine's column strips
(``dpclip.engine.grams.symmetric_ghost``) reach (k+1)/(2k) of the full product with k
strips (5/8 at its k = 4, from T 128 on the CPU), approaching it.

A tied parameter (GPT-2's wte and lm_head: one tensor, an ids use and a dense use) is
one parameter, as in the engine: its norm is ||E_i + H_i||² = ||E_i||² + ||H_i||² +
2<E_i, H_i>, and the floor is the cheapest of: both instantiated (4·B·V·d: E_i's rows are
added into H_i, replacing the non-private scatter); both ghost-normed with the cross term
Σ_{t,s} b_i[s, x_t]·<e_t, h_s> (2·B·T_h·T_e·d + 2·B·T_h·T_e); or E_i instantiated
(4·B·u·d), H_i ghost-normed and the cross term from H_i's u rows at E_i's ids
(2·B·u·T_h·d + 2·B·u·d).

Noise (one Gaussian per parameter per step) is not a flop count; the tables list the
parameter count beside the floor, and benchmarks/floor_gap.py adds the draw, measured in
the same rounds as the steps, to the floor it holds them against. The flop floor counts no memory: it may instantiate a
G_i the engine could not hold (all-layer clipping keeps every layer's until the end of
the backward), and memory traffic is why the engine's time rule keeps GPT-2 small's wide
layers ghost-normed at T 256 although instantiating them costs fewer flops
(benchmarks/README.md, "The floor").

The memory-aware floor (``--memory``) is the fewest extra flops over per-parameter
choices whose step memory stays within ``--goal`` (issue 32: 1.15x) the non-private
step's, per grouping. The memory model (float32, 4 bytes a float):

    non-private step   the activations autograd saves for the backward (counted on the
                       meta device, the loss's included, parameters left out) + one
                       gradient per parameter, taken as all live at once
    all-layer holds    to the end of the backward: ghost its output gradient b_i
                       (B·T·p_out; a_i is an activation already counted), instantiation
                       B·m·n, a vector B·n; "norm only" (G_i formed for the norm, the
                       clipped sum from the factors: 2·B·T·m·n + 2·B·m·n + B·T·min(m, n)
                       flops) holds b_i and one sample's G_i at a time
    layer-wise holds   nothing past a module's own backward (ghost: its Grams; G_i streamed
                       in ``streamed_clip``'s chunks), except the tied parameter, held from
                       lm_head to wte in either grouping (b_i of the head, or its G_i)
    transients         Grams B·T² (symmetric blocks; 2·B·T² full), a chunk of G_i
    extra memory       max(0, held - credit) + the largest transient, where credit is the
                       held groups' parameter count: book-keeping forms no weight gradient
                       before a group's clip, the non-private step holds it by then

    python benchmarks/floor.py                                  # GPT-2 small, four shapes
    python benchmarks/floor.py --shape 4x256 --shape 2x1024 --per-layer --json out.json
    python benchmarks/floor.py --memory                         # + the memory-aware floor

Length: over 400 lines: the flop counts, the memory model and the exact search over
choices share one set of per-parameter options; split, each would re-derive them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from itertools import combinations_with_replacement
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dpclip.floor import (Call, Param, dense_ghost, dense_instantiate, gram_dot_flops,  # noqa: E402,F401
                          gram_flops, ids_ghost, ids_instantiate, param_costs, walk)

GPT2_SMALL = dict(layers=12, embd=768, heads=12, vocab=50257, positions=1024)
SHAPES = ((4, 256), (2, 1024), (16, 256), (8, 1024))
GRAMS = ("symmetric", "full")


# ------------------------------------------------------------------ per use and per parameter
# (dpclip/floor.py: the counts ``dpclip bench`` shares)


def engine_choice(p: Param, grouping: str) -> str | None:
    """What the engine's mixed rule (``dpclip.engine.factors.choose_ghost``) picks for
    ``p``'s weight, asked with its factor shapes on the meta device: layer-wise clips a
    single-module parameter at once (the time rule), all-layer and a tied parameter wait
    (the memory rule). None for vectors (always instantiated)."""
    from dpclip.engine.factors import Bilinear, choose_ghost

    dense = [c for c in p.calls if c.kind == "dense"]
    ids = [c for c in p.calls if c.kind == "ids"]
    if not dense and not ids:
        return None
    transient = grouping == "layer" and len({c.kind for c in p.calls}) == 1
    words = []
    for calls in (dense, ids):
        if not calls:
            continue
        seq, m, n = sum(c.seq for c in calls), calls[0].m, calls[0].n
        right = torch.empty(1, 1, seq, n, device="meta")
        if calls[0].kind == "ids":
            use = Bilinear(torch.empty(1, seq, dtype=torch.long, device="meta"), right, vocab=m)
        else:
            use = Bilinear(torch.empty(1, 1, seq, m, device="meta"), right)
        words.append("ghost" if choose_ghost(use, "auto", transient) else "instantiate")
    return "+".join(words)


# ------------------------------------------------------------------ a model at (B, T)


def layer_kind(p: Param, tied: bool) -> str:
    """Row label: the module name with block indices as '*'; a tied tensor by its modules."""
    return "wte/lm_head (tied)" if tied else re.sub(r"\.\d+\.", ".*.", p.module)


def floor(params: list[Param], batch: int, gram: str = "symmetric",
          attention: tuple[int, int, int] | None = None) -> dict:
    """Totals and per-layer-kind rows for ``params`` at batch ``batch``. ``attention``
    (layers, seq, embd) adds the parameter-free QKᵀ and AV matmuls to the non-private
    flops: 4·B·T²·d forward and 8·B·T²·d backward per layer."""
    rows: dict[str, dict] = {}
    for p in params:
        cost = param_costs(p, batch, gram)
        tied = len({c.kind for c in p.calls}) > 1
        row = rows.setdefault(layer_kind(p, tied), dict(modules=set(), forward=0, backward=0, extra=0,
                                                          ghost=0, instantiate=0, choice=None,
                                                          engine=None, shape=None))
        row["modules"].add(p.module)
        row["forward"] += cost["forward"]
        row["backward"] += cost["backward"]
        row["extra"] += cost["floor"]
        if cost["choice"] != "per-sample sum":  # a module's weight decides its row's words
            row["ghost"] += cost["options"]["ghost"]
            row["instantiate"] += cost["options"]["instantiate"]
            row["choice"] = cost["choice"]
            row["shape"] = "x".join(str(s) for s in (p.calls[0].m, p.calls[0].n))
            row["engine"] = f"{engine_choice(p, 'all-layer')} / {engine_choice(p, 'layer')}"
        else:
            row["ghost"] += cost["floor"]
            row["instantiate"] += cost["floor"]
    if attention is not None:
        layers, seq, embd = attention
        rows["attention matmuls (no parameters)"] = dict(
            modules=set(range(layers)), forward=4 * batch * seq * seq * embd * layers,
            backward=8 * batch * seq * seq * embd * layers, extra=0, ghost=0, instantiate=0,
            choice=None, engine=None, shape=None)
    out_rows = []
    for kind, r in rows.items():
        out_rows.append(dict(kind=kind, count=len(r["modules"]), shape=r["shape"],
                             nonprivate=r["forward"] + r["backward"], forward=r["forward"],
                             backward=r["backward"], extra=r["extra"], ghost=r["ghost"],
                             instantiate=r["instantiate"], choice=r["choice"], engine=r["engine"]))
    nonprivate = sum(r["nonprivate"] for r in out_rows)
    extra = sum(r["extra"] for r in out_rows)
    ghost = sum(r["ghost"] for r in out_rows)
    return dict(batch=batch, nonprivate=nonprivate, extra=extra, ratio=(nonprivate + extra) / nonprivate,
                ghost_extra=ghost, ghost_ratio=(nonprivate + ghost) / nonprivate,
                parameters=sum(p.numel for p in params), gram=gram, layers=out_rows)


def _gpt2(sizes: dict) -> tuple[nn.Module, dict]:
    """A GPT2LMHeadModel of ``sizes`` over GPT-2 small's, built on the meta device."""
    from transformers import GPT2Config, GPT2LMHeadModel

    s = dict(GPT2_SMALL, **sizes)
    cfg = GPT2Config(n_layer=s["layers"], n_embd=s["embd"], n_head=s["heads"], vocab_size=s["vocab"],
                     n_positions=s["positions"], bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    return model, s


def gpt2_floor(batch: int, seq: int, gram: str = "symmetric", **sizes) -> dict:
    """The floor of a transformers GPT2LMHeadModel (``sizes``: layers, embd, heads, vocab,
    positions; GPT-2 small by default) at (B, T), built and run on the meta device."""
    model, s = _gpt2(sizes)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    params = walk(model, {"input_ids": ids}, batch)
    result = floor(params, batch, gram, attention=(s["layers"], seq, s["embd"]))
    return dict(result, seq=seq, sizes=s)


# ------------------------------------------------------------------ the memory-aware floor

FLOAT = 4      # bytes: factors, Grams and per-sample gradients are float32
GOAL = 1.15    # issue 32: step memory at most 1.15x the non-private step's
GROUPINGS = ("all-layer", "layer")


@dataclass(frozen=True)
class Option:
    """One way to clip a parameter: its extra flops, the floats it ``held`` until its
    group's clip factor is known, and the floats a ``transient`` needs while it is computed."""

    name: str
    flops: int
    held: int
    transient: int


def gram_live(batch: int, seq: int, gram: str) -> int:
    """Floats of Gram blocks live at once: both T x T Grams (full), or B·T² (symmetric):
    computed in k column strips, one strip of each Gram and their product hold
    3·B·T·T/k, within B·T² from k = 3 (the engine's 4 strips from T 128 on the CPU;
    ``dpclip.engine.grams.symmetric_ghost``; shorter sequences' whole Grams are small)."""
    return batch * seq * seq if gram == "symmetric" else 2 * batch * seq * seq


def stream_chunk(batch: int, seq: int, m: int, n: int) -> int:
    """Samples per chunk of ``streamed_clip``: G_i never over twice the factors, at least one."""
    return max(1, min(batch, 2 * batch * seq * (m + n) // (m * n)))


def spans_groups(p: Param) -> bool:
    """A tensor used by modules of two kinds (a tied embedding and head) is one group from
    its first use in the backward to its last, whatever the grouping."""
    return len({c.kind for c in p.calls}) > 1


def memory_options(p: Param, batch: int, gram: str, grouping: str) -> list[Option]:
    """``p``'s options with their memory under ``grouping``. All-layer holds what a use
    keeps until the end of the backward: ghost (and norm-only) its output gradient b_i,
    instantiation its B per-sample gradients (the input a_i is among the activations
    already counted). Layer-wise clips a module's parameter at its own backward: nothing
    is held, ghost needs its Grams, instantiation streams chunks of G_i (``stream_chunk``).
    The tied parameter holds its head's factors or gradients in both groupings."""
    flops = param_costs(p, batch, gram)["options"]
    dense = [c for c in p.calls if c.kind == "dense"]
    ids = [c for c in p.calls if c.kind == "ids"]
    vectors = [c for c in p.calls if c.kind == "vector"]
    hold = grouping == "all-layer" or spans_groups(p)
    if vectors:
        n = batch * vectors[0].n
        return [Option("per-sample sum", flops["per-sample sum"], n if hold else 0, 0 if hold else n)]
    if dense and ids:
        t_h, t_e = sum(c.seq for c in dense), sum(c.seq for c in ids)
        m, n, width = dense[0].m, dense[0].n, ids[0].n
        b_head, rows = batch * t_h * dense[0].out, batch * min(t_e, ids[0].m) * width
        return [Option("instantiate", flops["instantiate"], batch * m * n, 0),
                Option("ghost", flops["ghost"], b_head + batch * t_e * width,
                       max(gram_live(batch, t_h, gram), gram_live(batch, t_e, gram))),
                Option("mixed", flops["mixed"], b_head + rows, gram_live(batch, t_h, gram))]
    if dense:
        seq, m, n, out = sum(c.seq for c in dense), dense[0].m, dense[0].n, dense[0].out
        b = batch * seq * out
        # G_i formed for the norm only, the clipped sum from the factors (Lᵀ diag(c) R):
        # the per-sample products are extra, the weight gradient is not replaced
        norm_only = 2 * batch * seq * m * n + 2 * batch * m * n + batch * seq * min(m, n)
        chunk = m * n if hold else stream_chunk(batch, seq, m, n) * m * n
        return [Option("ghost", flops["ghost"], b if hold else 0, gram_live(batch, seq, gram)),
                Option("instantiate", flops["instantiate"], batch * m * n if hold else 0, 0 if hold else chunk),
                Option("norm only", norm_only, b if hold else 0, chunk)]
    seq, vocab, width = sum(c.seq for c in ids), ids[0].m, ids[0].n
    rows = batch * min(seq, vocab) * width
    return [Option("ghost", flops["ghost"], batch * seq * width if hold else 0, gram_live(batch, seq, gram)),
            Option("instantiate", flops["instantiate"], rows if hold else 0, 0 if hold else rows)]


def extra_memory(held: int, transient: int, credit: int) -> int:
    """Bytes a private step needs above the non-private one: max(0, held - credit) + transient.
    Book-keeping forms no weight gradient during the backward, so the ``credit`` (the
    gradients of the held groups, which the non-private step holds by then) offsets what
    is held; a transient is counted in full on top."""
    return FLOAT * (max(0, held - credit) + transient)


def _front(entries: list[tuple[int, int, tuple]]) -> list[tuple[int, int, tuple]]:
    """The (held, flops) Pareto front: sorted by held, each entry cheaper than all before."""
    out: list[tuple[int, int, tuple]] = []
    for held, flops, picks in sorted(entries, key=lambda e: (e[0], e[1])):
        if not out or flops < out[-1][1]:
            out.append((held, flops, picks))
    return out


def memory_floor(params: list[Param], batch: int, budget: float, grouping: str,
                 gram: str = "symmetric") -> dict | None:
    """The fewest extra flops over per-parameter options whose extra step memory
    (``extra_memory``) is at most ``budget`` bytes; None when no choice fits.

    Exact: for each bound τ on the largest transient (the distinct values the options
    have), options above τ are dropped and, among options that hold the same memory, the
    cheaper kept; parameters with the same options form one group, whose choices are the
    multisets of its options (13 for 12 blocks and two options), and groups are combined
    keeping the Pareto front of (held, flops). The least flops over every τ whose front
    has an entry within the budget is the optimum: an optimal choice with largest
    transient τ* survives the filter at τ = τ*, and every entry found is feasible."""
    options = [memory_options(p, batch, gram, grouping) for p in params]
    credit = sum(p.numel for p in params if grouping == "all-layer" or spans_groups(p))
    best = None
    for tau in sorted({o.transient for opts in options for o in opts}):
        groups: dict[tuple, list[str]] = {}
        for p, opts in zip(params, options):
            kept: dict[int, Option] = {}
            for o in opts:
                if o.transient <= tau and (o.held not in kept or o.flops < kept[o.held].flops):
                    kept[o.held] = o
            if not kept:
                break
            label = f"{layer_kind(p, spans_groups(p))}.{p.name.rsplit('.', 1)[-1]}"
            groups.setdefault((label, tuple(sorted(kept.values(), key=lambda o: o.held))), []).append(label)
        else:
            front = [(0, 0, ())]
            for (_, opts), labels in groups.items():
                combos = []
                for pick in combinations_with_replacement(opts, len(labels)):
                    counts = tuple(sorted(Counter(o.name for o in pick).items()))
                    combos.append((sum(o.held for o in pick), sum(o.flops for o in pick),
                                   ((labels[0], len(labels), counts),)))
                front = _front([(h1 + h2, f1 + f2, p1 + p2) for h1, f1, p1 in front
                                for h2, f2, p2 in _front(combos)])
            for held, flops, picks in front:
                need = extra_memory(held, tau, credit)
                if need <= budget and (best is None or flops < best["extra"]):
                    best = dict(extra=flops, memory=need, held=held, transient=tau, picks=picks)
    return best


def config_memory(params: list[Param], batch: int, grouping: str, pick, gram: str = "symmetric") -> int:
    """Extra step memory (bytes) of the choice ``pick(options) -> Option`` for each parameter."""
    chosen = [pick(memory_options(p, batch, gram, grouping)) for p in params]
    credit = sum(p.numel for p in params if grouping == "all-layer" or spans_groups(p))
    return extra_memory(sum(o.held for o in chosen), max(o.transient for o in chosen), credit)


def cheapest(opts: list[Option]) -> Option:
    """The flop floor's option (norm-only never is: its G_i cost the instantiation's and more)."""
    return min(opts, key=lambda o: o.flops)


def all_ghost(opts: list[Option]) -> Option:
    return next((o for o in opts if o.name == "ghost"), opts[0])


def saved_bytes(model: nn.Module, inputs: dict) -> int:
    """Bytes autograd saves for the backward during ``model(**inputs)`` (meta tensors are
    enough): each saved tensor's storage once, parameters left out."""
    params = {id(p) for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(t) not in params and id(base) not in params:
            storages[id(base)] = base.numel() * base.element_size()  # the graph keeps base alive: ids stay unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return sum(storages.values())


def gpt2_memory_floor(batch: int, seq: int, gram: str = "symmetric", goal: float = GOAL, **sizes) -> dict:
    """The flop floor and the memory-aware floor of each grouping of GPT-2 at (B, T).
    Non-private step memory (a model): the activations autograd saves for the backward
    (labels passed, so the loss's are counted) plus one float32 gradient per parameter,
    all taken as live at once; the budget is (goal - 1) times it."""
    model, s = _gpt2(sizes)
    inputs = {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta")}
    params = walk(model, inputs, batch)
    flops = floor(params, batch, gram, attention=(s["layers"], seq, s["embd"]))
    nonprivate_memory = saved_bytes(model, dict(inputs, labels=inputs["input_ids"])) + FLOAT * flops["parameters"]
    budget = (goal - 1) * nonprivate_memory
    out = dict(batch=batch, seq=seq, gram=gram, goal=goal, nonprivate=flops["nonprivate"],
               flop_ratio=flops["ratio"], ghost_ratio=flops["ghost_ratio"],
               nonprivate_memory=nonprivate_memory, budget=budget, sizes=s)
    for grouping in GROUPINGS:
        found = memory_floor(params, batch, budget, grouping, gram)
        out[grouping] = dict(
            floor_memory=config_memory(params, batch, grouping, cheapest, gram),
            ghost_memory=config_memory(params, batch, grouping, all_ghost, gram),
            found=found, ratio=None if found is None else (flops["nonprivate"] + found["extra"]) / flops["nonprivate"])
    return out


# ------------------------------------------------------------------ CLI


def parse_shape(text: str) -> tuple[int, int]:
    try:
        batch, seq = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: shape {text!r} is not BxT (for example 2x1024)") from None
    return batch, seq


def render(results: list[dict], per_layer: bool) -> str:
    g = 1e9
    lines = ["| B x T | non-private GFLOP | floor extra GFLOP | floor ratio | all-ghost extra GFLOP "
             "| all-ghost ratio |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['batch']} x {r['seq']} | {r['nonprivate'] / g:.1f} | {r['extra'] / g:.3f} "
                     f"| {r['ratio']:.4f}x | {r['ghost_extra'] / g:.1f} | {r['ghost_ratio']:.4f}x |")
    s = results[0]["sizes"]
    lines.append("")
    lines.append(f"GPT2LMHeadModel {s['layers']} layers, n_embd {s['embd']}, {s['heads']} heads, vocab "
                 f"{s['vocab']}, tied; {results[0]['parameters']:,} parameters (one Gaussian draw "
                 f"each per step, not counted); Gram count: {results[0]['gram']}")
    if per_layer:
        for r in results:
            lines += ["", f"B {r['batch']}, T {r['seq']}", "",
                      "| layer | n | weight | non-private GFLOP | ghost extra | instantiate extra "
                      "| floor picks | floor extra GFLOP | engine (all-layer / layer-wise) |",
                      "|---|---:|---|---:|---:|---:|---|---:|---|"]
            for row in r["layers"]:
                lines.append(f"| {row['kind']} | {row['count']} | {row['shape'] or '-'} | {row['nonprivate'] / g:.2f} "
                             f"| {row['ghost'] / g:.4f} | {row['instantiate'] / g:.4f} | {row['choice'] or '-'} "
                             f"| {row['extra'] / g:.4f} | {row['engine'] or '-'} |")
    return "\n".join(lines)


def picks_text(found: dict | None) -> str:
    """'kind: choice' for each weight (vectors always take the per-sample sum)."""
    if found is None:
        return "none fits"
    words = []
    for label, count, counts in found["picks"]:
        if counts != (("per-sample sum", count),):
            kind = label.rsplit(".", 1)[0].replace("transformer.h.*.", "")
            words.append(f"{kind} " + " + ".join(f"{name}" if n == count else f"{name} x{n}" for name, n in counts))
    return "; ".join(words)


def render_memory(results: list[dict]) -> str:
    mib = 2**20
    lines = [f"| B x T | non-private MiB (model) | budget MiB | flop floor | floor needs MiB (all-layer / layer-wise) "
             "| all-ghost needs MiB | memory-aware all-layer | memory-aware layer-wise | all-ghost |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cells = []
        for g in GROUPINGS:
            x = r[g]
            cells.append("none fits" if x["found"] is None else f"{x['ratio']:.4f}x ({x['found']['memory'] / mib:.0f} MiB)")
        lines.append(f"| {r['batch']} x {r['seq']} | {r['nonprivate_memory'] / mib:.0f} | {r['budget'] / mib:.0f} "
                     f"| {r['flop_ratio']:.4f}x | {r['all-layer']['floor_memory'] / mib:.0f} / "
                     f"{r['layer']['floor_memory'] / mib:.0f} | {r['all-layer']['ghost_memory'] / mib:.0f} / "
                     f"{r['layer']['ghost_memory'] / mib:.0f} | {cells[0]} | {cells[1]} | {r['ghost_ratio']:.4f}x |")
    lines.append("")
    for r in results:
        for g in GROUPINGS:
            lines.append(f"- {r['batch']} x {r['seq']}, {g}: {picks_text(r[g]['found'])}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", metavar="BxT", help="repeatable; default the four of the docs")
    ap.add_argument("--per-layer", action="store_true", help="a row per layer kind")
    ap.add_argument("--gram", choices=GRAMS, default="symmetric")
    ap.add_argument("--memory", action="store_true",
                    help="also the memory-aware floor of each grouping (step memory within --goal)")
    ap.add_argument("--goal", type=float, default=GOAL, help="step memory goal, x non-private")
    ap.add_argument("--json", metavar="FILE")
    for key, value in GPT2_SMALL.items():
        ap.add_argument(f"--{key}", type=int, default=value)
    args = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shape] if args.shape else list(SHAPES)
    sizes = {k: getattr(args, k) for k in GPT2_SMALL}
    results = [gpt2_floor(b, t, args.gram, **sizes) for b, t in shapes]
    print(render(results, args.per_layer))
    if args.memory:
        memory = [gpt2_memory_floor(b, t, args.gram, args.goal, **sizes) for b, t in shapes]
        print("\n" + render_memory(memory))
        for r, m in zip(results, memory):
            r["memory"] = {k: v for k, v in m.items() if k != "sizes"}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
