"""The certificate's batch mode: a random forward whose draws cannot be cut per sample
(draws.py) is replayed on the whole batch from the same RNG state, the same masks then drawn
again; sample independence is checked by replaying it with one checked sample replaced. Where
the step itself cannot be reproduced so (a layer rule drawing in another order than the module),
the plain forward is checked against itself in training mode (:func:`checked_before_eval_mode`)
before dry.py checks the sums in eval mode."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dpclip.engine.certificate.alone import alone_gradients
from dpclip.engine.certificate.replay import (NotReproducible, Replayer, close, replaying, rng_state, same_rng, select,
                                              vjp_rows)
from dpclip.engine.certificate.state import State, state_kept, writes_checked
from dpclip.engine.certificate.verdict import MIXING_HINT, NOT_COVERED, mixing_error, refuse_written_buffer
from dpclip.errors import EngineError


def batch_gradients(cert, forwards, rows, cots, rtol, outputs: bool = True) -> dict[int, list[Tensor]]:
    """Each checked row's gradient from one replay of the whole batch (the same random draws)."""
    own: dict[int, list[Tensor] | None] = {r: None for r in rows}
    for j, f in enumerate(forwards):
        leaves = cert.replayer.leaves()
        outs = [o for o in cert.replayer.run(f, (f.args, f.kwargs), leaves) if o.requires_grad]
        if len(outs) != len(f.outputs) or outputs and not all(close(a, b, rtol) for a, b in zip(f.outputs, outs)):
            raise NotReproducible()
        f.replayed_rng = rng_state(cert._devices)
        for r, g in vjp_rows(outs, {r: cots[r][j] for r in rows}, leaves, cert.replayer.within(leaves)).items():
            own[r] = g if own[r] is None else [a + b for a, b in zip(own[r], g)]
    return own


def _moved(got: list[Tensor], own: list[Tensor], rtol: float) -> bool:
    """Whether ``got`` differs from ``own`` (one row's gradient, per parameter) beyond ``rtol`` of its norm."""
    scale = math.sqrt(sum(float(x.double().square().sum()) for x in own))
    err = math.sqrt(sum(float((a - b).double().square().sum()) for a, b in zip(got, own)))
    return err > rtol * max(scale, 1e-30)


def independent_in_batch(cert, forwards, rows, cots, own, rtol, buffers: State) -> None:
    """The batch replayed with the last checked row replaced by the first: the other checked
    rows' gradients must not move; each replay must leave the model's state as the real forward
    did, and a forward that wrote its state is replayed on other inputs too (:func:`writes_checked`:
    no sample can be replayed alone here, a micro-batch of one row among them); then each checked
    row's gradient in a batch of copies of its own sample (:func:`_alone_among_copies`)."""
    refuse_written_buffer(buffers.after("the batch"), forwards[0].batch)
    writes_checked(cert.replayer, forwards, buffers)
    if len(rows) < 2:
        _alone_among_copies(cert, forwards, rows, cots, own, rtol, buffers)
        return
    j, source = rows[-1], rows[0]
    moved = {r: None for r in rows[:-1]}
    rng_moved: list = []   # forwards whose replay with sample j replaced left another RNG state
    for i, f in enumerate(forwards):
        leaves = cert.replayer.leaves()
        outs = [o for o in cert.replayer.run(f, select(f.args, f.kwargs, f.batch, None, False, (j, source)),
                                             leaves) if o.requires_grad][:len(f.outputs)]
        if f.replayed_rng is not None and not same_rng(rng_state(cert._devices), f.replayed_rng):
            rng_moved.append(f)
        for r, g in vjp_rows(outs, {r: cots[r][i] for r in moved}, leaves, cert.replayer.within(leaves)).items():
            moved[r] = g if moved[r] is None else [a + b for a, b in zip(moved[r], g)]
    refuse_written_buffer(buffers.after(f"the batch with sample {j} replaced"), forwards[0].batch)
    for r, g in moved.items():
        if _moved(g, own[r], rtol):
            raise mixing_error(cert.model, cert.replayer, forwards[0], r, f"changes sample {r}'s gradient "
                               f"when sample {j} is replaced", rtol, replace=(j, source))
    for f in rng_moved:
        _refuse_rng_following_the_batch(cert, f, j, buffers)
    _alone_among_copies(cert, forwards, rows, cots, own, rtol, buffers)


def _refuse_rng_following_the_batch(cert, f, j: int, buffers: State) -> None:
    """The RNG state a forward left moved with sample ``j`` replaced: refused unless the batch's
    own replay does not leave one state either (the forward reseeds from OS entropy, as Reformer's
    reversible layers do with ``torch.seed()``: then the state follows no sample)."""
    buffers.restore()
    with torch.no_grad():
        cert.replayer.run(f, (f.args, f.kwargs), cert.replayer.leaves())
    if same_rng(rng_state(cert._devices), f.replayed_rng):
        raise EngineError(f"the random state the model's forward leaves depends on its batch (it moves when "
                          f"sample {j} is replaced): the forward reseeds torch's generator from its inputs, or "
                          "draws as many numbers as its inputs say (RReLU in training on the CPU), so its own or "
                          "the next forward's masks depend on other samples" + NOT_COVERED,
                          "draw from torch's generator as it stands, a number of draws fixed by the shapes "
                          "(nn.Dropout; nn.LeakyReLU for nn.RReLU); never seed it from the data")


