"""User-level Poisson sampling (docs/users.md): people, not records, are the sampled unit.

Each step includes each of the U people independently with probability q (expected users
per batch / U), and takes at most k of an included person's records, chosen uniformly at
random by the private generator. Whether a person is in a step and which of their records it
takes depend on that person's own draws alone, so adding or removing a person changes one
term of the sampled sum: the Poisson-subsampled Gaussian's analysis holds with the person as
the unit. :func:`user_weights` then weights each taken record by 1/(records taken of its
person), so that a person's clipped contribution is at most C (the engine's ``row_weights``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from dpclip.data.sampler import PoissonSampler
from dpclip.errors import DpclipError, quoting_data


class UserPoissonSampler(PoissonSampler):
    """``steps`` batches of record indices (sorted), people sampled at ``sample_rate``, at most
    ``max_per_user`` records each. ``users[i]`` is the person of record i (ids 0..U-1).

    ``groups`` = G > 1: cyclic sampling of people for correlated noise (each person's group
    drawn once by the private generator, step t samples group t mod G at ``sample_rate`` = q·G),
    as :class:`~dpclip.data.sampler.PoissonSampler` does for records.

    Across ranks (``rank`` of ``world_size``), each rank samples the people u with u mod W =
    rank and takes their records: a person's records are all on one rank, so their weights
    (:func:`user_weights`) are computed there, and the union of the ranks' parts is one batch
    of people (with seeded randomness, exactly the one-process batch)."""

    purpose = "user-poisson-sampler"

    def __init__(self, users: torch.Tensor, sample_rate: float, steps: int, max_per_user: int,
                 seed: int | None = None, *, rank: int = 0, world_size: int = 1, groups: int = 1):
        users = torch.as_tensor(users, dtype=torch.int64)
        if users.dim() != 1 or len(users) == 0:
            raise DpclipError("user-level sampling needs one user id per record", "the training set is empty")
        num_users = int(users.max()) + 1
        if int(users.min()) < 0 or torch.bincount(users, minlength=num_users).min() == 0:
            raise DpclipError("user ids must number the people 0..U-1, each with at least one record",
                              "load the data with dpclip.data.load_data, which numbers them")
        if isinstance(max_per_user, bool) or not isinstance(max_per_user, int) or max_per_user < 1:
            raise DpclipError(f"max_examples_per_user must be a whole number >= 1, got {max_per_user!r}",
                              "k is the most records of one person a step takes, e.g. 8")
        super().__init__(num_users, sample_rate, steps, seed, groups=groups)
        self.users = users
        self.max_per_user = max_per_user
        # Records sorted by person: a person's records are one contiguous run of `order`.
        self.order = torch.argsort(users, stable=True)
        self.first = torch.searchsorted(users[self.order], torch.arange(num_users))
        self.rank, self.world_size = rank, world_size
        self.owned = torch.arange(num_users) % world_size == rank

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.step < self.steps:
            # One uniform per person and one per record every step, used or not: the
            # generator's position is a function of the step count alone (resume).
            # Every rank draws for every person and record (its own generator, or the shared
            # seeded one) and keeps its own people.
            included = torch.rand(self.num_examples, generator=self.generator, dtype=torch.float64) < self.sample_rate
            included &= self.owned & self.in_turn(torch.arange(self.num_examples))
            keys = torch.rand(len(self.users), generator=self.generator, dtype=torch.float64)
            self.step += 1
            yield self._take(included, keys)

    def _take(self, included: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The records of the included people, at most k each: those with the k smallest keys."""
        # Sort by (person, key): person ids are whole numbers and keys lie in [0, 1).
        ranked = torch.argsort(self.users.to(torch.float64) + keys)
        rank_in_person = torch.arange(len(ranked)) - self.first[self.users[ranked]]
        chosen = ranked[(rank_in_person < self.max_per_user) & included[self.users[ranked]]]
        return torch.sort(chosen).values


    def state_dict(self) -> dict:
        return {**super().state_dict(), "rank": self.rank, "world_size": self.world_size}


