"""The redone steps of a resumed ``DPTrainer`` checked against what the interrupted run released.

A resume from a checkpoint redoes the steps after it with the checkpoint's sampler and noise
streams: the same batches and the same noise. They are charged once only if they release the
same gradient too; a different one (a dropout stream moved, a callback drawing random numbers)
with the same noise gives away the difference of the two gradients without noise. So each
step's noisy gradient leaves a fingerprint in ``dpclip_releases.jsonl`` beside the checkpoints
(Σ g and Σ g² over every parameter, in float64: a post-processing of the release, covered by ε),
and a redone step whose fingerprint differs is refused before anything of it leaves the process.
After the last redone step the sampler's and the noise's streams start afresh from OS entropy
(:meth:`ReleaseLog.fork_after_redone`): the later steps are new releases, and a second resume of
the same checkpoint must not draw their noise.

``make_private`` keeps the same log beside its checkpoint files from the first
``save_checkpoint`` on (integrations/private.py). Each record names its run (an id in the run's
checkpoints too), so that two runs in one folder are told apart: a new ``DPTrainer`` run in an
output_dir that holds an older run's log appends to it, and resumed, redoes its own steps only.
make_private's records also give a step's draw position in the sampler's stream where it is not
the step's own number (a loop broke out of a pass whose loader's workers had fetched draws ahead):
the redone step draws there again (loaders.py ``PoissonBatches.replay``).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dpclip import layout
from dpclip.errors import DpclipError
from dpclip.files import OWNER_ONLY, append_line, write_text_atomic
from dpclip.rng import fork_private_streams

if TYPE_CHECKING:
    from dpclip.distributed.world import World


def fingerprint(grads: Iterable[Tensor]) -> list[float]:
    """[Σ g, Σ g²] over ``grads`` in float64 (one device sync)."""
    parts = [torch.stack([g.detach().double().sum(), g.detach().double().square().sum()]) for g in grads]
    return torch.stack(parts).sum(0).tolist() if parts else [0.0, 0.0]


class ReleaseLog:
    """The fingerprints of a run's released steps, in ``folder/dpclip_releases.jsonl``."""

    def __init__(self, folder: str | Path, main: bool = True, run: str | None = None) -> None:
        self.path = Path(folder) / layout.TRAINER_RELEASES
        self.main = main
        self.run = run   # make_private: the run's id, in its records (None: every record is this run's)
        self.redo: dict[int, list[float]] = {}   # steps after the resumed checkpoint: released before
        self.last_redone: int | None = None      # then the noise's streams start afresh
        self.noise = None
        # make_private's PoissonBatches: a step whose draw is not the sampler's next after the last
        # taken one (its loader's workers fetched draws ahead of a break) logs the draw's position
        self.batches = None
        self.redo_draws: dict[int, int] = {}   # redone steps' positions, past the draws left behind
        self.appended = False   # by this process: its first record starts on a line of its own
        self.cause: str | None = None   # a known reason the redone steps may differ, said first in the hint

    @classmethod
    def new_run(cls, folder: str | Path, world: World | None = None) -> ReleaseLog:
        """The log of a new run, under a new id (rank 0's on every rank: rank 0 writes the records)."""
        run = secrets.token_hex(8)
        return cls(folder, main=world is None or world.main, run=run if world is None else world.broadcast(run))

    def resume_after(self, step: int, folder: str | Path, run: str | None, required: bool = True) -> None:
        """The steps after ``step`` of ``run`` (the resumed checkpoint's; None: a checkpoint from
        before run ids, whose records have none) in the log in ``folder`` were released by the
        interrupted run: to be redone alike; this log goes on under ``run``. ``required``: a
        checkpoint after released steps; without their log beside it, the redone steps could not be
        checked, so the resume is refused."""
        self.redo, self.redo_draws, self.run = {}, {}, run
        source = Path(folder) / layout.TRAINER_RELEASES
        if not source.exists():
            if required:
                raise DpclipError(
                    f"no {layout.TRAINER_RELEASES} in {folder}, beside the checkpoint: the steps its run released "
                    "after it cannot be checked when they are redone (the same noise with another gradient would "
                    "release their difference without noise)",
                    f"resume from the checkpoint in the run's own output_dir, or copy that run's "
                    f"{layout.TRAINER_RELEASES} into {folder}")
            return
        kept = []
        for line in source.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:   # a line cut by a crash: its step is redone unchecked, as one
                continue                   # never logged; a later run's records after it still count
            kept.append(line)
            if record["step"] > step and record.get("run") == self.run:
                self.redo[record["step"]] = record["fingerprint"]
                if "draw" in record:
                    self.redo_draws[record["step"]] = int(record["draw"])
        if self.main and source.resolve() == self.path.resolve():   # without the cut line: new lines start
            write_text_atomic(self.path, "".join(f"{line}\n" for line in kept))   # on a line of their own

    def begin(self) -> None:
        """The log exists from now on (owner-only), with no record yet: a checkpoint beside it
        resumes with nothing to redo."""
        if self.main:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, OWNER_ONLY))

    def fork_after_redone(self, noise, batches, released: int) -> None:
        """Fresh private streams (:func:`dpclip.rng.fork_private_streams`) after the redone steps
        (the log's after ``released``, the checkpoint's steps): ``batches``' draws (a
        :class:`~dpclip.integrations.loaders.PoissonBatches`; None: your own loader's batches)
        before the next one, however far ahead a loader fetches; ``noise`` once the last redone
        step is checked (at once if none)."""
        self.last_redone = max(self.redo, default=released)
        if batches is not None:
            batches.fork_after, batches.replay = self.last_redone, dict(self.redo_draws)
            batches.position_of[released] = batches.draws.step - 1   # the checkpoint's last draw
            self.batches = batches
        self.noise = noise
        if self.last_redone == released:
            fork_private_streams(noise)

    def check(self, step: int, grads: Iterable[Tensor]) -> None:
        """Step ``step`` released ``grads``: refused if it redoes a step that released others;
        logged if new."""
        now = fingerprint(grads)
        before = self.redo.pop(step, None)
        if before is not None:
            if now != before:
                raise DpclipError(
                    f"resuming did not reproduce step {step} as the interrupted run released it (another gradient: "
                    "random numbers drawn outside the checkpoint's streams, another device, thread count or library "
                    "version; or an earlier resume of this checkpoint went past its redone steps, on fresh streams "
                    "no resume can replay), so continuing would release the difference of two gradients without "
                    "noise; nothing of this step is released",
                    (f"{self.cause}; otherwise: " if self.cause else "") +
                    "resume on the machine and versions the run started with, without callbacks or model code "
                    "that draw random numbers between steps; after an earlier resume, from its newest checkpoint; "
                    "or start a new run")
            if step == self.last_redone:   # the next step is new
                fork_private_streams(self.noise)
            return
        if self.main:
            record = {"step": step, "fingerprint": now} if self.run is None else \
                {"step": step, "fingerprint": now, "run": self.run}
            draw = None if self.batches is None else self.batches.position_of.get(step)
            if draw is not None and draw != step - 1:
                record["draw"] = draw
            self._append(record)

    def _append(self, record: dict) -> None:
        """``record`` on a line of its own: this process's first one is not glued to a last line
        an older run's crash cut (resume_after would skip both)."""
        if not self.appended and self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as log:
                log.seek(-1, os.SEEK_END)
                if log.read(1) != b"\n":
                    append_line(self.path, "")
        self.appended = True
        append_line(self.path, json.dumps(record))
