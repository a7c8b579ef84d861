"""The loader ``make_private`` returns (docs/python-api.md): each batch one draw of the
:class:`~dpclip.integrations.rows.DrawTracker`, as many as the plan has steps, handed to the
loop whole or in parts of ``max_physical_batch_size`` rows; Poisson-sampled, or your own
loader's batches (``poisson_sampling=False``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from dpclip.data.sampler import PoissonSampler
from dpclip.errors import DpclipError
from dpclip.integrations.collate import EmptyDrawCollate
from dpclip.integrations.rows import DrawTracker, batch_rows
from dpclip.rng import fork_private_streams


def batch_parts(batch: Any, rows: int, size: int | None) -> list[Any]:
    """``batch`` cut along dim 0 into parts of at most ``size`` rows (one part: None, or an empty draw)."""
    if size is None or rows <= size:
        return [batch]
    starts = range(0, rows, size)

    def cut(value: Any, start: int) -> Any:
        if isinstance(value, Tensor) and value.dim() and value.shape[0] == rows:
            return value[start:start + size]
        if isinstance(value, Mapping):
            return type(value)({key: cut(item, start) for key, item in value.items()})
        if isinstance(value, (list, tuple)):
            items = [cut(item, start) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value
    return [cut(batch, start) for start in starts]


class TrackedLoader(DataLoader):
    """A DataLoader whose every batch is one draw of the :class:`DrawTracker`, handed to the loop
    in parts of at most ``physical`` rows (None: whole). The draw is counted where the loop
    receives it, not where workers prefetch it. A loop that breaks out between the parts of a
    draw (it counts parts, or a time limit) gets the draw's other parts first from its next
    iterator: the draw is one step, finished before the next is drawn."""

    def __init__(self, *args, tracker: DrawTracker, physical: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker, self.physical = tracker, physical
        if isinstance(self.batch_sampler, PlannedBatches):
            self.batch_sampler.tracker = tracker
        self._left: list[Any] = []   # the open draw's parts not handed out yet
        self._left_of = 0            # the draw they belong to (tracker.draws)

    def __iter__(self):
        if self._left and self._left_of == self.tracker.draws and self.tracker.rows is not None:
            yield from self._hand_left()
            sampler = self.batch_sampler
            if isinstance(sampler, PlannedBatches) and sampler.spent():
                return   # that draw was the plan's last: this pass ends with it
        if isinstance(self.batch_sampler, PlannedBatches):
            self.batch_sampler.claimed = True   # its next pass is this loader's
        for batch in super().__iter__():
            rows = batch_rows(batch)
            self.tracker.open(rows, batch)
            if isinstance(self.batch_sampler, PoissonBatches):
                self.batch_sampler.received(self.tracker.draws)
            self._left, self._left_of = batch_parts(batch, rows, self.physical), self.tracker.draws
            yield from self._hand_left()

    def _hand_left(self):
        while self._left and self._left_of == self.tracker.draws:
            self.tracker.refuse_if_spoiled()
            part = self._left.pop(0)
            self.tracker.hand(batch_rows(part))
            yield part


# ----------------------------------------------------------------------------- the loader

class PlannedBatches(torch.utils.data.Sampler):
    """Batches of example indices, as many as the plan has steps left: ε covers the planned steps."""

    tracker: DrawTracker | None = None   # that of the TrackedLoader built on it
    claimed = False   # a pass started by that loader (another DataLoader built on it: accelerate's prepare)

    def spent(self) -> bool:
        raise NotImplementedError

    def start_pass(self) -> None:
        """A pass begins: by the TrackedLoader, or by another loader whose batches the loop's checks
        never see (each loss over them is refused: the tracker then names the cause)."""
        if self.tracker is not None:
            self.tracker.other_loader = not self.claimed
        self.claimed = False


SPENT_HINT = "ε covers the steps make_private planned: ask for more epochs (or steps) there"


class PoissonBatches(PlannedBatches):
    """Batches of example indices, each example in each batch with probability q (``draws``: a
    :class:`~dpclip.data.sampler.PoissonSampler`, or a rank's sharded one).

    One pass (an "epoch") is ``steps_per_pass`` batches; the passes together make the planned
    steps. A pass started after the plan is spent is refused: ε covers the planned steps.
    """

    #: draws whose generator state is kept: a loader's workers fetch up to num_workers × prefetch_factor
    #: batches ahead of the loop, and a checkpoint must hold the state after the draws the loop took
    KEPT_STATES = 256

    def __init__(self, draws: PoissonSampler, steps_per_pass: int, taken: Callable[[], int] | None = None):
        self.draws = draws
        self.steps_per_pass = steps_per_pass
        self.planned = draws.steps
        # make_private: the draws the loop took (its tracker's). Those a loader's workers fetched
        # ahead of a break were never taken (nor released, nor charged): the sampler draws on past
        # them, fresh, and the plan's steps stay the loop's. None: the sampler's own count.
        self.taken = (lambda: self.draws.step) if taken is None else taken
        # a resume's last step already released: the draws after it start a fresh stream
        # (dpclip.rng.fork_private_streams), however far ahead a loader's workers fetch
        self.fork_after: int | None = None
        self._fresh = False
        # a resume's redone steps: step -> the sampler position of its draw in the interrupted run
        # (its release log's), past the draws a loader's workers had fetched ahead of a break
        self.replay: dict[int, int] = {}
        self.position_of: dict[int, int] = {}         # taken step -> its draw's sampler position
        self._before: dict[int, torch.Tensor] = {}   # draw count -> the generator's state then
        self._pass: deque[int] = deque(maxlen=self.KEPT_STATES)   # this pass's draws not yet received

    def received(self, step: int) -> None:
        """The loop received this pass's next draw, as step ``step`` (batches arrive in draw order)."""
        if self._pass:
            self.position_of[step] = self._pass.popleft()
            self.position_of.pop(step - self.KEPT_STATES, None)

    def state_at(self, taken: int) -> dict:
        """The sampler's state after the draw the loop took last (its loader's workers may have
        drawn more), for a checkpoint: the first ``taken`` draws if none was left behind."""
        state = self.draws.state_dict()
        taken = self.position_of.get(taken, taken - 1) + 1
        if taken == self.draws.step:
            return state
        if taken not in self._before:
            raise DpclipError(f"the sampler's state after {taken} draws is no longer kept: the loader has drawn "
                              f"{self.draws.step - taken} batches ahead of the loop",
                              f"fetch fewer batches ahead (num_workers × prefetch_factor below {self.KEPT_STATES})")
        return {**state, "step": taken, "generator": self._before[taken].clone()}

    def __len__(self) -> int:
        return min(self.steps_per_pass, self.planned - self.taken()) or self.steps_per_pass

    def spent(self) -> bool:
        return self.taken() >= self.planned

    def __iter__(self) -> Iterator[list[int]]:
        self.start_pass()
        if self.spent():
            raise DpclipError(f"the {self.planned} planned steps are done", SPENT_HINT)
        first = self.taken() + 1   # the step this pass's first draw is for, if the loop takes it
        left = min(self.steps_per_pass, self.planned - first + 1)
        self._pass.clear()   # an earlier pass's draws not received: never taken
        for step in range(first, first + left):
            if step in self.replay:
                self._seek(self.replay[step])
            elif self.fork_after is not None and step > self.fork_after and not self._fresh:
                fork_private_streams(self.draws)
                self._fresh = True
            indices = self._draw()
            if indices is None:
                return
            self._pass.append(self.draws.step - 1)
            yield indices.tolist()

    def _draw(self) -> torch.Tensor | None:
        """The sampler's next draw, the generator's state before it kept."""
        self.draws.steps = max(self.draws.steps, self.draws.step + 1)
        self._before[self.draws.step] = self.draws.generator.get_state()
        self._before.pop(self.draws.step - self.KEPT_STATES, None)
        return next(iter(self.draws), None)

    def _seek(self, position: int) -> None:
        """The sampler at ``position`` of its stream, as a redone step's draw was in the interrupted
        run: past the draws its loader's workers fetched ahead and its loop left (drawn again and
        dropped), or back at one kept. Not found: the redone step's fingerprint refuses it."""
        if position in self._before and position < self.draws.step:
            self.draws.generator.set_state(self._before[position])
            self.draws.step, self._fresh = position, False
        while self.draws.step < position and not self._fresh:
            self._draw()


class PoissonParts(PoissonBatches):
    """Poisson draws of expected size B, each cut into ``parts`` consecutive index lists (the
    Trainer's accumulation then sums them into one optimizer step)."""

    def __init__(self, draws: PoissonSampler, steps_per_pass: int, parts: int):
        super().__init__(draws, steps_per_pass)
        self.parts = parts

    def __len__(self) -> int:
        return self.steps_per_pass * self.parts

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            for part in torch.tensor(batch, dtype=torch.int64).tensor_split(self.parts):
                yield part.tolist()


def poisson_loader(loader: DataLoader, draws: PoissonSampler, steps_per_pass: int, tracker: DrawTracker,
                   physical: int | None = None) -> DataLoader:
    """``loader``'s dataset and settings, with Poisson-sampled batches (:class:`PoissonBatches`),
    each one draw of ``tracker`` (:class:`TrackedLoader`)."""
    return TrackedLoader(loader.dataset, batch_sampler=PoissonBatches(draws, steps_per_pass, lambda: tracker.draws),
                         collate_fn=EmptyDrawCollate(loader.dataset, loader.collate_fn), num_workers=loader.num_workers,
                         pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
                         prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                         tracker=tracker, physical=physical)


class YourBatches(PlannedBatches):
    """Your own loader's batches (``poisson_sampling=False``), as many as the plan has steps left:
    counted where the loop receives them (``drawn``: the tracker's draws), as the Poisson
    loader's are; a pass started after the plan is spent is refused."""

    def __init__(self, batches: Any, steps: int, drawn: Callable[[], int]):
        self.batches, self.steps, self.drawn = batches, steps, drawn

    def spent(self) -> bool:
        return self.drawn() >= self.steps

    def __len__(self) -> int:
        return min(len(self.batches), self.steps - self.drawn()) or len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        self.start_pass()
        if self.spent():
            raise DpclipError(f"the {self.steps} planned steps are done", SPENT_HINT)
        left = self.steps - self.drawn()
        for k, batch in enumerate(self.batches):
            if k == left:
                return
            yield batch


def tracked_loader(loader: DataLoader, tracker: DrawTracker, physical: int | None = None,
                   steps: int | None = None) -> DataLoader:
    """Your own loader's batches (``poisson_sampling=False``), each one draw of ``tracker``, at
    most ``steps`` of them in all (:class:`YourBatches`)."""
    batches = loader.batch_sampler
    if steps is not None and batches is not None:
        batches = YourBatches(batches, steps, lambda: tracker.draws)
    return TrackedLoader(loader.dataset, batch_sampler=batches,
                         collate_fn=EmptyDrawCollate(loader.dataset, loader.collate_fn),
                         num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                         worker_init_fn=loader.worker_init_fn, prefetch_factor=loader.prefetch_factor,
                         persistent_workers=loader.persistent_workers, tracker=tracker, physical=physical)
