"""The certificate's alone mode: each checked sample replayed alone (the cost of that sample's
forward and backward), its outputs alone checked against its outputs in the batch and its loss's
cotangent against its own rows; a random forward gets the sample's part of the recorded draws
(draws.py) or is found :class:`~dpclip.engine.certificate.replay.NotReproducible`. Every row's
outputs, not only the checked rows', are checked against the two halves of the batch replayed apart
(:func:`halves_independent`), and every row's loss cotangent against the other rows' losses
(:func:`loss_partitions`, :func:`losses_independent`)."""

from __future__ import annotations

import secrets
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from dpclip.engine.batch_axis.layout import CUT_BATCH_HINT
from dpclip.engine.certificate.draws import DrawsNotCut, Recorder, Substitute
from dpclip.engine.certificate.head import refuse_reads_past_outputs
from dpclip.engine.certificate.replay import (Forward, NotReproducible, Replayer, batch_axis, close,
                                              module_stack, select, vjp)
from dpclip.engine.certificate.state import State
from dpclip.engine.certificate.verdict import MIXING_HINT, NOT_COVERED, mixing_error, refuse_written_buffer
from dpclip.errors import EngineError


def alone_gradients(model: nn.Module, replayer: Replayer, forwards: list[Forward], rows: list[int], cots: dict,
                    rtol: float, buffers: State, outputs: bool = True, cut: bool = False,
                    halves: bool = False) -> dict[int, list[Tensor]]:
    """Each checked sample's gradient from replays on that sample alone (``replayer``'s, of
    ``model``); its outputs alone must be its outputs in the batch, and its loss's cotangent must
    vanish off its rows, and its replay must leave the model's state as the real forward on the
    whole batch left it (``buffers``: a write that depends on the batch is refused). ``cut``: the
    replays get the sample's part of the recorded random draws (draws.py); where that part does
    not reproduce the sample's outputs, :class:`NotReproducible`. ``halves``: every row's outputs
    checked too (:func:`halves_independent`). Every row's loss cotangent is checked too, where
    the first forward holds them (:func:`losses_independent`)."""
    own: dict[int, list[Tensor]] = {}
    axes: dict[tuple[int, int], int | None] = {}
    for r in rows:
        total = None
        for j, f in enumerate(forwards):
            leaves = replayer.leaves()
            outs = [o for o in alone_outputs(model, replayer, f, r, leaves, f.draws if cut else None, rtol)
                    if o.requires_grad][:len(f.outputs)]
            if len(outs) < len(f.outputs):
                if cut:
                    raise NotReproducible()
                raise mixing_error(model, replayer, f, r, "returns fewer tensors on one sample "
                                   "alone than in its batch", rtol)
            narrowed = []
            for k, (full, alone) in enumerate(zip(f.outputs, outs)):
                if all(cots[q][j][k] is None for q in cots):   # a returned tensor no loss uses (HF's batch-mean loss)
                    narrowed.append(None)
                    continue
                axis, cot = batch_axis(full, alone, f.batch), cots[r][j][k]
                axes[(j, k)] = axis
                if axis == "mixed":
                    if cot is not None and bool(cot.abs().max() > 0):
                        raise mixing_error(model, replayer, f, r, f"returns a tensor of shape "
                                           f"{tuple(full.shape)} whose rows cannot be attributed to samples "
                                           "(on one sample alone no single axis shrinks from B to 1: rows "
                                           "gathered across the batch?)", rtol)
                    narrowed.append(None)
                    continue
                if outputs and not close(full if axis is None else full.narrow(axis, r, 1), alone, rtol):
                    if cut:
                        raise NotReproducible()
                    raise mixing_error(model, replayer, f, r, f"gives sample {r} other outputs "
                                       "alone than in its batch", rtol)
                if cot is not None and axis is not None:
                    outside = cot.clone()
                    outside.narrow(axis, r, 1).zero_()
                    if bool(outside.abs().max() > rtol * max(float(cot.abs().max()), 1e-30)):
                        raise EngineError(
                            f"the loss of sample {r} depends on other samples' outputs (the per-sample "
                            "losses mix samples, e.g. a loss normalised over the batch)" + NOT_COVERED,
                            "compute each sample's loss from its own outputs only (reduction='none', "
                            "then each sample's tokens averaged)")
                    cot = cot.narrow(axis, r, 1)
                narrowed.append(cot)
            if cut:   # a backward that draws (gradient checkpointing recomputing dropout) draws
                with Recorder(lambda: False) as drawn:   # its own masks, not the sample's part
                    g = vjp(outs, narrowed, leaves, replayer.within(leaves))
                if drawn.draws != []:
                    raise NotReproducible()
            else:
                g = vjp(outs, narrowed, leaves, replayer.within(leaves))
            total = g if total is None else [a + b for a, b in zip(total, g)]
        refuse_written_buffer(buffers.after(f"sample {r} alone"))
        own[r] = total
    if forwards[0].loss_parts is not None:
        losses_independent(forwards[0].loss_parts, axes, rtol)
    if halves:
        halves_independent(model, replayer, forwards, cots, rtol, buffers)
    return own


