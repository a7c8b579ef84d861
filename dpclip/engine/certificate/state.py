"""The model's state during the certificate's check: every buffer and every frozen parameter
(``requires_grad`` False), looked up by name (owner module and key) each time, so that a buffer
reassigned by the forward (``self.stat = ...``) is seen as written and can be undone.

A forward may write its state only in a way that does not depend on the batch (spectral_norm's
power iteration, a step counter ``+= 1``, a cache sized by the sequence length): each replay of a
checked sample alone must leave the state exactly as the real forward on the whole batch left it
(:meth:`State.after`). Where samples cannot be replayed alone (a micro-batch of one row, a random
forward replayed on the batch), a forward that wrote its state is replayed once more with every
row's inputs set to zeros, to ones, and with one row more (:func:`writes_checked`). Buffers are
saved by value; frozen parameters by a fingerprint only (a frozen base model is as large as the
model: no copy of it), so a forward that writes one is refused without replays.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

from dpclip.engine.certificate.replay import Forward, Replayer, equal_values
from dpclip.engine.certificate.verdict import refuse_written_buffer, refuse_written_parameter, refuse_unchecked_write
from dpclip.torch_compat import saved_buffers, tensor_version, tree_flatten, tree_unflatten

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: Tensor) -> Tensor:
    """Exact integer sums of ``t``'s bit patterns (all entries, every other entry): any write
    that changes an entry changes them (short of a compensating write)."""
    bits = t.detach().contiguous().reshape(-1)
    if bits.dtype.is_complex:
        bits = torch.view_as_real(bits).reshape(-1)
    bits = bits.view(torch.uint8) if bits.dtype == torch.bool else bits.view(_INTS[bits.element_size()])
    return torch.stack([bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64)]).cpu()


@dataclass(eq=False)
class Slot:
    """One entry of the model's state: ``owner.<kind>[key]`` (kind ``_buffers`` or ``_parameters``)."""

    owner: nn.Module
    kind: str
    key: str
    tensor: Tensor | None     # the object the entry held
    value: Tensor | None      # its values (a buffer's), or its fingerprint (a frozen parameter's)


def _entries(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, str, Tensor | None]]:
    """(name, owner, kind, key, tensor) of each buffer and frozen parameter the model holds now."""
    for prefix, m in model.named_modules():
        for kind in ("_buffers", "_parameters"):
            for key, t in getattr(m, kind).items():
                if kind == "_buffers" or t is not None and not t.requires_grad:
                    yield (f"{prefix}.{key}" if prefix else key), m, kind, key, t


def saved_buffer_versions(modules: list[tuple[str, nn.Module]]) -> dict[str, tuple[int, int]]:
    """Each persistent buffer (saved with the weights) of ``modules`` (the model's named modules) by
    name: (the object, its in-place write count). Read on the host, no device sync: cheap enough for
    every training forward. A write in place or by reassignment moves it, so the writes of forwards
    the certificate does not check are seen too; one through ``.data`` or a numpy view does not
    (torch counts no version there): only a checked forward's replay sees those."""
    return {(f"{prefix}.{key}" if prefix else key): (id(t), tensor_version(t))
            for prefix, m in modules for key, t in saved_buffers(m)}


def buffer_versions(modules: list[tuple[str, nn.Module]]) -> dict[str, tuple[int, int]]:
    """Like :func:`saved_buffer_versions`, for every buffer (a non-persistent one too): what a forward
    the certificate does not check may write only where a checked forward wrote too."""
    return {(f"{prefix}.{key}" if prefix else key): (id(t), tensor_version(t))
            for prefix, m in modules for key, t in m.named_buffers(recurse=False)}


def snapshot(model: nn.Module) -> dict[str, Slot]:
    """The model's state now, by name: buffers with their values, frozen parameters with a fingerprint."""
    return {n: Slot(m, kind, key, t, None if t is None else t.detach().clone() if kind == "_buffers"
                    else fingerprint(t)) for n, m, kind, key, t in _entries(model)}


def _same(a: Slot | None, b: Slot | None) -> bool:
    """Whether two snapshots of one name hold the same tensor object with the same values."""
    if a is None or b is None:
        return a is b
    if a.tensor is None or b.tensor is None:
        return a.tensor is b.tensor
    return a.tensor is b.tensor and a.kind == b.kind and equal_values(a.value, b.value)


