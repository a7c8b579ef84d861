"""The deterministic train/test split every workflow shares (members vs held-out)."""

from __future__ import annotations

import hashlib

import numpy as np

from dpclip.errors import DpclipError


def split_sizes(num_examples: int, test_fraction: float) -> tuple[int, int]:
    """(train, test) counts: test = round(test_fraction * n), both at least 1."""
    num_test = int(round(test_fraction * num_examples))
    num_test = min(max(num_test, 1), num_examples - 1)
    if num_examples < 2:
        raise DpclipError(f"the data set has {num_examples} example(s); a train/test split needs 2 or more",
                          "use a larger data set")
    return num_examples - num_test, num_test


def split_indices(num_examples: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded permutation cut into sorted (train, test) index arrays."""
    num_train, _ = split_sizes(num_examples, test_fraction)
    order = np.random.default_rng(seed).permutation(num_examples)
    return np.sort(order[:num_train]), np.sort(order[num_train:])


def split_fingerprint(train_indices: np.ndarray, test_indices: np.ndarray) -> str:
    """A short hash that changes whenever membership changes (recorded in meta.json)."""
    digest = hashlib.sha256()
    digest.update(np.asarray(train_indices, dtype=np.int64).tobytes())
    digest.update(b"|")
    digest.update(np.asarray(test_indices, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def carve_count(num_examples: int, fraction: float) -> int:
    """How many rows ``data.public_fraction`` carves out as public: round(f·n), at least 1,
    leaving at least 2 private rows (a train/test split needs 2)."""
    if num_examples < 3:
        raise DpclipError(f"the data set has {num_examples} example(s); carving public rows needs 3 or more",
                          "use a larger data set, or a separate public: source")
    return min(max(int(round(fraction * num_examples)), 1), num_examples - 2)


def carve_indices(num_examples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(public, private) sorted row positions: a seeded permutation cut at :func:`carve_count`.

    Disjoint by construction; drawn from the recipe seed (which rows are public is not
    private: they are public), with its own purpose so it is independent of the
    train/test split's permutation."""
    digest = hashlib.sha256(f"dpclip:public-carve:{int(seed)}".encode()).digest()
    order = np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(num_examples)
    count = carve_count(num_examples, fraction)
    return np.sort(order[:count]), np.sort(order[count:])