#: partitions of the batch whose losses' cotangents are read for every row (a coupling of two rows
#: that no check watches escapes all of them with probability 2^-LOSS_PARTITIONS)
LOSS_PARTITIONS = 4


@dataclass
class LossParts:
    """What the losses' cotangents on the returned tensors say of every row, by partitions of the
    batch: for returned tensor (j, k) (the k-th tensor forward j returned) and each axis of it that
    could hold the batch, the per-row largest entry of the whole seed's cotangent (``scale``) and
    the per-row largest deviation of any partition's cotangent from the whole seed's masked to the
    partition (``off``). Reduced at once: no partition's cotangent is kept."""
    samples: int
    scale: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)
    off: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)


def _rows(t: Tensor, axis: int, samples: int) -> Tensor:
    return t.narrow(axis, 0, samples).movedim(axis, 0).reshape(samples, -1).double()


def read_cotangents(of: Callable[[Tensor, list[Forward]], list[list[Tensor | None]]], losses: Tensor, rows: list[int],
                    forwards: list[Forward], samples: int) -> dict[int, list[list[Tensor | None]]]:
    """Each checked row's loss cotangent on the forwards' returned tensors (``of``:
    :meth:`~dpclip.engine.certificate.replay.Cotangents.of`), and every row's, by halves, kept on the first
    forward for :func:`losses_independent` (:func:`loss_partitions`). The losses must read the model
    through those tensors only (:func:`~dpclip.engine.certificate.head.refuse_reads_past_outputs`)."""
    cots = {r: of(losses[r], forwards) for r in rows}
    if any(c is not None for r in rows for per in cots[r] for c in per):   # (none: refused by the caller)
        refuse_reads_past_outputs(losses, forwards)
    forwards[0].loss_parts = loss_partitions(lambda seed: of(seed, forwards), losses, samples)
    return cots


def loss_partitions(of: Callable[[Tensor], list[list[Tensor | None]]], losses: Tensor,
                    samples: int) -> LossParts | None:
    """The losses' cotangents (``of``: a scalar's cotangents on the returned tensors, as
    :meth:`~dpclip.engine.certificate.replay.Cotangents.of`) seeded with every real row and with the
    rows of each of :data:`LOSS_PARTITIONS` partitions drawn from OS entropy, reduced per row; None
    below two rows. Each is one backward from the losses to the returned tensors, not through the model."""
    if samples < 2:
        return None
    seed = torch.zeros(losses.shape[0], dtype=torch.bool)
    seed[:samples] = True
    whole, parts = of(losses[seed].sum()), LossParts(samples)
    rng = secrets.SystemRandom()
    for _ in range(LOSS_PARTITIONS):
        mask = torch.tensor([rng.random() < 0.5 for _ in range(samples)], dtype=torch.bool)
        seed[:samples] = mask
        cot = of(losses[seed].sum())
        for j, per in enumerate(whole):
            for k, w in enumerate(per):
                if w is None:
                    continue
                for axis in (a for a in range(w.dim()) if w.shape[a] == losses.shape[0]):
                    rows = _rows(w, axis, samples)
                    got = torch.zeros_like(rows) if cot[j][k] is None else _rows(cot[j][k], axis, samples)
                    want = torch.where(mask[:, None].to(rows.device), rows, torch.zeros_like(rows))
                    dev = (got - want).abs().amax(1)
                    key = (j, k, axis)
                    if key not in parts.off:   # the first partition: the whole seed's scale, once
                        parts.scale[key], parts.off[key] = rows.abs().amax(1), dev
                    else:
                        parts.off[key] = torch.maximum(parts.off[key], dev)
    return parts


def losses_independent(parts: LossParts, axes: dict[tuple[int, int], int | None], rtol: float) -> None:
    """Every real row's loss depends on its own rows of the returned tensors only: seeded with the
    losses of a partition's rows, the cotangent vanishes off those rows and equals the whole seed's on
    them (within ``rtol`` of the row's own). ``axes``: each returned tensor's batch axis (None:
    shared by all samples, not judged here). A loss normalised over the batch, or labels paired
    with another row's outputs, fails on the rows no check watches too."""
    for (j, k), axis in axes.items():
        key = (j, k, axis)
        if axis is None or key not in parts.off:
            continue
        bad = (parts.off[key] > rtol * parts.scale[key].clamp_min(1e-30)).nonzero()
        if bad.numel():
            raise EngineError(
                f"the loss of sample {int(bad[0])} depends on other samples' outputs, or other samples' losses "
                "on its outputs (the per-sample losses mix samples, e.g. a loss normalised over the batch, or "
                "labels paired with another row's outputs)" + NOT_COVERED,
                "compute each sample's loss from its own outputs only (reduction='none', "
                "then each sample's tokens averaged)")


