"""Which examples each training step sees.

:class:`PoissonSampler` is the sampling the privacy accounting assumes: at every step,
each of the N examples joins the logical batch independently with probability q, so the
batch size is Binomial(N, q) and may be zero. :class:`ShuffleSampler` gives fixed-size
batches from reshuffled epochs; the accounting treats it as Poisson, and the privacy
statement says so.

Both are resumable: ``state_dict()`` holds the step counter and the random generator's
state, and a sampler restored from it draws exactly the batches an uninterrupted one
would have drawn, until ``renew_streams()`` (a resumed run past the steps it had already
released: :func:`dpclip.rng.fork_private_streams`) gives an OS-entropy generator a fresh state.

Randomness: which examples are in a batch is private (the accountant's amplification by
subsampling assumes nobody knows it). ``seed=None``, the default, fills the generator's
whole state from OS entropy; an int seed makes the batches reproducible by anyone who
knows it (tests and the recipe's ``privacy.unsafe_seeded_randomness`` only). See
:mod:`dpclip.rng`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dpclip.errors import DpclipError
from dpclip.rng import private_generator, refill_from_entropy


class PoissonSampler:
    """``steps`` logical batches; each example is in each batch with probability ``sample_rate``.

    Iterating yields one int64 tensor of example indices (sorted) per remaining step, an
    empty tensor included: an empty batch is still a step, and the accountant counts it.
    ``len()`` is the total number of steps.

    ``groups`` = b > 1: cyclic Poisson sampling, which banded matrix factorization's accounting
    assumes (docs/formulas.md, "Cyclic groups"): each example's group is drawn once, uniformly
    from 0..b-1, by the private generator (``group_of``, kept in the secret state), and step t
    draws from group t mod b alone, each of its examples with probability ``sample_rate`` (pass
    q·b for an expected batch of q·N). An example then takes part in at most one step of any b
    in a row, and adding or removing one example leaves every other example's group as it was
    (by index, i mod b, removing example 0 would move every later example to another group).
    b = 1 draws exactly the batches of plain Poisson sampling.
    """

    purpose = "poisson-sampler"

    def __init__(self, num_examples: int, sample_rate: float, steps: int, seed: int | None = None,
                 groups: int = 1):
        if num_examples < 1:
            raise DpclipError(f"cannot sample from {num_examples} examples", "the training set is empty")
        if not 0 < sample_rate <= 1:
            raise DpclipError(f"sample rate {sample_rate} is not in (0, 1]",
                              "the Poisson rate q = batch_size / N must be positive and at most 1")
        if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= num_examples:
            raise DpclipError(f"{num_examples} examples cannot be cut into {groups!r} groups",
                              "cyclic Poisson sampling needs 1 <= bands <= N: use fewer bands")
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.steps = steps
        self.groups = groups
        self.step = 0
        self.seeded = seed is not None
        self.generator = private_generator(seed, self.purpose)
        # drawn before any step, so the generator's position stays a function of the step count
        self.group_of = (torch.randint(0, groups, (num_examples,), generator=self.generator, dtype=torch.int64)
                         if groups > 1 else None)

    def in_turn(self, indices: torch.Tensor) -> torch.Tensor:
        """Which of ``indices`` belong to the group whose turn the current step is (all, b = 1)."""
        if self.group_of is None:
            return torch.ones(len(indices), dtype=torch.bool)
        return self.group_of[indices] == self.step % self.groups

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.step < self.steps:
            # One uniform draw per example per step, whether or not it is included:
            # that keeps the generator's position a function of the step count alone.
            # float64: a float32 uniform lives on a 2⁻²⁴ grid, so `< q` would include with
            # probability ⌈q·2²⁴⌉/2²⁴ (19% above q at q = 3e-7); float64's grid is 2⁻⁵³.
            included = torch.rand(self.num_examples, generator=self.generator, dtype=torch.float64) \
                < self.sample_rate
            if self.groups > 1:
                included &= self.in_turn(torch.arange(self.num_examples))
            self.step += 1
            yield included.nonzero().squeeze(1)

    def state_dict(self) -> dict:
        """Step counter, generator state and the examples' groups (tensors and ints: safe for
        weights_only loading; as secret as the generator)."""
        state = {"step": self.step, "generator": self.generator.get_state()}
        if self.group_of is not None:
            state["group_of"] = self.group_of.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.group_of is not None:
            if "group_of" not in state:
                raise DpclipError("this checkpoint's cyclic sampling put example i in group i mod b, which does "
                                  "not hold under adding or removing one example",
                                  "start the run again: groups are now drawn privately (docs/formulas.md, "
                                  "\"Cyclic groups\")")
            group_of = torch.as_tensor(state["group_of"], dtype=torch.int64)
            if group_of.shape != self.group_of.shape:
                raise DpclipError(f"the checkpoint's sampler has {len(group_of)} examples, this run "
                                  f"{len(self.group_of)}", "resume with the data the run was trained on")
            self.group_of = group_of.clone()
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])

    def renew_streams(self) -> None:
        """The generator's whole state afresh from OS entropy (the examples' groups stay: the
        cyclic structure the accounting assumes holds over the whole run)."""
        refill_from_entropy(self.generator)


class ShuffleSampler:
    """``steps`` batches of exactly ``batch_size`` examples from reshuffled epochs.

    The epochs form one stream: each epoch is a fresh random permutation of all
    examples, and a batch that runs past the end of an epoch continues into the next.
    So every batch has the same size, and every block of N consecutive draws that starts
    at an epoch boundary holds each example exactly once. (Two halves of one batch come
    from different epochs, so a batch can hold an example twice, which is rare.)
    """

    purpose = "shuffle-sampler"

    def __init__(self, num_examples: int, batch_size: int, steps: int, seed: int | None = None):
        if num_examples < 1:
            raise DpclipError(f"cannot sample from {num_examples} examples", "the training set is empty")
        if not 1 <= batch_size <= num_examples:
            raise DpclipError(f"batch size {batch_size} is not between 1 and the dataset size {num_examples}",
                              "choose training.batch_size at most N")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.steps = steps
        self.step = 0
        self.seeded = seed is not None
        self.generator = private_generator(seed, self.purpose)
        self.permutation = self._draw_permutation()
        self.position = 0  # next unused entry of the current epoch's permutation

    def __len__(self) -> int:
        return self.steps

    def _take(self, count: int) -> torch.Tensor:
        taken = []
        while count > 0:
            if self.position == self.num_examples:
                self.permutation = self._draw_permutation()
                self.position = 0
            chunk = self.permutation[self.position: self.position + count]
            self.position += len(chunk)
            count -= len(chunk)
            taken.append(chunk)
        return torch.cat(taken)

    def _draw_permutation(self) -> torch.Tensor:
        """The next epoch's order (across ranks, rank 0 draws it for all: dpclip.distributed)."""
        return torch.randperm(self.num_examples, generator=self.generator)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.step < self.steps:
            batch = self._take(self.batch_size)
            self.step += 1
            yield batch

    def state_dict(self) -> dict:
        return {"step": self.step, "generator": self.generator.get_state(),
                "permutation": self.permutation.clone(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
        self.permutation = state["permutation"].clone()
        self.position = int(state["position"])

    def renew_streams(self) -> None:
        """The generator's whole state afresh from OS entropy, and the rest of this epoch put in
        a fresh order (the examples of a uniform permutation of all N that are below the count
        left: a uniform order of those; drawn as every permutation is, by rank 0 across ranks)."""
        refill_from_entropy(self.generator)
        rest = self.permutation[self.position:]
        order = self._draw_permutation()
        self.permutation = torch.cat([self.permutation[:self.position], rest[order[order < len(rest)]]])


def micro_batches(indices: torch.Tensor, micro_batch_size: int) -> Iterator[torch.Tensor]:
    """Split one logical batch into physical chunks of at most ``micro_batch_size``.

    An empty logical batch yields no chunk at all: the engine then takes a step with
    zero backward calls (noise only), which is what Poisson sampling requires.
    """
    if micro_batch_size < 1:
        raise DpclipError(f"micro-batch size {micro_batch_size} must be at least 1",
                          "set training.micro_batch_size to a positive number")
    if len(indices) == 0:
        return
    yield from torch.split(indices, micro_batch_size)
