"""The certificate's batch mode: a random forward whose draws cannot be cut per sample
(draws.py) is replayed on the whole batch from the same RNG state, the same masks then drawn
again; sample independence is checked by replaying it with one checked sample replaced."""

from __future__ import annotations

import math

from torch import Tensor

from dpclip.engine.certificate.replay import Buffers, NotReproducible, close, select, vjp_rows
from dpclip.engine.certificate.verdict import mixing_error, refuse_written_buffer


def batch_gradients(cert, forwards, rows, cots, rtol, outputs: bool = True) -> dict[int, list[Tensor]]:
    """Each checked row's gradient from one replay of the whole batch (the same random draws)."""
    own: dict[int, list[Tensor] | None] = {r: None for r in rows}
    for j, f in enumerate(forwards):
        leaves = cert.replayer.leaves()
        outs = [o for o in cert.replayer.run(f, (f.args, f.kwargs), leaves) if o.requires_grad]
        if len(outs) != len(f.outputs) or outputs and not all(close(a, b, rtol) for a, b in zip(f.outputs, outs)):
            raise NotReproducible()
        for r, g in vjp_rows(outs, {r: cots[r][j] for r in rows}, leaves, cert.replayer.within(leaves)).items():
            own[r] = g if own[r] is None else [a + b for a, b in zip(own[r], g)]
    return own


def independent_in_batch(cert, forwards, rows, cots, own, rtol, buffers: Buffers) -> None:
    """The batch replayed with the last checked row replaced by the first: the other checked
    rows' gradients must not move, nor may the buffers differ."""
    if len(rows) < 2:
        return
    refuse_written_buffer(buffers.after("the batch"))
    j, source = rows[-1], rows[0]
    moved = {r: None for r in rows[:-1]}
    for i, f in enumerate(forwards):
        leaves = cert.replayer.leaves()
        outs = [o for o in cert.replayer.run(f, select(f.args, f.kwargs, f.batch, None, False, (j, source)),
                                             leaves) if o.requires_grad][:len(f.outputs)]
        for r, g in vjp_rows(outs, {r: cots[r][i] for r in moved}, leaves, cert.replayer.within(leaves)).items():
            moved[r] = g if moved[r] is None else [a + b for a, b in zip(moved[r], g)]
    refuse_written_buffer(buffers.after(f"the batch with sample {j} replaced"))
    for r, g in moved.items():
        scale = math.sqrt(sum(float(x.double().square().sum()) for x in own[r]))
        err = math.sqrt(sum(float((a - b).double().square().sum()) for a, b in zip(g, own[r])))
        if err > rtol * max(scale, 1e-30):
            raise mixing_error(cert.model, cert.replayer, forwards[0], r, f"changes sample {r}'s gradient "
                               f"when sample {j} is replaced", rtol, replace=(j, source))
