"""The run directory as files: what is in it, how it is written, and how it is checked.

A run directory is read back by ``--resume``, ``dpclip account RUN_DIR`` and ``audit-mia``.
Its files are input, not truth: the ledger is checked against the plan re-solved from the
recipe (:func:`check_ledger`), and the recipe against the privacy fingerprint written when
the run started. Which files are secret and which may be shared: docs/accounting.md,
"Threat model"; the layout: docs/training.md. metrics.jsonl's records are
:mod:`dpclip.rundir.metrics`'s; the device and thread count a run recorded are read back in
:mod:`dpclip.train.device`.
The recipe fields that decide the ledger (the privacy fingerprint): :mod:`dpclip.rundir.privacy_fields`.
"""

from __future__ import annotations

import platform
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from dpclip import __version__, layout
from dpclip.accounting import Ledger, same_event, solve, statement_from_ledger
from dpclip.accounting.plan import user_unit
from dpclip.data.canaries import read_canary_secret
from dpclip.rundir.checkpoint import checkpointed_steps
from dpclip.rundir.fingerprints import fingerprints
from dpclip.rundir.metrics import last_released_step
from dpclip.errors import DpclipError
from dpclip.files import read_json, write_json_atomic, write_text_atomic
from dpclip.recipe import Recipe, apply_overrides, read_yaml, recipe_to_yaml, validate_recipe
from dpclip.planning.plan import (forward_state_line, not_covered, not_covered_of_run, planned_private_steps,
                                  privacy_plan)
from dpclip.rundir.privacy_fields import privacy_fingerprint


#: How a run stopped that has no summary.json of its last step: killed, crashed or still running.
UNFINISHED = "unfinished"


class RunDir:
    """A run directory, or a search directory (``tune-cost --run``): its path, its
    well-known files and their loaders. The layout is in docs/training.md ("The run
    directory") and docs/tuning.md (the search directory).

    Nothing is created on construction; :meth:`new_run` and :meth:`new_search` only pick a
    fresh name (``NAME-YYYYmmdd-HHMMSS``, with ``-2``, ``-3`` ... if that exists already).
    """

    # The file names are dpclip.layout's (the one place they are spelled).
    RECIPE = layout.RECIPE
    META = layout.META
    PLAN = layout.PLAN
    LEDGER = layout.LEDGER
    METRICS = layout.METRICS
    SUMMARY = layout.SUMMARY
    CHECKPOINTS = layout.CHECKPOINTS
    SEARCH_MARKER = layout.SEARCH_MARKER
    SEARCH_RUNS = layout.SEARCH_RUNS

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------ naming

    @classmethod
    def unique(cls, output_dir: str | Path, name: str) -> RunDir:
        """``output_dir/name-TIMESTAMP``, suffixed ``-2``, ``-3`` ... until no such path exists."""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = Path(output_dir) / f"{name}-{stamp}"
        path, suffix = base, 1
        while path.exists():
            suffix += 1
            path = base.with_name(f"{base.name}-{suffix}")
        return cls(path)

    @classmethod
    def new_run(cls, recipe: Recipe) -> RunDir:
        """A fresh directory name for a run of ``recipe`` under its ``output_dir``."""
        return cls.unique(recipe.output_dir, recipe.name)

    @classmethod
    def new_search(cls, output_dir: str | Path, name: str) -> RunDir:
        """A fresh directory name for a search of the recipe ``name``."""
        return cls.unique(output_dir, f"{name}-search")

    # ------------------------------------------------------------------ files

    @property
    def recipe_file(self) -> Path:
        return self.path / self.RECIPE

    @property
    def meta_file(self) -> Path:
        return self.path / self.META

    @property
    def plan_file(self) -> Path:
        return self.path / self.PLAN

    @property
    def ledger_file(self) -> Path:
        return self.path / self.LEDGER

    @property
    def metrics_file(self) -> Path:
        return self.path / self.METRICS

    @property
    def summary_file(self) -> Path:
        return self.path / self.SUMMARY

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def search_marker(self) -> Path:
        return self.path / self.SEARCH_MARKER

    @property
    def search_runs(self) -> Path:
        return self.path / self.SEARCH_RUNS

    # ------------------------------------------------------------------ loaders

    def recipe(self) -> Recipe:
        """The run's recipe.yaml, validated (the directory must be a run's)."""
        if not self.recipe_file.exists():
            trained = (self.path / layout.LEDGER).exists() or any(self.path.glob("checkpoints/*"))
            raise DpclipError(f"{self.path} is not a dpclip run directory (no recipe.yaml)", "pass the folder that "
                              "`dpclip train` created under runs/" + ("" if trained else "; if this is one, stopped "
                                                                     "in its first second, it took no step and spent "
                                                                     "nothing: delete it"))
        return validate_recipe(read_yaml(self.recipe_file), source=str(self.recipe_file))

    def meta(self) -> dict[str, Any]:
        if not self.meta_file.exists():
            raise DpclipError(f"{self.path} has no meta.json", "pass the folder that `dpclip train` created under runs/")
        return _read_run_json(self.meta_file)

    def public_plan(self) -> dict[str, Any]:
        """What the privacy statement is rebuilt from, read from plan.json (released): the
        privacy fingerprint, the training-set size (the statement's sampling rate already
        states it), the process count and the clipping groups' names. Readers of released
        files (`dpclip report`, `dpclip export`, `dpclip account RUN`) use this, never
        meta.json; runs made before plan.json existed fall back to meta.json's same fields."""
        if self.plan_file.exists():
            return _read_run_json(self.plan_file)
        return public_plan_record(self.meta())

    def ledger(self):
        """ledger.json as a Ledger (unchecked: see :func:`check_ledger`)."""
        return read_ledger(self.ledger_file)

    def summary(self) -> dict[str, Any]:
        return _read_run_json(self.summary_file)

    def stopped(self, steps_done: int) -> str:
        """Why the run stopped, as its summary.json says ("completed", "budget", "interrupted"), or
        :data:`UNFINISHED` without a summary of its ``steps_done`` released steps (it was killed or
        crashed, or is still running; an earlier stop's summary is stale once a resume steps on)."""
        try:
            summary = self.summary() if self.summary_file.exists() else {}
        except ValueError:
            summary = {}
        if not isinstance(summary, dict) or summary.get("steps_done") != steps_done:
            return UNFINISHED
        return str(summary.get("stopped", UNFINISHED))


