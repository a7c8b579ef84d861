"""TensorBoard event files of a run, when the recipe asks (``logging.tensorboard: true``):
docs/training.md, "Plots and logging".

Each record the trainer writes to metrics.jsonl is forwarded here after it is written, so
the event files under ``RUN_DIR/tensorboard/`` hold exactly what metrics.jsonl holds: the
charged releases (ε, thresholds, noise std, the policy's released statistics) and the
run's learning rate under its own tag, and the exact diagnostics, the step times and the
held-out metrics only under the tag prefix ``not_covered_by_epsilon/``. Replayed steps of
a resumed run are never forwarded (the trainer skips them), so no step is written twice;
each record is flushed so that a killed run loses no event that metrics.jsonl kept.

The ``tensorboard`` package is an optional extra (``pip install 'dpclip[tensorboard]'``).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from dpclip import layout
from dpclip.files import owner_only, write_bytes_atomic
from dpclip.planning.plan import check_logging, tensorboard_installed

TENSORBOARD_DIR = layout.TENSORBOARD
NOT_COVERED_PREFIX = "not_covered_by_epsilon/"
#: The headline ε: what publishing the run costs (for a run a search selected, the search's ε).
EPSILON_TAG = "privacy/epsilon"
#: A search trial's ε of its own training alone (it understates what publishing it costs).
RUN_ALONE_EPSILON_TAG = "privacy/epsilon_this_run_alone"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def record_scalars(record: dict[str, Any], group_names: list[str],
                   epsilon_tag: str = EPSILON_TAG) -> list[tuple[str, float]]:
    """(tag, value) pairs of one metrics.jsonl record (see the module doc for the tags).

    Per-group values are tagged by group name (``thresholds/fc1``); the diagnostics and
    held-out metrics go under :data:`NOT_COVERED_PREFIX` (``not_covered_by_epsilon/train_loss``,
    ``not_covered_by_epsilon/eval_accuracy``).
    """
    out: list[tuple[str, float]] = []

    def add(tag: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{tag}/{key}", inner)
        elif isinstance(value, (list, tuple)):
            for k, inner in enumerate(value):
                add(f"{tag}/{group_names[k] if len(value) == len(group_names) else k}", inner)
        else:
            number = _number(value)
            if number is not None:
                out.append((tag, number))

    # Held-out metrics and diagnostics are exact (no noise): always under the prefix.
    if "eval" in record:
        for metric, value in record["eval"].items():
            add(f"{NOT_COVERED_PREFIX}eval_{metric}", value)
        return out
    add(epsilon_tag, record.get("epsilon"))
    add("train/lr", record.get("lr"))
    # Step time follows the realised (private) batch size: labelled like the diagnostics,
    # and absent from the record when privacy.exact_diagnostics is off.
    add(NOT_COVERED_PREFIX + "seconds_per_step", record.get("seconds"))
    add("thresholds", record.get("thresholds"))
    add("noise_std", record.get("noise_std"))
    add("policy", record.get("policy"))
    for key, value in (record.get("diagnostics") or {}).items():
        add(NOT_COVERED_PREFIX + key, value)
    return out


class TensorBoardLog:
    """A ``SummaryWriter`` over ``RUN_DIR/tensorboard/`` fed with metrics.jsonl records."""

    def __init__(self, run_dir: Path, group_names: list[str], epsilon_tag: str = EPSILON_TAG,
                 clock: bool = True):
        from torch.utils.tensorboard import SummaryWriter  # lazy: an optional extra

        self.path = Path(run_dir) / TENSORBOARD_DIR
        self.group_names = list(group_names)
        self.epsilon_tag = epsilon_tag
        # Each event's wall time follows the step's, which follows the realised batch size: without
        # exact diagnostics the events are stamped with their step number instead (1970 + step seconds).
        self.clock = clock
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.path))
        owner_only(self.path)   # the event file it just created (docs/accounting.md, "Threat model")

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in record_scalars(record, self.group_names, self.epsilon_tag):
            self.writer.add_scalar(tag, value, global_step=step, walltime=None if self.clock else float(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(recipe, run_dir: Path, group_names: list[str], *,
                     in_search: bool = False) -> TensorBoardLog | None:
    """The run's TensorBoard log if the recipe asks for one, else None. ``in_search``: the run
    is a trial of a tune-cost --run search (:func:`dpclip.rundir.searchdir.search_of_run`): its ε
    alone is not what publishing it costs, so it is not written as the headline; the search
    writes its own ε there if it selects the run."""
    if not recipe.logging.tensorboard:
        return None
    check_logging(recipe)
    return TensorBoardLog(run_dir, group_names, RUN_ALONE_EPSILON_TAG if in_search else EPSILON_TAG,
                          clock=recipe.privacy.exact_diagnostics)


#: The one event file of a run a search selected (TensorBoard reads any file named *tfevents*).
SELECTED_LOG = "events.out.tfevents.selected-by-search"


def rewrite_selected_log(run_dir: Path, epsilon: float, step: int, group_names: list[str]) -> None:
    """Rewrite the TensorBoard log, if it has one, of a run a search selected: the run's metrics.jsonl
    under the run-alone ε tag and the search's ε (:data:`EPSILON_TAG`) at ``step``, in one file.

    The trial's own event files cannot stay: their names hold the time the trial started and
    the process's count of event files (how many trials came before it), and their events the
    wall clock of each step; an appended file would hold the time the search ended. Together
    with the search's start (its directory's name) they tell K, which repeat-and-select keeps
    secret. The rewritten file holds no clock: each event is stamped with its step number."""
    path = Path(run_dir) / TENSORBOARD_DIR
    if not path.is_dir() or not tensorboard_installed():
        return
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    def event(at: int, tag: str, value: float) -> bytes:
        return Event(wall_time=float(at), step=at,
                     summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])).SerializeToString()

    records = [json.loads(line) for line in (Path(run_dir) / layout.METRICS).read_text().splitlines() if line.strip()]
    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    writer.write(Event(wall_time=0.0, file_version="brain.Event:2").SerializeToString())
    for record in records:
        for tag, value in record_scalars(record, group_names, RUN_ALONE_EPSILON_TAG):
            writer.write(event(int(record["step"]), tag, value))
    writer.write(event(int(step), EPSILON_TAG, float(epsilon)))
    write_bytes_atomic(path / SELECTED_LOG, buffer.getvalue())
    for old in path.iterdir():
        if old.name != SELECTED_LOG:
            old.unlink()
    owner_only(path)