def number_people(ids) -> torch.Tensor:
    """One person id per record (any hashable values, or 0-d tensors) numbered 0..U-1 in order of
    first appearance, as the user sampler takes them (one id in two types, :func:`spelling_clash`, is
    refused). A missing id (None, NaN, an empty string) is
    refused, as in a recipe's ``data.user_field``: each NaN would be a person of its own (NaN is
    not equal to itself) and the records of nobody cannot be protected."""
    numbering: dict = {}
    numbers = []
    for row, person in enumerate(ids):
        if isinstance(person, torch.Tensor):
            person = person.item() if person.numel() == 1 else person
        if person is None or (isinstance(person, (float, np.floating)) and math.isnan(person)) or \
                (isinstance(person, str) and not person.strip()):
            raise DpclipError(quoting_data(f"the person id of example {row} (counting from 0) is missing ({person!r})"),
                              "every record must name the person it belongs to: fill the ids or drop those records")
        try:
            numbers.append(numbering.setdefault(person, len(numbering)))
        except TypeError:
            raise DpclipError(quoting_data(f"the person id of example {row} (counting from 0) is a "
                                           f"{type(person).__name__}, which cannot name a person (not hashable)"), "give each record's person as a number or a string") from None
    clash = spelling_clash(ids)
    if clash is not None:
        raise DpclipError(quoting_data(f"the person id of example {clash.row} (counting from 0), {clash.person!r}, and "
                                       f"an earlier one, {clash.earlier!r}, are {clash.what}: one person or two cannot "
                                       "be told"), clash.hint)
    return torch.tensor(numbers, dtype=torch.int64)


ONE_TYPE_HINT = "write every person id in one type, the same way each time (all strings, or all whole numbers)"
LOOKALIKE_HINT = ("if they are one person, write the id one way each time (e.g. stripped and lower-cased); if two "
                  "people, give them ids that differ in more than case and surrounding spaces")


class Clash(NamedTuple):
    """Two ids whose person is ambiguous: the later one's row, the earlier id, the later id, what
    makes them ambiguous and the hint."""

    row: int
    earlier: object
    person: object
    what: str
    hint: str


def spelling_clash(ids) -> Clash | None:
    """The first id whose person is ambiguous, with its row and the earlier id it clashes with: the
    same text but another value ('7' and 7), or the same value written otherwise (7 and 7.0, True
    and 1). Numbered as values, '7' and 7 were two people (one owner's records in two privacy units,
    each clipped to C); written out as text, 7 and 7.0 were. Likewise ids whose text differs only in
    case or surrounding spaces ('Alice' and 'alice', ' 7' and '7'): counted as two people, as exact
    comparison does, they would be one owner's records in two units if one person typed twice; merged,
    two people in one unit. None when every id is unambiguous."""
    by_text: dict = {}
    by_value: dict = {}
    by_lookalike: dict = {}
    for row, person in enumerate(ids):
        if isinstance(person, torch.Tensor) and person.numel() == 1:
            person = person.item()
        text = str(person)
        earlier = by_text.setdefault(text, person)
        if earlier is not person and bool(earlier != person):
            return Clash(row, earlier, person, "one id in two types", ONE_TYPE_HINT)
        try:
            first = by_value.setdefault(person, person)
        except TypeError:   # not hashable: its text alone names it
            first = person
        if str(first) != text:
            return Clash(row, first, person, "one id in two types", ONE_TYPE_HINT)
        seen = by_lookalike.setdefault(text.strip().casefold(), person)
        if str(seen) != text:
            return Clash(row, seen, person, "two ids that differ only in case or surrounding spaces", LOOKALIKE_HINT)
    return None


def user_weights(users_of_rows: torch.Tensor) -> torch.Tensor:
    """1/(rows of the same person in the batch) for each row: a person's rows weigh 1 together,
    so their clipped contribution is at most C, whatever the number of records taken."""
    if len(users_of_rows) == 0:
        return torch.zeros(0, dtype=torch.float64)
    _, inverse, counts = torch.unique(users_of_rows, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse].to(torch.float64)