def checked_before_eval_mode(cert, forwards, rows, cots, rtol, buffers: State) -> None:
    """What can be checked in training mode of a step the replay cannot reproduce, before its
    sums are checked in eval mode (dry.py), which cannot see what a forward does in training mode
    only (batch statistics, a buffer written): the plain forward, replayed twice from the step's
    RNG state, gives each checked row the same gradient (else it draws from a generator the
    replay does not restore), and the batch's replays of :func:`independent_in_batch` move none."""
    buffers.restore()
    own = batch_gradients(cert, forwards, rows, cots, rtol, outputs=False)
    buffers.restore()
    again = batch_gradients(cert, forwards, rows, cots, rtol, outputs=False)
    for r in rows:
        if _moved(again[r], own[r], rtol):
            raise EngineError(f"the model's forward draws random numbers the engine cannot replay: two replays from "
                              f"the step's random state give sample {r} different gradients, so its clipping cannot "
                              "be checked against its own gradient" + NOT_COVERED,
                              "draw random numbers from torch's default generator (torch.rand, torch.randn, "
                              "torch.bernoulli, nn.Dropout; no generator= of its own, no numpy or Python random "
                              "in the forward), or augment the data in the dataset instead")
    independent_in_batch(cert, forwards, rows, cots, own, rtol, buffers)


def _alone_among_copies(cert, forwards, rows, cots, own, rtol, buffers: State) -> None:
    """Each checked row's gradient, replayed from the step's RNG state in a batch of copies of its own
    sample, must not move. One sample replaced shows a coupling only with that sample: a checked row
    coupled to a row no check watches (rows 1 and 2 swapped, `h + h[perm].detach()`) shows here, in
    batch mode (a random forward's replay alone differs whether its draws or its samples mix) as in
    eval mode, whose dry micro-batch never compares the engine's training-mode sums (a custom
    autograd.Function's backward combining rows in training only leaves every output as it was)."""
    for r in rows:
        copies, got = torch.full((forwards[0].batch,), r, dtype=torch.long), None
        for i, f in enumerate(forwards):
            leaves = cert.replayer.leaves()
            outs = [o for o in cert.replayer.run(f, select(f.args, f.kwargs, f.batch, copies, False), leaves)
                    if o.requires_grad][:len(f.outputs)]
            g = vjp_rows(outs, {r: cots[r][i]}, leaves, cert.replayer.within(leaves))[r]
            got = g if got is None else [a + b for a, b in zip(got, g)]
        buffers.restore()
        if _moved(got, own[r], rtol):   # (no module named: an alone replay differs by its masks anyway)
            raise EngineError(f"the model ({type(cert.model).__name__}) mixes samples: it changes sample {r}'s "
                              "gradient when every other sample is replaced by a copy of it; a per-sample gradient, "
                              "and so the privacy guarantee, would not hold" + NOT_COVERED,
                              MIXING_HINT + "; a custom autograd.Function's backward, or a backward hook, must not "
                              "combine the rows of the batch either, in training mode as in eval mode")


def float64_gradient(cert, forwards, r: int, cots: dict, batch_mode: bool, rtol: float) -> list[Tensor] | None:
    """Row ``r``'s gradient replayed in float64 (for a float32 model outside autocast), or None
    where that reference cannot be had (autocast, a float64 model, a forward that fails in
    float64, random draws that float64 does not reproduce); ``rtol``: float32's bound."""
    if any(enabled for f in forwards for enabled, _, _ in f.autocast.values()) or \
            any(p.dtype != torch.float32 for p in cert.params):
        return None
    plain32, cert.replayer = cert.replayer, Replayer(cert.model, cert.names, cert.params, torch.float64)
    try:
        with replaying(cert.model, cert.plain, cert._devices), \
                state_kept(cert.model, forwards[0].buffers, compare=False) as buffers:
            # the outputs are not compared again: float32's own rounding of them is what this measures
            if batch_mode:
                got = batch_gradients(cert, forwards, [r], cots, rtol, outputs=False)[r]
            else:
                got = alone_gradients(cert.model, cert.replayer, forwards, [r], cots, rtol, buffers,
                                      outputs=False, cut=any(f.random for f in forwards))[r]
        return [g.double() for g in got]
    except (NotReproducible, EngineError, RuntimeError, TypeError, ValueError):
        return None
    finally:
        cert.replayer = plain32
