"""The engine's stash meter: bytes held for the backward's per-sample work (docs/engine.md)."""

from __future__ import annotations


class StashMeter:
    """Deterministic count of bytes held by the engine's stash (current and peak).

    Tensors are keyed by (device, data pointer, numel, dtype), so views of one tensor
    (and one activation feeding several layers) count once. This counts what the
    engine keeps alive, not process memory.
    """

    def __init__(self) -> None:
        self._refs: dict[tuple, list[int]] = {}
        self.current = 0
        self.peak = 0

    def add(self, tensors) -> None:
        for t in tensors:   # the key inline: hundreds of calls a step, on a GPU's host time
            key = (t.device, t.data_ptr(), t.numel(), t.dtype)
            ref = self._refs.get(key)
            if ref is None:
                nbytes = t.numel() * t.element_size()
                self._refs[key] = [1, nbytes]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            else:
                ref[0] += 1

    def remove(self, tensors) -> None:
        for t in tensors:
            key = (t.device, t.data_ptr(), t.numel(), t.dtype)
            ref = self._refs[key]
            ref[0] -= 1
            if ref[0] == 0:
                self.current -= ref[1]
                del self._refs[key]

    def reset_peak(self) -> None:
        self.peak = self.current