class State:
    """The model's state as the checked forward found it (``start``, its entry's snapshot; else as
    it is now) and as it left it (``final``). Each replay starts from the entry state; after it,
    :meth:`after` compares the state with the real forward's and puts the entry state back; at the
    end, the state is left as the real forward left it. ``compare`` False: replays whose writes
    are not theirs to judge (a float64 reference's, its buffers swapped for copies)."""

    def __init__(self, model: nn.Module, start: dict[str, Slot] | None = None, compare: bool = True):
        self.model, self.compare = model, compare
        self.final = snapshot(model)
        self.before = start if start is not None else self.final
        names = list(self.before) + [n for n in self.final if n not in self.before]
        #: the names the real forward wrote (values, the object held, or the name added or removed)
        self.written = [n for n in names if not _same(self.before.get(n), self.final.get(n))]
        if compare:
            for n in self.written:
                slot = self.before.get(n) or self.final[n]
                if slot.kind == "_parameters":
                    refuse_written_parameter(n)
        self.restore()

    def after(self, what: str) -> str | None:
        """The name of an entry this replay (``what``) left otherwise than the real forward did,
        with what did it, or None; the entry state is put back either way."""
        found = None
        if self.compare:
            now = snapshot(self.model)
            for n in list(self.final) + [n for n in now if n not in self.final]:
                if not _same(self.final.get(n), now.get(n)):
                    kind = (self.final.get(n) or now[n]).kind
                    found = f"{'buffer' if kind == '_buffers' else 'frozen parameter'} {n} ({what} leaves it " \
                            "otherwise than the real forward on the batch did)"
                    break
        self.restore()
        return found

    def restore(self, final: bool = False) -> None:
        """Put the entry state back (``final``: the real forward's): each name's object into its
        owner, with its saved values; a name the forward added is removed."""
        target = self.final if final else self.before
        with torch.no_grad():
            for n, owner, kind, key, _ in list(_entries(self.model)):
                if n not in target:
                    del getattr(owner, kind)[key]
            for slot in target.values():
                held = getattr(slot.owner, slot.kind)
                if held.get(slot.key) is not slot.tensor:
                    held[slot.key] = slot.tensor
                if slot.kind == "_parameters" or slot.tensor is None:
                    continue   # a frozen parameter is never written (refused before any replay)
                if slot.tensor.shape == slot.value.shape and slot.tensor.dtype == slot.value.dtype:
                    if not equal_values(slot.tensor, slot.value):   # (no version bump where nothing changed)
                        slot.tensor.copy_(slot.value)
                else:
                    slot.tensor.set_(slot.value.clone())


@contextmanager
def state_kept(model: nn.Module, start: dict[str, Slot] | None = None, compare: bool = True) -> Iterator[State]:
    state = State(model, start, compare)
    try:
        yield state
    finally:
        state.restore(final=True)


def _filled(args: tuple, kwargs: dict, batch: int, how: str):
    """The inputs with every tensor of leading size ``batch`` set to zeros or ones, or with its
    first row appended (``how``: "zeros", "ones", "one more row")."""
    leaves, spec = tree_flatten((args, kwargs))
    out = []
    for t in leaves:
        if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == batch:
            t = t.detach()
            t = torch.zeros_like(t) if how == "zeros" else torch.ones_like(t) if how == "ones" else \
                torch.cat([t, t[:1]])
        out.append(t)
    return tree_unflatten(out, spec)


def writes_checked(replayer: Replayer, forwards: list[Forward], state: State) -> None:
    """Where samples cannot be replayed alone: a forward that wrote its state is replayed from the
    entry state with every row's inputs set to zeros, then to ones (two, so that a row equal to
    one of them cannot hide), then with one row more (a count of rows); each must leave the state
    as the real forward did. Nothing is replayed for a forward that wrote nothing."""
    if not state.written or not state.compare:
        return
    batch = forwards[0].batch
    for how in ("zeros", "ones", "one more row"):
        state.restore()
        try:
            for f in forwards:
                replayer.run(f, _filled(f.args, f.kwargs, f.batch, how), replayer.leaves())
        except Exception as exc:
            state.restore()
            refuse_unchecked_write(state.written[0], batch, f"{type(exc).__name__}: {exc}")
        rows = "its row's" if batch == 1 else f"its {batch} rows'"
        what = f"the batch with {rows} inputs set to {how}" if how != "one more row" else \
            f"the batch with one row more ({batch + 1} rows)"
        refuse_written_buffer(state.after(what), batch)
