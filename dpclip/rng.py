"""Random generators for private randomness: gradient noise, statistic noise, Poisson
sampling, tuning-search draws.

Whoever can regenerate the noise of a run can subtract it, and whoever can regenerate
its batches knows who was in each one (the amplification by subsampling the accountant
assumes is then gone). So private randomness never comes from the recipe's ``seed``
unless the user opts in (``privacy.unsafe_seeded_randomness``), and when it does come
from OS entropy it fills the generator's *whole* state, not a seed:

- CPU (torch's Mersenne Twister, MT19937): ``manual_seed(s)`` keeps only the low 32 bits
  of ``s``, so a seeded generator has at most 2³² streams, few enough to try them all.
  :func:`entropy_generator` writes the 624 state words (19,968 bits) from ``os.urandom``.
- CUDA (Philox): the state is a 64-bit key and a 64-bit offset; both come from
  ``os.urandom``. That is all the state there is.

The stream itself is torch's PRNG, not a cryptographic generator: the protection is that
nobody outside the run can know its state. The state is kept in checkpoints (so that a
resumed run replays exactly the releases already made); the run directory is therefore
the operator's secret (docs/accounting.md, "Threat model"). Once a resumed run has redone
those releases, :func:`fork_private_streams` gives every private stream a fresh whole state
from OS entropy: two continuations of one checkpoint (a copied run directory resumed twice)
would otherwise draw the same noise for their new steps, and the difference of their
releases would have none.

The reproducible mode (:func:`seeded_generator`) derives the whole state from
SHAKE-256(purpose, seed), so that seeds differing in any bit give different streams;
it exists for tests and experiments and gives up the guarantee against anyone who
holds the recipe.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import struct

import torch

__all__ = ["entropy_generator", "seeded_generator", "private_generator", "private_random",
           "derived_seed", "split_generator", "refill_from_entropy", "fork_private_streams"]

# torch's CPU generator state (CPUGeneratorImplState, 5056 bytes): u64 initial seed,
# i32 left, i32 seeded, u64 next, u64 state[624] (each holding a 32-bit word), then the
# cached normal samples. Checked against a seeded generator before it is written.
_CPU_STATE_BYTES = 5056
_MT_WORDS = 624
_MT_OFFSET = 24


def derived_seed(seed: int, purpose: str) -> int:
    """A 63-bit number for one purpose ("model-init", "search-trial-3", ...) from the recipe seed.

    For randomness that is *not* private (initial weights, data split, canaries): the
    recipe seed governs it, reproducibly."""
    digest = hashlib.sha256(f"dpclip:{purpose}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@functools.lru_cache(maxsize=1)
def _cpu_layout_known() -> bool:
    """Whether this torch's CPU generator state has the layout this module writes.

    A generator seeded with s has its initial seed at offset 0, ``left`` = 1, ``seeded``
    = 1 at offset 8, and MT19937's first state word (= s) at offset 24. Probed once per
    process: the layout is a property of the torch build."""
    probe = torch.Generator()
    probe.manual_seed(0x1234_5678)
    raw = probe.get_state().numpy().tobytes()
    return (len(raw) == _CPU_STATE_BYTES
            and struct.unpack_from("<QiiQ", raw, 0) == (0x1234_5678, 1, 1, 0)
            and struct.unpack_from("<Q", raw, _MT_OFFSET)[0] == 0x1234_5678)


def _check_cpu_layout(state: torch.Tensor) -> None:
    """Refuse to write a state whose layout is not the one this module knows."""
    if state.numel() != _CPU_STATE_BYTES or not _cpu_layout_known():  # pragma: no cover
        raise RuntimeError("this torch's CPU generator state has an unknown layout; dpclip cannot "
                           "fill it from OS entropy (report this, with the torch version)")


def _cpu_generator_from_words(words: bytes) -> torch.Generator:
    """A CPU generator whose 624 MT19937 state words are ``words`` (2496 bytes)."""
    generator = torch.Generator()
    generator.manual_seed(0)
    state = generator.get_state()
    _check_cpu_layout(state)
    raw = bytearray(state.numpy().tobytes())
    # each 32-bit word widened to the u64 slot the state keeps it in
    widened = struct.unpack(f"<{_MT_WORDS}I", words[: 4 * _MT_WORDS])
    struct.pack_into(f"<{_MT_WORDS}Q", raw, _MT_OFFSET, *widened)
    # left = 1, next = 0: the next draw regenerates the state block (as after seeding).
    struct.pack_into("<QiiQ", raw, 0, 0, 1, 1, 0)
    generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
    return generator


def _generator_from_bytes(material: bytes, device: torch.device | str) -> torch.Generator:
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_generator_from_words(material[: 4 * _MT_WORDS])
    generator = torch.Generator(device=device)
    key = int.from_bytes(material[:8], "little")
    generator.manual_seed(key)
    if hasattr(generator, "set_offset"):  # Philox offset (multiple of 4): the rest of the state
        generator.set_offset(4 * (int.from_bytes(material[8:16], "little") >> 4))
    return generator


def entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose whole state comes from ``os.urandom`` (module doc)."""
    return _generator_from_bytes(os.urandom(4 * _MT_WORDS), device)


