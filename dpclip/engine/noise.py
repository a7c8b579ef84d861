"""Noise allocation over groups, the joint noise multiplier, and the noise generator.

Allocation (docs/engine.md; adaptive-per-layer paper's noise allocation): scale group k by
1/w_k, so the concatenated clipped sum has L2 sensitivity S = sqrt(Σ_k C_k²/w_k²); add
N(0, (σ_g·S)²) to every coordinate of it; scale back. Group k therefore gets

    N(0, (σ_g · S · w_k)² I)  on its summed clipped gradient,

    global        w_k = 1            (S = sqrt(Σ C_k²): the same std everywhere)
    equal-budget  w_k = C_k          (S = sqrt(K): group k's noise depends on C_k only, so a
                                      pipeline stage can noise its own groups alone)
    weighted      w_k = C_k/sqrt(d_k) (equal signal-to-noise per coordinate; d_k = size)

Each is one Gaussian mechanism of multiplier σ_g on sensitivity S, so the privacy cost
does not depend on the allocation.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch
from torch import Tensor

from dpclip.accounting import joint_noise_multiplier
from dpclip.errors import AccountingError, EngineError
from dpclip.rng import private_generator, refill_from_entropy, split_generator
from dpclip.torch_compat import foreach_add_, foreach_mul_

# A CPU draw of at least this many elements is split into STREAMS streams drawn in
# parallel (benchmarks/README.md, "What was changed for GPT-2 small"): torch's CPU normal_ runs on one core
# with one generator, about 7 ns per element here (0.8 s for GPT-2 small's 124M). Below it
# (about 30 ms of drawing) one generator draws everything, in parameter order, small
# tensors packed into one draw as on a GPU (:func:`_add_drawn_packed`): a small model's
# 100-odd parameters would otherwise cost three tensor operations each a step.
SPLIT_MIN_NUMEL = 1 << 22
# A constant, not the thread count: a seeded run draws the same noise on any machine.
STREAMS = 8
# Elements drawn per normal_ call when noise is added in place (4 MiB of float32 scratch).
CHUNK = 1 << 20


# On a GPU: elements per draw (64 MiB of float32 scratch), and small tensors are packed into
# one draw. Each normal_ and add_ is a kernel launch, and GPT-2 small's 148 gradients in
# 1 MiB pieces took about 300 launches, 5.7 ms of host time per step on an H200 where the
# draw itself needs well under one (benchmarks/README.md, "GPU: the first run").
DEVICE_CHUNK = 1 << 24
# A packed draw is scaled by one multiply per span of tensors with one std, up to this many
# spans (more: one multi-tensor multiply, which on a GPU takes few launches); None: any
# number (on the CPU a multi-tensor multiply is a loop over the tensors).
MAX_SCALED_SPANS: dict[str, int | None] = {"cpu": None}
MAX_SCALED_SPANS_DEFAULT = 8


def _add_drawn(flat: Tensor, std: float, generator: torch.Generator, chunk: int = CHUNK) -> None:
    """flat += N(0, std²), drawn with ``generator`` in pieces of ``chunk`` elements."""
    scratch = torch.empty(min(chunk, flat.numel()), device=flat.device, dtype=flat.dtype)
    for lo in range(0, flat.numel(), chunk):
        piece = flat[lo:lo + chunk]
        piece.add_(scratch[:piece.numel()].normal_(0.0, std, generator=generator))


def _add_drawn_packed(flats: list[Tensor], stds: list[float], generator: torch.Generator,
                      chunk: int = DEVICE_CHUNK) -> None:
    """flats[j] += N(0, stds[j]²) for tensors on one device: runs of consecutive tensors of
    one dtype, at most ``chunk`` elements together, share one unit draw, scaled span by span
    of one std and added with one multi-tensor kernel (``torch._foreach_add_``, as torch's
    optimizers use); a tensor of ``chunk`` elements or more is drawn alone."""
    run: list[tuple[Tensor, float]] = []
    sizes: list[int] = []   # of the tensors in run; their sum kept as we go (not re-summed per tensor)
    size = 0

    def flush() -> None:
        nonlocal size
        if not run:
            return
        scratch = torch.empty(size, device=run[0][0].device, dtype=run[0][0].dtype).normal_(generator=generator)
        # scaled span by span of one std: one span under the global allocation, where every
        # group has the same std (a multi-tensor multiply costs the host per tensor, on the
        # CPU about 2 µs each); many spans on a GPU: one multi-tensor multiply
        spans, start, end = [], 0, 0
        for j, (_, std) in enumerate(run):
            end += sizes[j]
            if j + 1 == len(run) or run[j + 1][1] != std:
                spans.append((start, end, std))
                start = end
        pieces = list(scratch.split(sizes))
        limit = MAX_SCALED_SPANS.get(scratch.device.type, MAX_SCALED_SPANS_DEFAULT)
        if limit is None or len(spans) <= limit:
            for lo, hi, std in spans:
                scratch[lo:hi].mul_(std)
        else:
            foreach_mul_(pieces, [std for _, std in run])
        foreach_add_([t for t, _ in run], pieces)
        run.clear()
        sizes.clear()
        size = 0

    for flat, std in zip(flats, stds):
        numel = flat.numel()
        if numel >= chunk:
            _add_drawn(flat, std, generator, chunk)
            continue
        if run and (size + numel > chunk or flat.dtype != run[0][0].dtype):
            flush()
        run.append((flat, std))
        sizes.append(numel)
        size += numel
    flush()

ALLOCATIONS = ("global", "equal-budget", "weighted")


def allocation_weights(kind: str, thresholds: Tensor, sizes: Tensor) -> Tensor:
    """w_k of the allocation ``kind`` (module doc)."""
    if kind == "global":
        return torch.ones_like(thresholds)
    if kind == "equal-budget":
        return thresholds
    if kind == "weighted":
        return thresholds / sizes.to(thresholds.dtype).sqrt()
    raise EngineError(f"unknown noise_allocation {kind!r}", "use one of: " + ", ".join(ALLOCATIONS))


def noise_stds(sigma: float, thresholds: Tensor, weights: Tensor) -> Tensor:
    """σ_g · S · w_k with S = sqrt(Σ_k C_k²/w_k²): std of the noise on group k's summed
    clipped gradient (before dividing by the expected batch size).

    Computed in float64 as sqrt(Σ_k (C_k/w_k)²): in float32, C_k² underflows to 0 below
    C_k ≈ 1e-23 while the clipped gradients (of size C_k) do not, which would release them
    without noise."""
    ratio = thresholds.double() / weights.double()
    s = ratio.pow(2).sum().sqrt()
    return (sigma * s * weights.double()).to(thresholds.dtype)


def stage_noise_stds(sigma: float, thresholds: Tensor, kind: str, sizes: Tensor, stage=None,
                     gathered: dict | None = None) -> Tensor:
    """:func:`noise_stds` of one engine's groups, whole or one pipeline stage of a model
    (``stage``: :class:`~dpclip.engine.reducer.StageLink`). A per-device stage has only its own
    C_k, yet S = sqrt(Σ_k C_k²/w_k²) runs over all the pipeline's groups. Equal-budget
    (w_k = C_k) gives S = sqrt(K) and needs nothing from the other stages, which is why the
    adaptive-per-layer paper (§4, App. C) chose it; the other allocations gather the stages'
    thresholds (public values) once a step, and their sizes d_k once (kept in ``gathered``).
    A flat stage clips at the one C: its sensitivity is its own."""
    if stage is None or stage.flat:
        return noise_stds(sigma, thresholds, allocation_weights(kind, thresholds, sizes))
    if kind == "equal-budget":
        return sigma * math.sqrt(stage.num_groups) * thresholds
    every = stage.all_gather(thresholds)
    gathered = {} if gathered is None else gathered
    if "sizes" not in gathered:
        gathered["sizes"] = stage.all_gather(sizes)
    std = noise_stds(sigma, every, allocation_weights(kind, every, gathered["sizes"]))
    return std[stage.offset:stage.offset + len(thresholds)]


def effective_noise_multiplier(sigma_gradient: float, aux: Iterable[tuple[float, float]] = ()) -> float:
    """σ_eff of the joint release of the gradient and auxiliary statistics (docs/accounting.md, joint release).

    σ_eff⁻² = σ_g⁻² + Σ_a (Δ_a/σ_a)², computed by the accounting package so the engine and
    the ledger share one formula. A zero σ_g (no noise) gives σ_eff = 0: no privacy.
    """
    if sigma_gradient < 0:
        raise EngineError(f"gradient_noise_multiplier must be ≥ 0, got {sigma_gradient}", None)
    if sigma_gradient == 0:
        return 0.0
    releases = [(float(r[0]), float(r[1])) for r in aux]
    if any(sensitivity > 0 and sigma == 0 for sensitivity, sigma in releases):
        return 0.0
    try:
        return joint_noise_multiplier(sigma_gradient, [r for r in releases if r[0] > 0])
    except AccountingError as exc:
        raise EngineError(exc.message, exc.hint) from None


class NoiseSource:
    """One torch.Generator per device for the gradient and statistic noise.

    ``seed=None`` (the default): each generator's whole state comes from OS entropy
    (:func:`dpclip.rng.entropy_generator`). An int ``seed`` derives the whole state from
    it (:func:`dpclip.rng.seeded_generator`): reproducible, for tests and experiments,
    and known to anyone who knows the seed, who can then subtract the noise.

    The states are part of :meth:`state_dict` in both modes, so a resumed run replays
    exactly the noise of the steps it redoes (no new release); a checkpoint therefore holds
    a secret (docs/accounting.md, "Threat model"). Past those steps, an OS-entropy source is
    given fresh states (:meth:`renew_streams`, :func:`dpclip.rng.fork_private_streams`): two
    continuations of one checkpoint draw independent noise for their new steps, and only a
    seeded run ends with the weights of the run that never stopped.
    """

    purpose = "gradient-noise"

    def __init__(self, seed: int | None = None, stream: str | None = None):
        self.seed = None if seed is None else int(seed)
        if stream is not None:  # a sharded run's ranks each draw their own shard's noise: their own streams
            self.purpose = f"{NoiseSource.purpose}/{stream}"
        self._generators: dict[str, torch.Generator] = {}

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(torch.device(device))
        gen = self._generators.get(key)
        if gen is None:
            gen = private_generator(self.seed, self.purpose, device)
            self._generators[key] = gen
        return gen

    def add_gaussians(self, targets: list[Tensor], stds: list[float]) -> None:
        """``targets[j] += N(0, stds[j]²)`` in place, every coordinate drawn independently.

        In place, so a step holds no second copy of the model's gradients: the noise is
        drawn :data:`CHUNK` elements at a time into a scratch buffer and added, small
        tensors packed into one draw (on a GPU up to :data:`DEVICE_CHUNK` at a time). On CPU,
        when the targets hold :data:`SPLIT_MIN_NUMEL` elements or more, their
        concatenation (in order) is cut into :data:`STREAMS` equal slices; slice k is drawn
        with the k-th generator of :func:`dpclip.rng.split_generator` (its whole state
        hashed from 256 bits of this source's generator), and the slices are drawn on
        ``torch.get_num_threads()`` threads. Which stream draws which coordinate does not
        depend on the thread count, so a seeded run stays reproducible everywhere.
        """
        if any(not t.is_contiguous() for t in targets):
            raise ValueError("add_gaussians needs contiguous targets")
        cpu = [j for j, t in enumerate(targets) if t.device.type == "cpu"]
        total = sum(targets[j].numel() for j in cpu)
        split = total >= SPLIT_MIN_NUMEL
        by_device: dict[torch.device, list[int]] = {}
        for j, t in enumerate(targets):
            if t.device.type != "cpu" or not split:
                by_device.setdefault(t.device, []).append(j)
        for device, js in by_device.items():   # a small CPU draw is packed too: CHUNK at a time
            _add_drawn_packed([targets[j].view(-1) for j in js], [float(stds[j]) for j in js],
                              self.generator(device), CHUNK if device.type == "cpu" else DEVICE_CHUNK)
        if split:
            self._split_add([(targets[j].view(-1), float(stds[j])) for j in cpu], total)

    def _split_add(self, flats: list[tuple[Tensor, float]], total: int) -> None:
        generators = split_generator(self.generator(torch.device("cpu")), STREAMS, self.purpose)
        bounds = [k * total // STREAMS for k in range(STREAMS + 1)]
        pieces: list[list[tuple[Tensor, float]]] = [[] for _ in range(STREAMS)]
        start = 0  # offset of the current tensor in the concatenation
        for flat, std in flats:
            end = start + flat.numel()
            for k in range(STREAMS):
                lo, hi = max(start, bounds[k]), min(end, bounds[k + 1])
                if lo < hi:
                    pieces[k].append((flat[lo - start:hi - start], std))
            start = end

        def draw(streams: range) -> None:
            for k in streams:
                for piece, std in pieces[k]:
                    _add_drawn(piece, std, generators[k])

        workers = max(1, min(STREAMS, torch.get_num_threads()))
        if workers == 1:
            draw(range(STREAMS))
            return
        with ThreadPoolExecutor(workers) as pool:  # normal_ releases the GIL
            list(pool.map(draw, [range(w, STREAMS, workers) for w in range(workers)]))

    def renew_streams(self) -> None:
        """Every generator's whole state afresh from OS entropy (a fork: :func:`dpclip.rng.fork_private_streams`)."""
        for generator in self._generators.values():
            refill_from_entropy(generator)

    def state_dict(self) -> dict:
        return {"seeded": self.seeded, "states": {k: g.get_state() for k, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        if bool(state.get("seeded", not state.get("secure", True))) != self.seeded:
            raise EngineError("the checkpoint's noise generator was made in the other randomness mode "
                              "(seeded vs OS entropy)",
                              "resume with the run's own recipe and privacy.unsafe_seeded_randomness setting")
        for key, st in state.get("states", {}).items():
            self.generator(torch.device(key)).set_state(st)


def add_step_noise(source: NoiseSource, targets: list[Tensor], stds: list[float], correlation=None) -> None:
    """``targets[j] += `` one step's noise of std ``stds[j]`` per coordinate, in place: drawn
    from ``source`` (independent, DP-SGD), or, with a ``correlation`` (banded MF's
    :class:`~dpclip.engine.correlated.CorrelatedNoise` or BLT's
    :class:`~dpclip.engine.blt.BufferedNoise`), row t of C⁻¹Z for unit draws Z, times this
    step's std (docs/formulas.md, "Banded matrix factorization", "BLT"), at one gradient-sized
    buffer more.

    Correlating unit draws and scaling afterwards is the mechanism on the normalised sums
    x_t/std_t (each of sensitivity 1/σ): the release x_t + std_t·(C⁻¹Z)_t is std_t times it,
    so a std that moves between steps (an adaptive threshold, set from earlier releases) is
    post-processing, and never lets a step's smaller noise stand in for an earlier step's."""
    if correlation is None:  # all at once: a large draw is split over threads
        source.add_gaussians(targets, stds)
        return
    fresh = [torch.zeros_like(t) for t in targets]
    source.add_gaussians(fresh, [1.0] * len(fresh))
    correlation.correlate_(fresh)
    for target, noise, std in zip(targets, fresh, stds):
        target.add_(noise, alpha=std)
