"""The random draws of a checked forward, recorded, and handed to each sample's replay alone.

Dropout draws one mask for the whole batch; replayed on one sample alone from the same RNG
state, the forward would draw other masks, so a random forward used to be checked by replaying
the whole batch (the cost of a batch per check, not of the checked samples). Instead, while a
checked forward runs, :class:`Recorder` keeps the output of every operation that only draws
random numbers (``bernoulli_``, ``rand``, ``randn``, …: what dropout, drop-path and noise
layers compute their masks with on the CPU). A replay on sample r alone then gets, draw by
draw, the recorded draw's part that belongs to sample r (:class:`Substitute`): the slice of the
one axis that went from B·k to k. Each checked sample costs one forward and one backward of
that sample alone, random or not.

What cannot be cut so is not guessed at: a seeded operation that also computes with its inputs
(CUDA's fused ``native_dropout``, a fused attention kernel's dropout), a draw whose shapes do not
match, or a replay whose outputs differ from the sample's outputs in the batch raises
:class:`~dpclip.engine.certificate.NotReproducible`, and the check replays the whole batch as
before.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dpclip.engine.certificate.replay import close, rng_state, same_rng, set_rng
from dpclip.engine.certificate.verdict import NOT_COVERED
from dpclip.errors import EngineError
from dpclip.torch_compat import TorchDispatchMode, tree_flatten, tree_unflatten

#: operations whose output is random numbers and nothing else (no gradient flows through them)
PURE_DRAWS = frozenset({
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
    "randperm", "uniform_", "normal_", "exponential_", "random_", "geometric_", "log_normal_", "cauchy_",
    "multinomial",
})


class DrawsNotCut(Exception):
    """A draw of the replay cannot be matched to a recorded draw."""


def _values_read(func, args: tuple) -> list[Tensor]:
    """The tensors whose values a pure draw computes with: the probabilities of ``bernoulli(p)``,
    ``bernoulli_(p)`` and ``multinomial(p)``. An in-place draw's own tensor, a ``*_like`` draw's
    template and ``bernoulli(x, p=0.5)``'s ``x`` give it only a shape."""
    name = func.overloadpacket.__name__
    skip_first = name.endswith("_") or name.endswith("_like") or func._overloadname == "p"
    return [a for a in args[1 if skip_first else 0:] if isinstance(a, Tensor)]


def _pure(func) -> bool:
    return func.overloadpacket.__name__ in PURE_DRAWS


def _seeded(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class Recorder(TorchDispatchMode):
    """Active during one checked forward: keeps each pure draw's value (``draws``), or marks the
    forward as not recordable (``draws`` None). ``skip()`` true: the engine's own probes and
    replays, whose draws are not the step's."""

    def __init__(self, skip: Callable[[], bool]):
        super().__init__()
        self.skip = skip
        self.draws: list[Tensor] | None = []
        self.calls: list[tuple] = []   # each draw's operation and arguments (copied before it ran)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        recorded = self.draws is not None and _seeded(func) and not self.skip()
        call = (func, _copied(args), _copied(kwargs or {})) if recorded and _pure(func) else None
        out = func(*args, **(kwargs or {}))
        if recorded:
            if call is not None and isinstance(out, Tensor):
                self.draws.append(out.detach().clone())
                self.calls.append(call)
            else:
                self.draws = None
        return out

    def follows(self, start: tuple, end: tuple, devices: list[int]) -> bool:
        """Whether the recorded draws are the RNG stream's own from the forward's ``start`` state,
        leaving it at ``end``. A forward that reseeds torch's generator (from its batch, say) draws
        masks that depend on other samples, which no replay of one sample alone can see; the batch
        mode's replacement of a sample then can (batch.py)."""
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            set_rng(start)
            for (func, args, kwargs), drawn in zip(self.calls, self.draws or []):
                if not torch.equal(func(*_copied(args), **_copied(kwargs)), drawn):
                    return False
            return same_rng(rng_state(devices), end)


def _copied(tree):
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([t.detach().clone() if isinstance(t, Tensor) else t for t in leaves], spec)


def _cut(recorded: Tensor, shape: torch.Size, row: int, batch: int) -> Tensor:
    """The part of a batch's draw that belongs to sample ``row``, for a draw of ``shape`` alone."""
    if recorded.shape == shape:
        return recorded
    if recorded.dim() != len(shape):
        raise DrawsNotCut()
    moved = [k for k in range(len(shape)) if recorded.shape[k] != shape[k]]
    if len(moved) != 1 or recorded.shape[moved[0]] != batch * shape[moved[0]]:
        raise DrawsNotCut()
    axis = moved[0]
    return recorded.narrow(axis, row * shape[axis], shape[axis])


class Substitute(TorchDispatchMode):
    """Active during a replay on sample ``row`` alone: each pure draw returns, in order, sample
    ``row``'s part of the recorded draw; any other seeded operation, a draw too many or a shape
    that does not fit raises :class:`DrawsNotCut`. ``calls`` (the recorded draws' operations and
    arguments): a draw that computes with probabilities must have been handed sample ``row``'s
    own, within ``rtol``; probabilities taken over the batch (``bernoulli(sigmoid(h.mean(0)))``)
    make every sample's mask depend on every other sample, which the recorded outcome alone hides:
    an EngineError."""

    def __init__(self, draws: list[Tensor], row: int, batch: int, calls: list[tuple] | None = None,
                 rtol: float = 0.0):
        super().__init__()
        self.draws, self.row, self.batch, self.next = draws, row, batch, 0
        self.calls, self.rtol = calls, rtol

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _seeded(func):
            return out
        if not _pure(func) or not isinstance(out, Tensor) or self.next >= len(self.draws):
            raise DrawsNotCut()
        part = _cut(self.draws[self.next], out.shape, self.row, self.batch)
        if self.calls is not None:
            self._own_probabilities(func, args, self.calls[self.next])
        self.next += 1
        with torch.no_grad():
            out.copy_(part)
        return out

    def _own_probabilities(self, func, args: tuple, recorded: tuple) -> None:
        _, recorded_args, _ = recorded
        for alone, in_batch in zip(_values_read(func, args), _values_read(func, recorded_args)):
            own = _cut(in_batch, alone.shape, self.row, self.batch)
            if not close(own.double(), alone.detach().double(), self.rtol):
                raise EngineError(
                    f"the model's forward mixes samples: a random draw ({func.overloadpacket.__name__}) gets "
                    f"other probabilities for sample {self.row} in its batch than on that sample alone, so "
                    "each sample's random mask depends on the other samples; a per-sample gradient, and so "
                    "the privacy guarantee, would not hold" + NOT_COVERED,
                    "draw each sample's mask from that sample's own values (or from constants): "
                    "no probabilities computed over the batch (docs/certificate.md)")