def refill_from_entropy(generator: torch.Generator) -> None:
    """Overwrite ``generator``'s whole state, in place, with one from ``os.urandom`` (the
    state :func:`entropy_generator` makes: CPU, 624 words; CUDA, key and offset)."""
    generator.set_state(entropy_generator(generator.device).get_state())


def fork_private_streams(*holders) -> bool:
    """A fresh whole state from OS entropy for every private stream of ``holders`` (a
    :class:`~dpclip.engine.noise.NoiseSource`, a sampler; None is skipped), each holder's
    ``renew_streams()``; a seeded holder keeps its stream (forks of a seeded run share it, as
    its seed says anyway). Returns whether any stream was renewed.

    Called once a resumed run has redone the steps it had already released (those must draw
    the checkpoint's streams again): ``dpclip train --resume``, and a resumed ``DPTrainer`` or
    make_private ``load_checkpoint`` (after its release log's steps). Each process renews its own
    streams from its own entropy, as it filled them at the start; a stream every rank must share
    (a shuffled run's permutation) is drawn by rank 0 and broadcast by its holder, as at the
    start. Every rank calls it at the same step."""
    renewed = [h for h in holders if h is not None and not h.seeded]
    for holder in renewed:
        holder.renew_streams()
    return bool(renewed)


def seeded_generator(seed: int, purpose: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose whole state is SHAKE-256 of (purpose, seed): reproducible, and
    known to anyone who knows ``seed``. Every bit of ``seed`` changes the stream."""
    material = hashlib.shake_256(f"dpclip-private:{purpose}:{int(seed)}".encode()).digest(4 * _MT_WORDS)
    return _generator_from_bytes(material, device)


def private_generator(seed: int | None, purpose: str, device: torch.device | str = "cpu") -> torch.Generator:
    """OS entropy when ``seed`` is None (the default everywhere), else :func:`seeded_generator`."""
    if seed is None:
        return entropy_generator(device)
    return seeded_generator(seed, purpose, device)


# 256 bits drawn from the parent generator key each split (8 words of 32 bits).
_SPLIT_KEY_WORDS = 8


def split_generator(parent: torch.Generator, count: int, purpose: str) -> list[torch.Generator]:
    """``count`` CPU generators for one batch of parallel draws, all derived from ``parent``.

    Draws 256 bits from ``parent`` (advancing it) and fills child j's whole MT19937 state
    with SHAKE-256(purpose, those bits, j). The children are private exactly when the
    parent is (OS entropy, or a seed with ``unsafe_seeded_randomness``), and a parent
    restored from a checkpoint splits into the same children again. The hash is there
    because MT19937 is linear over GF(2): children built from raw parent output would
    be linear images of one state; hashed, the streams are unrelated to each other and to
    the parent's later output (and SHAKE-256 is what :func:`seeded_generator` relies on).
    """
    if parent.device.type != "cpu":
        raise ValueError("split_generator splits CPU generators (a CUDA Philox generator "
                         "draws in parallel by itself)")
    key = torch.empty(_SPLIT_KEY_WORDS, dtype=torch.int64).random_(0, 2**32, generator=parent)
    material = b"".join(int(w).to_bytes(4, "little") for w in key.tolist())
    return [_cpu_generator_from_words(hashlib.shake_256(
        f"dpclip-split:{purpose}:{j}:".encode() + material).digest(4 * _MT_WORDS))
        for j in range(count)]


def private_random(seed: int | None, purpose: str) -> random.Random:
    """A Python ``random.Random`` for private draws (tuning search: trial count, scores).

    Seeded with 256 bits of OS entropy when ``seed`` is None (``random.Random`` uses every
    bit of an int seed), else from SHAKE-256(purpose, seed). Its state can be saved with
    ``getstate()``, unlike ``random.SystemRandom``."""
    if seed is None:
        material = os.urandom(32)
    else:
        material = hashlib.shake_256(f"dpclip-private:{purpose}:{int(seed)}".encode()).digest(32)
    return random.Random(int.from_bytes(material, "little"))