def halves_independent(model: nn.Module, replayer: Replayer, forwards: list[Forward], cots: dict, rtol: float,
                       buffers: State) -> None:
    """Every row's outputs, not only the checked rows': the batch is replayed as the two halves of
    a partition drawn from OS entropy, and each half's outputs must be its rows' outputs in the
    batch (each half's replay leaving the state as the real forward did). A coupling that reaches
    rows no check watches (missing values filled with the batch's mean, only in the rows that miss
    them) moves them. One batch forward in all, no backward; for a forward without random draws."""
    batch = forwards[0].batch
    if batch < 2:
        return
    order = torch.tensor(secrets.SystemRandom().sample(range(batch), batch))
    for half in (order[:batch // 2].sort().values, order[batch // 2:].sort().values):
        for j, f in enumerate(forwards):
            outs = _rows_outputs(replayer, f, half)
            if outs is None:
                raise mixing_error(model, replayer, f, int(half[0]), f"fails on {len(half)} of its {batch} "
                                   "samples without the others", rtol)
            for k, (full, part) in enumerate(zip(f.outputs, outs)):
                if all(cots[q][j][k] is None for q in cots):   # (a returned tensor no loss uses)
                    continue
                moved = [a for a in range(full.dim()) if part.dim() == full.dim() and full.shape[a] != part.shape[a]]
                if full.shape != part.shape and (len(moved) != 1 or part.shape[moved[0]] != len(half)):
                    continue   # (rows gathered across the batch: judged on the checked rows)
                axis = moved[0] if moved else None
                ours = full if axis is None else full.index_select(axis, half.to(full.device))
                if not close(ours, part, rtol):
                    row = int(half[0]) if axis is None else int(half[_worst_row(ours, part, axis)])
                    raise mixing_error(model, replayer, f, row, f"gives sample {row} other outputs in half of "
                                       "its batch than in the whole batch", rtol)
        refuse_written_buffer(buffers.after("half of the batch"))


def _rows_outputs(replayer: Replayer, forward: Forward, rows: Tensor) -> list[Tensor] | None:
    """The tensors ``forward`` returns replayed on its ``rows`` (every input of leading size B cut,
    or the first only), detached; None where neither runs."""
    for first_only in (False, True):
        try:
            out = replayer.run(forward, select(forward.args, forward.kwargs, forward.batch, rows, first_only),
                               replayer.leaves())
            return [o.detach() for o in out if o.requires_grad][:len(forward.outputs)]
        except EngineError:
            raise
        except Exception:
            continue
    return None


def _worst_row(a: Tensor, b: Tensor, axis: int) -> int:
    """The index along ``axis`` where ``a`` and ``b`` differ most (a non-finite difference first)."""
    diff = (a.double() - b.double()).abs().movedim(axis, 0).reshape(a.shape[axis], -1)
    return int(torch.nan_to_num(diff, nan=float("inf")).amax(1).argmax())


def alone_outputs(model: nn.Module, replayer: Replayer, forward: Forward, r: int, leaves: list[Tensor],
                  draws: list[Tensor] | None = None, rtol: float = 0.0) -> list[Tensor]:
    """The tensors ``forward`` returns replayed on sample ``r`` alone (its inputs cut to row
    ``r``: every input of leading size B, or the first only), with sample ``r``'s part of
    ``draws`` (a draw's probabilities must be the sample's own, within ``rtol``); an EngineError
    naming the module that fails on one sample alone."""
    errors = []
    for first_only in (False, True):
        inputs = select(forward.args, forward.kwargs, forward.batch, torch.tensor([r]), first_only)
        try:
            with Substitute(draws, r, forward.batch, forward.draw_calls, rtol) if draws is not None \
                    else nullcontext() as sub:
                out = replayer.run(forward, inputs, leaves)
            if sub is not None and sub.next != len(draws):
                raise DrawsNotCut()
            return out
        except EngineError:
            raise
        except DrawsNotCut as exc:
            raise NotReproducible() from exc
        except Exception as exc:   # the inputs cut to one row do not fit: the first only
            errors.append((exc, inputs))
    exc, inputs = errors[0]
    failed_in = None
    try:   # once more, to see where it fails
        with module_stack(model) as stack:
            replayer.run(forward, inputs, leaves)
    except Exception:
        failed_in = stack[-1] if len(stack) > 1 else None
    if failed_in is not None:
        name = next((n for n, m in model.named_modules() if m is failed_in), "")
        raise EngineError(f"module {name or '<root>'} ({type(failed_in).__name__}) mixes samples: it fails on "
                          f"one sample alone ({type(exc).__name__}: {exc}), so its output depends on the "
                          "rest of the batch; a per-sample gradient, and so the privacy guarantee, would "
                          "not hold" + NOT_COVERED, MIXING_HINT) from exc
    last = errors[-1][0]
    raise EngineError(f"the certificate could not run the model's forward on sample {r} alone "
                      f"({type(last).__name__}: {last})" + NOT_COVERED,
                      CUT_BATCH_HINT + " (docs/layer-rules.md, \"The batch axis\")") from last
