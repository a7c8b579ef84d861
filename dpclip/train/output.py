"""Where a run's records go: rank 0 writes the run directory (recipe, meta, plan, ledger,
metrics, TensorBoard) and shows progress to the observer; the other ranks write nothing.

A record of a step after the resumed checkpoint that already left the process before a
crash (``replay``) is not written again; it must be what the step released the first time.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpclip.data.canaries import write_canary_secret
from dpclip.data.exposure import write_exposure_secret
from dpclip.errors import DpclipError
from dpclip.files import OWNER_ONLY, private_dir, write_json_atomic, write_text_atomic
from dpclip.recipe import recipe_to_yaml
from dpclip.train.result import NullObserver, TrainObserver
from dpclip.rundir.metrics import append_record, released_part
from dpclip.rundir.run import RunDir, meta_record, public_plan_record


class RunOutput:
    """The run directory's writer and the observer of one process (module doc)."""

    def __init__(self, main: bool, observer: TrainObserver | None):
        self.main = main
        self.observer = (observer or NullObserver()) if main else NullObserver()  # rank 0 shows progress
        self.run_dir: Path | None = None
        self.tensorboard = None  # the optional TensorBoard log (recipe logging.tensorboard)
        # Records of steps after the resumed checkpoint that already left the process.
        self.replay: dict[tuple[str, int], dict[str, Any]] = {}
        self.written_state: set[str] | None = None   # plan.json's forward_written_state, once read
        self.written_count = 0   # the ranks' forward-written buffer names, counted each rank and summed

    def create(self, recipe, ordinary, canaries, info: dict[str, Any], run_dir: Path | None,
               exposure=None) -> Path:
        """A new run directory (``run_dir``, else a fresh one under the recipe's output_dir):
        recipe.yaml, meta.json, plan.json, the canaries' and planted secrets, an empty metrics.jsonl."""
        run = RunDir.new_run(recipe) if run_dir is None else RunDir(run_dir)
        if run.recipe_file.exists():
            raise DpclipError(f"{run.path} already holds a run", "resume it with --resume, or choose a new folder")
        private_dir(run.path)   # nothing in it is for others to read
        write_text_atomic(run.recipe_file, recipe_to_yaml(recipe))
        meta = meta_record(recipe, ordinary, info)
        write_json_atomic(run.meta_file, meta)
        write_json_atomic(run.plan_file, public_plan_record(meta))
        if canaries is not None:
            write_canary_secret(run.path, canaries)
        if exposure is not None:
            write_exposure_secret(run.path, exposure)
        run.metrics_file.touch(mode=OWNER_ONLY)
        self.run_dir = run.path
        return run.path

    def record_written_state(self, names: set[str]) -> None:
        """plan.json's ``forward_written_state``: the persistent buffers the model's training forward
        writes (the engine's, once a training forward wrote them), which the statement names as not covered by ε;
        rewritten only when a name is new, before anything of the step leaves the process."""
        if not self.main or not names:
            return
        run = RunDir(self.run_dir)
        if self.written_state is None:
            self.written_state = set(run.public_plan().get("forward_written_state", []))
        if names <= self.written_state:
            return
        self.written_state |= names
        write_json_atomic(run.plan_file, {**run.public_plan(), "forward_written_state": sorted(self.written_state)})

    @contextmanager
    def on_private_batch(self):
        """Where an error can follow the private data (the model, its loss, the engine and the
        certificate on the batch, what is computed from their outcome, the observer shown it): one
        raised here is recorded by :meth:`record_private_stop`. Writing what was computed (the ledger,
        metrics.jsonl, TensorBoard, plan.json) is outside: its failure does not follow the batch."""
        try:
            yield
        except Exception:
            self.record_private_stop()
            raise

    def record_private_stop(self) -> None:
        """plan.json's ``stopped_on_private_batch``: a step raised on its private batch (the model's
        error, a refusal of the certificate's), so the step the run stopped at follows that batch;
        every statement of the run says so from then on (docs/accounting.md). The flag is what the
        statement shows; the step is not recorded."""
        if not self.main or self.run_dir is None:
            return
        run = RunDir(self.run_dir)
        try:
            write_json_atomic(run.plan_file, {**run.public_plan(), "stopped_on_private_batch": True})
        except (OSError, DpclipError):   # (the step's own error is the one to show)
            pass

    def write_ledger(self, state, every_step: bool = False) -> None:
        """ledger.json, unless it is ahead (a resume redoing released steps). Every step: no
        fsync (the rename is atomic against a killed process, the crash that matters) and no
        ε (~0.1 s to compute); at checkpoints and the end: both."""
        if self.main and state.ledger.steps >= state.released_steps:
            write_json_atomic(RunDir(self.run_dir).ledger_file, state.ledger.to_dict(with_epsilon=not every_step),
                              durable=not every_step)

    def emit(self, record: dict[str, Any], kind: str) -> None:
        """Write a step or eval record and show it, unless it replays one that already left the process."""
        if not self.main:
            return
        with self.on_private_batch():   # whether a replayed record differs follows the batch
            previous = self.replay.get((kind, record["step"]))
            if previous is not None:
                if released_part(previous) != released_part(record):
                    raise DpclipError(
                        f"resuming did not reproduce step {record['step']} as first run (its released "
                        "statistics differ), so continuing would release them twice",
                        "resume with the same dpclip and torch versions, device and thread count as the run "
                        "started with, or start a new run")
                return
        append_record(RunDir(self.run_dir).metrics_file, record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        with self.on_private_batch():   # an observer's code sees the record
            (self.observer.on_step if kind == "step" else self.observer.on_eval)(record)

    def public_record(self, record: dict[str, Any]) -> None:
        """A public-phase record (docs/continual.md): metrics.jsonl and the progress display
        (public data only, nothing here is private)."""
        append_record(RunDir(self.run_dir).metrics_file, record)
        on_phase = getattr(self.observer, "on_phase", None)
        if on_phase is not None:
            on_phase(record)