def run_recipe_with(run_dir: Path, overrides: list[str]) -> Recipe:
    """The run's recipe.yaml with ``key=value`` overrides (``dpclip train --resume RUN_DIR
    key=value``). Its paths were resolved when the run started and are left as stored, so
    the privacy fingerprint cannot move; the trainer refuses overrides of privacy fields."""
    run = RunDir(run_dir)
    if not run.recipe_file.exists():
        run.recipe()  # the error for a folder that is not a run
    return validate_recipe(apply_overrides(read_yaml(run.recipe_file), overrides),
                           source=f"{run.recipe_file} with overrides")


def record_resume_changes(run: RunDir, recipe: Recipe, step: int, changes: dict[str, list[Any]]) -> None:
    """A resume that changed non-privacy fields: the new recipe.yaml, and in meta.json the
    step from which they apply (``resumes``: [{step, changes}])."""
    if privacy_fingerprint(recipe) != run.meta().get("privacy_fingerprint"):
        raise DpclipError("cannot resume: the changed recipe has another privacy fingerprint",
                          "only non-privacy fields may change on resume")
    meta = run.meta()
    meta.setdefault("resumes", []).append({"step": step, "changes": changes})
    # what the replaced recipe's part of the run released outside ε stays stated (planning/plan.py)
    plan = run.public_plan()
    earlier = plan.get("earlier_not_covered", [])
    earlier += [line for line in not_covered(run.recipe()) if line not in earlier]
    write_json_atomic(run.plan_file, {**plan, "earlier_not_covered": earlier})
    write_text_atomic(run.recipe_file, recipe_to_yaml(recipe))
    write_json_atomic(run.meta_file, meta)


def load_run_recipe(run_dir: Path) -> Recipe:
    """The recipe of the run in ``run_dir`` (:meth:`RunDir.recipe`; many readers need it)."""
    return RunDir(run_dir).recipe()


def _read_run_json(path: Path) -> dict[str, Any]:
    """A JSON object of the run directory, or an error naming the damaged file."""
    try:
        record = read_json(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DpclipError(f"{path} cannot be read ({type(exc).__name__}): it is damaged",
                          "restore it from a backup of the run directory") from None
    if not isinstance(record, dict):
        raise DpclipError(f"{path} is damaged: it holds no JSON object", "restore it from a backup of the run directory")
    return record


def spent(run_dir: Path):
    """(ledger, statement) of what a run has spent so far, from its ledger.json (checked
    against the run's own plan: see :func:`check_ledger`)."""
    run = RunDir(run_dir)
    recipe = run.recipe()
    path = run.ledger_file
    if not path.exists():
        raise DpclipError(f"{run.path} has no ledger.json", "restore ledger.json from a backup of the run"
                          if checkpointed_steps(run.path) else "the run never reached its first step")
    ledger = run.ledger()
    solved, steps = planned_step(run.path, recipe)
    if (saved := checkpointed_steps(run.path)) > ledger.steps:   # the ledger is written before each checkpoint
        raise DpclipError(f"{path} records {ledger.steps} steps, but checkpoint step_{saved:06d} holds the weights "
                          f"after {saved}: ε would be understated", "the run directory was modified: restore "
                          "ledger.json from a backup of the run")
    if (recorded := last_released_step(run.metrics_file)) > ledger.steps:   # and before each step's record
        raise DpclipError(f"{path} records {ledger.steps} steps, but metrics.jsonl records step {recorded}: ε would "
                          "be understated", "the run directory was modified: restore ledger.json from a backup")
    check_ledger(ledger, solved, range(0, steps + 1), where=path)
    return ledger, run_statement(recipe, ledger, world_size=recorded_world_size(run.path),
                                 users=recorded_count(run.path, "num_users"), written=recorded_written_state(run.path),
                                 plan=run.public_plan())


def run_statement(recipe: Recipe, ledger, *, world_size: int = 1, users: int | None = None, written=(),
                  plan: dict | None = None):
    """The privacy statement of a run's ledger, with the recipe's randomness mode, what the
    run releases outside ε (``written``: the buffers the forward writes; ``plan``: the run's
    plan.json, with its earlier recipes' lines and its stop), and how many processes trained it
    (docs/distributed.md)."""
    unit = user_unit(users, recipe.data.max_examples_per_user) if recipe.privacy.unit == "user" else None
    return statement_from_ledger(ledger, sampling=recipe.training.sampling,
                                 seeded_randomness=recipe.privacy.unsafe_seeded_randomness,
                                 not_covered=not_covered_of_run(recipe, plan) + forward_state_line(written),
                                 world_size=world_size,
                                 parallel=recipe.training.parallel, bands=recipe.privacy.mechanism.bands,
                                 unit=unit)


#: The most processes a run may record (and train with: :func:`dpclip.train.ranks.check_ranks`). plan.json's
#: world_size goes into every statement ("data parallel over W processes"); a hand edit past this is refused.
MAX_WORLD_SIZE = 1 << 20


def recorded_world_size(run_dir: Path) -> int:
    """The number of processes plan.json says trained the run (1: runs before --nproc)."""
    value = RunDir(run_dir).public_plan().get("world_size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD_SIZE:
        raise DpclipError(f"{RunDir(run_dir).plan_file} records world_size {value!r}, which is not a process count "
                          f"(a whole number from 1 to {MAX_WORLD_SIZE:,})",
                          "the run directory was modified: restore plan.json from a backup of the run (its "
                          "world_size is the number of processes that trained it, 1 without --nproc)")
    return value


def recorded_count(run_dir: Path, key: str) -> int | None:
    """plan.json's ``num_train`` or ``num_users`` (None when not recorded): a whole number >= 1, since q
    is re-solved from it and the statement names it ("90 people")."""
    value = RunDir(run_dir).public_plan().get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DpclipError(f"{RunDir(run_dir).plan_file} records {key} {value!r}, which is not a count",
                          "the run directory was modified: restore plan.json from a backup of the run")
    return value


def recorded_written_state(run_dir: Path) -> list[str]:
    """The buffers plan.json says the model's training forward writes (the engine's
    ``forward_written_state``, recorded as the run saw them; none in runs made before)."""
    value = RunDir(run_dir).public_plan().get("forward_written_state", [])
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise DpclipError(f"{RunDir(run_dir).plan_file} records forward_written_state {value!r}, which is not a list "
                          "of buffer names", "the run directory was modified: restore plan.json")
    return value


def read_ledger(path: Path):
    try:
        return Ledger.from_dict(read_json(path))
    except (ValueError, KeyError, TypeError) as exc:
        raise DpclipError(f"{path} is not a readable dpclip ledger ({exc})",
                          "the run directory was modified: restore it from a backup") from None


def planned_step(run_dir: Path, recipe: Recipe):
    """(solved plan, planned private steps) of the run in ``run_dir``, re-solved from its recipe
    and the sizes in plan.json (the recipe's privacy fields must match the fingerprint); no
    steps for only-public (:func:`~dpclip.planning.plan.planned_private_steps`)."""
    run = RunDir(run_dir)
    public = run.public_plan()
    if public.get("privacy_fingerprint") != privacy_fingerprint(recipe):
        raise DpclipError(f"the privacy fields of {run.recipe_file} were edited after the run started",
                          "the ledger would no longer describe the run; restore recipe.yaml")
    try:
        key = "num_users" if recipe.privacy.unit == "user" else "num_train"
        if not (isinstance(public["groups"], list) and all(isinstance(name, str) for name in public["groups"])):
            raise TypeError("its groups are not a list of names")
        plan = privacy_plan(recipe, recorded_count(run_dir, key) or public[key], groups=len(public["groups"]))
    except (KeyError, TypeError, ValueError) as exc:
        source = run.plan_file if run.plan_file.exists() else run.meta_file
        raise DpclipError(f"{source} lacks the run's sizes ({exc})", f"restore {source.name}") from None
    return solve(plan), planned_private_steps(recipe, plan.steps)


def check_ledger(ledger, solved, steps: int | range, *, where: Path | str) -> None:
    """Refuse a ledger that is not the run's: the entry of every recorded step must be the
    plan's event for that step (``solved.event_at``: the step event, a banded-MF or BLT cycle's
    no-op, BLT's participation charge), and the number of recorded steps must be ``steps``
    (an int, or a range of allowed counts).

    Ledgers are read from the run directory, which anyone with write access can edit; a
    ledger with fewer steps or a larger σ than were used would understate ε. The count is
    checked first: an edited count of 10^30 would otherwise be walked step by step."""
    allowed = range(steps, steps + 1) if isinstance(steps, int) else steps
    if ledger.steps not in allowed:
        want = str(steps) if isinstance(steps, int) else f"{allowed.start} to {allowed.stop - 1}"
        raise DpclipError(f"{where} records {ledger.steps} steps where the run allows {want}",
                          "the run directory was modified: restore it from a backup")
    step = 0
    for entry in ledger.entries:
        for offset in range(entry.count):
            expected = solved.event_at(step + offset)
            if not _same_event(entry.event, expected):
                raise DpclipError(f"{where} records {entry.event} at step {step + offset + 1}, which is not this "
                                  f"run's step event there, {expected}",
                                  "the run directory was modified or mixed with another run's: restore it")
        step += entry.count


def _same_event(recorded, expected) -> bool:
    """:func:`~dpclip.accounting.same_event`, False for a recorded event whose fields are not numbers
    (dp_accounting's events take any value: an edited ledger's ``"sampling_probability": "x"``)."""
    try:
        return same_event(recorded, expected)
    except (TypeError, ValueError, AttributeError):
        return False


def check_canaries(run_dir: Path, canaries) -> None:
    """On resume, the rebuilt canaries must be the ones the run started with."""
    stored = read_canary_secret(run_dir)
    if stored is None or stored["fingerprint"] != canaries.fingerprint() \
            or stored["included"] != [bool(b) for b in canaries.included]:
        raise DpclipError(f"{layout.canaries_file(run_dir)} does not match the recipe's canaries",
                          "restore the file, or start a new run")


def public_plan_record(meta: dict[str, Any]) -> dict[str, Any]:
    """plan.json's fields, from meta.json's: nothing of the membership, the data's
    fingerprints, the seed or the canaries (docs/accounting.md, "Threat model")."""
    plan = meta.get("plan", {})
    record = {"privacy_fingerprint": meta.get("privacy_fingerprint"), "num_train": plan.get("num_train"),
              "world_size": plan.get("world_size", 1), "groups": meta.get("groups")}
    if plan.get("num_users") is not None:  # user-level: q counts people (docs/users.md)
        record["num_users"] = plan["num_users"]
    return record


def meta_record(recipe: Recipe, data, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "dpclip": __version__,
        "torch": torch.__version__,
        "dp_accounting": version("dp-accounting"),
        "python": platform.python_version(),
        "seed": recipe.seed,
        "privacy_fingerprint": privacy_fingerprint(recipe),
        "data": {**data.describe(), **fingerprints(data)},
        "members": [int(i) for i in data.train_indices],
        "non_members": [int(i) for i in data.test_indices],
        # what drew the members (dpclip.train.parts.split_key): as secret as they are
        "split_key": getattr(data, "split_key", None),
        "plan": {k: v for k, v in info.items() if k != "groups"},
        "groups": info["groups"],
        "created": datetime.now().isoformat(timespec="seconds"),
    }
