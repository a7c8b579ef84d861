"""The training workflow as a trainer: recipe -> data, model, engine, ledger -> run directory.

:meth:`Trainer.setup` builds a run in named steps (docs/training.md, "How a run is put
together"); :meth:`Trainer.train` then loops over :class:`~dpclip.train.step.PrivateStep`,
the one private step, and charges each step in the ledger before anything of it leaves
the process. Nothing else touches the private data, except the diagnostics in
metrics.jsonl (training loss, clip fractions, norm quantiles), which are computed without
noise, are not covered by ε, and are labelled so.

Length: above ~400 lines on purpose: setup, resume, the loop, checkpoints and the
deferred interrupt share the trainer's state (step, ledger, generators); split apart,
each part would reach into the others' attributes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dpclip.accounting import Ledger, solve
from dpclip.data import PoissonSampler, ShuffleSampler, load_data
from dpclip.distributed import ShardedPoissonSampler, ShardedShuffleSampler, World
from dpclip.distributed.pipeline import PipelineStep, pipeline_engine, pipeline_input, sync_stages
from dpclip.data.canaries import make_canaries, with_canaries, write_canary_secret
from dpclip.engine import DPEngine
from dpclip.errors import DpclipError
from dpclip.files import write_json_atomic, write_text_atomic
from dpclip.models import build_model, evaluate
from dpclip.recipe import Recipe, recipe_to_yaml
from dpclip.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dpclip.train.diagnostics import recorder_for
from dpclip.train.interrupt import _deferred_interrupt
from dpclip.train.optim import LrSchedule, build_optimizer
from dpclip.train.phases import continual_run
from dpclip.train.plan import count_groups, engine_clipping, privacy_plan, private_seed
from dpclip.train.plots import plot_run
from dpclip.train.result import TrainObserver, TrainResult, _Null  # noqa: F401 (TrainObserver: re-exported)
from dpclip.train.ranks import (check_ranks, check_world_size, global_outcome, rank_states, setup_recipe,
                                share_run_state)
from dpclip.train.searchdir import search_of_run
from dpclip.train.rundir import (
    PLAN_FIELDS, RunDir, _append_metrics, _check_canaries, _check_data, _check_same_release, _meta, _privacy_diff,
    public_plan_record,
    _read_ledger, _released_part, _released_records, check_ledger, privacy_fingerprint, recipe_changes,
    record_resume_changes, run_statement, step_record)
from dpclip.train.step import PrivateStep, step_micro_batch_size, step_precision
from dpclip.train.tensorboard import check_logging, open_tensorboard


class Trainer:
    """One private training run of a recipe (or the resumption of one); see the module doc.

    ``data`` and ``run_dir`` serve ``dpclip audit-mia``'s shadow models (LiRA), which train
    the same recipe on a chosen subset of examples: ``data`` (a PrivateData) replaces what
    ``recipe.data`` would load, and ``run_dir`` is the exact directory of a new run instead
    of a fresh ``output_dir/name-TIMESTAMP``. Pass the same ``data`` to resume.

    ``recipe`` with ``resume``: the run's recipe with non-privacy fields changed (a new
    learning rate, more evaluation); privacy fields and the model must stay the run's.
    ``file_recipe``: the recipe before ``key=value`` overrides, whose plan's σ is reported
    beside the run's when the overrides change the steps or the batch size.
    ``world``: this process's rank in a data-parallel run (docs/distributed.md); None: one process.
    """

    def __init__(self, recipe: Recipe | None = None, *, resume: Path | None = None, dry_run: bool = False,
                 observer: TrainObserver | None = None, data=None, run_dir: Path | None = None,
                 file_recipe: Recipe | None = None, world: World | None = None):
        self.recipe = recipe
        self.world = world or World()
        # The recipe as its file says, before key=value overrides: σ is compared with its plan.
        self.file_recipe = file_recipe
        self.sigma_change: dict[str, Any] | None = None
        self.resume_changes: dict[str, list[Any]] = {}
        self.resume = None if resume is None else Path(resume)
        self.dry_run = dry_run
        self.observer = (observer or _Null()) if self.world.main else _Null()  # rank 0 shows progress
        self.data = data
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.pipeline = False  # one stage per rank (training.parallel: pipeline), set with the recipe
        self.step = 0
        self.step_seconds = 0.0  # this process's private steps' wall time (never written: see TrainResult)
        # ledger.json counts every release that has left the process; after a crash it may be
        # ahead of the checkpoint we resume from, and it never moves back.
        self.released_steps = 0
        # Records of steps after the resumed checkpoint that already left the process.
        self.replay: dict[tuple[str, int], dict[str, Any]] = {}
        self.tensorboard = None  # the optional TensorBoard log (recipe logging.tensorboard)
        # When the last checkpoint was made (checkpoint.every_minutes counts from it).
        self._last_save = time.monotonic()

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Build the run, in this order (the global RNG is seeded first, so the order matters)."""
        setup_recipe(self)  # across ranks: rank 0 resolves it, every rank checks it meant the same
        self.pipeline = self.recipe.training.parallel == "pipeline"
        self._setup_data()
        check_ranks(self)
        self._setup_model()
        self._setup_privacy()
        self._setup_engine()
        self._setup_optimizer()
        self._setup_sampler()
        self.continual = continual_run(self)  # public data and phases (docs/continual.md), or None
        self.ledger = Ledger(self.plan.delta, self.plan.accountant)
        self.diagnostics = recorder_for(self)  # Hessian diagnostics (recipe diagnostics:), or a no-op

    def _setup_recipe(self) -> None:
        """On resume, the run's own recipe.yaml, refused if its privacy fields were edited."""
        if self.resume is not None:
            run = RunDir(self.resume)
            stored = run.recipe()
            if run.meta().get("privacy_fingerprint") != privacy_fingerprint(stored):
                raise DpclipError(f"the privacy fields of {run.recipe_file} were edited after the run started",
                                  "the ledger would no longer describe the run; restore recipe.yaml or start a new run")
            if self.recipe is not None:
                changed = _privacy_diff(stored, self.recipe)
                if changed:
                    # Name the changed leaves (privacy.epsilon), not only their section (privacy).
                    changed = [key for key in recipe_changes(stored, self.recipe)
                               if any(key == f or key.startswith(f + ".") for f in changed)] or changed
                    raise DpclipError(f"cannot resume: the recipe changes privacy fields {', '.join(changed)} "
                                      "of the run", "resume with the run's own recipe: dpclip train --resume RUN_DIR; "
                                      "only other fields (e.g. training.optimizer.lr=0.1) may change on resume")
                self.resume_changes = recipe_changes(stored, self.recipe)
                if any(key == "model" or key.startswith("model.") for key in self.resume_changes):
                    raise DpclipError("cannot resume: the recipe changes the model "
                                      f"({', '.join(k for k in self.resume_changes if k.startswith('model'))})",
                                      "the checkpoint holds the weights of the run's own model; start a new run")
            else:
                self.recipe = stored
        if self.recipe is None:
            raise DpclipError("nothing to train", "pass a recipe file, or --resume RUN_DIR")

    def _setup_data(self) -> None:
        # The global RNG drives only what is not private (dropout); noise and batches have their own
        # generators from OS entropy (dpclip.rng).
        torch.manual_seed(self.recipe.seed)
        if self.data is None:
            self.data = load_data(self.recipe.data, seed=self.recipe.seed)

    def _setup_model(self) -> None:
        self.model, self.loss_fn = build_model(self.recipe.model, self.data, seed=self.recipe.seed)

    def _setup_privacy(self) -> None:
        """The privacy plan and its noise split; the canaries join the data after N is counted."""
        recipe, model = self.recipe, self.model
        # A statistic's sensitivity grows with the number of groups, which depends on the model.
        num_groups = count_groups(recipe, model)
        # N is the number of ordinary training examples, counted before any canary goes in
        # (see dpclip.data.canaries: q = B/N applies to canaries too, as `dpclip account` says).
        self.plan = privacy_plan(recipe, self.data.num_train, groups=num_groups)
        self.ordinary = self.data
        self.canaries = None
        if recipe.audit.canaries is not None:
            self.canaries = make_canaries(self.data, recipe.audit.canaries, recipe.seed)
            self.data = with_canaries(self.data, self.canaries)
        self.solved = solve(self.plan)
        self.split = self.solved.split
        self.sigma_change = self._sigma_change(num_groups)
        # Private randomness (noise, batches) comes from OS entropy unless the recipe opts in.
        self.seed_of_noise = private_seed(recipe)

    def _sigma_change(self, num_groups: int) -> dict[str, Any] | None:
        """σ (or ε, at a given σ) of the recipe file's own plan beside this run's, when the
        overrides changed what the plan depends on (steps, batch size, sampling): ε is what
        the recipe fixes, so fewer steps mean less noise per step (docs/training.md)."""
        reference = self.file_recipe
        if reference is None or self.resume is not None or reference.data != self.recipe.data:
            return None
        changed = {key: value for key, value in recipe_changes(reference, self.recipe).items()
                   if key in PLAN_FIELDS or key.startswith("privacy.")}
        if not any(key in PLAN_FIELDS for key in changed):
            return None
        try:
            before = solve(privacy_plan(reference, self.ordinary.num_train, groups=num_groups))
        except DpclipError:
            return None  # the file's own plan is not feasible on this data; the run's is
        return {"changed": changed, "sigma_file": before.split.noise_multiplier, "sigma": self.split.noise_multiplier,
                "epsilon_file": before.epsilon, "epsilon": self.solved.epsilon,
                "calibrated": self.plan.target_epsilon is not None}

    def _setup_engine(self) -> None:
        training = self.recipe.training
        if self.pipeline:  # this rank's stage and its engine (docs/distributed.md, "Pipeline stages")
            self.engine = pipeline_engine(self.model, engine_clipping(self.recipe, self.split.sigma_aux), self.world,
                                          gradient_noise_multiplier=self.split.gradient_noise_multiplier,
                                          expected_batch_size=training.batch_size, seed=self.seed_of_noise,
                                          sample_rate=self.plan.sample_rate)
            return
        self.engine = DPEngine(self.model, engine_clipping(self.recipe, self.split.sigma_aux),
                               gradient_noise_multiplier=self.split.gradient_noise_multiplier,
                               expected_batch_size=training.batch_size,
                               seed=self.seed_of_noise, sample_rate=self.plan.sample_rate, reducer=self.world.reducer)

    def _setup_optimizer(self) -> None:
        training = self.recipe.training
        owned = self.engine.module if self.pipeline else self.model  # a stage trains its own parameters
        self.optimizer = build_optimizer(training.optimizer, [p for p in owned.parameters() if p.requires_grad])
        # Base lrs are read now, before a resumed optimizer state overwrites the scheduled ones.
        self.schedule = LrSchedule(self.optimizer, training.schedule, self.plan.steps)
        if self.pipeline:
            self.private_step = PipelineStep(self.engine, self.optimizer, self.data.train, self.loss_fn.criterion,
                                             pipeline_input(self.loss_fn),
                                             training.micro_batch_size or training.batch_size)
            return
        self.private_step = PrivateStep(self.model, self.loss_fn, self.engine, self.optimizer, self.data.train,
                                        micro_batch_size=step_micro_batch_size(self.recipe),
                                        precision=step_precision(self.recipe, self.model))

    def _setup_sampler(self) -> None:
        training, plan = self.recipe.training, self.plan
        sharded = self.world.size > 1 and not self.pipeline  # a pipeline's batches are rank 0's draws
        if sharded and training.sampling == "poisson":  # each rank draws its own examples' part
            self.sampler = ShardedPoissonSampler(self.data.num_train, plan.sample_rate, plan.steps,
                                                 rank=self.world.rank, world_size=self.world.size,
                                                 seed=self.seed_of_noise)
        elif sharded:  # rank 0 draws each epoch's permutation; each rank takes its slice
            self.sampler = ShardedShuffleSampler(self.data.num_train, training.batch_size, plan.steps,
                                                 rank=self.world.rank, world_size=self.world.size,
                                                 broadcast_=self.world.broadcast_, seed=self.seed_of_noise)
        elif training.sampling == "poisson":
            self.sampler = PoissonSampler(self.data.num_train, plan.sample_rate, plan.steps, seed=self.seed_of_noise)
        else:
            self.sampler = ShuffleSampler(self.data.num_train, training.batch_size, plan.steps, seed=self.seed_of_noise)

    def info(self) -> dict[str, Any]:
        """What the run is about to do (the observer's start, and meta.json's plan)."""
        recipe, plan, split = self.recipe, self.plan, self.split
        return {
            "name": recipe.name, "steps": plan.steps, "sample_rate": plan.sample_rate,
            "num_train": self.ordinary.num_train, "num_test": self.data.num_test,
            "canaries_included": None if self.canaries is None else int(self.canaries.included.sum()),
            "groups": self.engine.group_names, "noise_multiplier": split.noise_multiplier,
            "gradient_noise_multiplier": split.gradient_noise_multiplier, "sigma_aux": split.sigma_aux,
            "planned_epsilon": self.solved.epsilon, "delta": plan.delta, "accountant": plan.accountant,
            "epsilon_cap": recipe.privacy.epsilon,
            "parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "seeded_randomness": recipe.privacy.unsafe_seeded_randomness,
            "exact_diagnostics": recipe.privacy.exact_diagnostics,
            "sigma_change": self.sigma_change, "resume_changes": self.resume_changes,
            "threads": torch.get_num_threads(),  # a resume replays steps: same count (dpclip.threads)
            "world_size": self.world.size,
            "continual": None if self.continual is None else self.continual.info(),
        }

    def _setup_run_dir(self, info: dict[str, Any]) -> None:
        """A new run directory (with its step-0 checkpoint), or the resumed run's state: rank 0
        reads and writes the files, and the other ranks take its state (dpclip.train.ranks)."""
        if self.resume is not None:
            share_run_state(self, self.world.on_main(self._resume_from_checkpoint))
        else:
            self.run_dir = self.world.on_main(self._new_run_dir, info)
            share_run_state(self, None)
            # Step 0 is checkpointed (with the generators' states) so that a crash before the
            # first regular checkpoint resumes into the same noise and batches.
            self._save()
        self._write_ledger()

    def _new_run_dir(self, info: dict[str, Any]) -> Path:
        run = RunDir.new_run(self.recipe) if self.run_dir is None else RunDir(self.run_dir)
        if run.recipe_file.exists():
            raise DpclipError(f"{run.path} already holds a run", "resume it with --resume, or choose a new folder")
        run.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run.recipe_file, recipe_to_yaml(self.recipe))
        meta = _meta(self.recipe, self.ordinary, info)
        write_json_atomic(run.meta_file, meta)
        write_json_atomic(run.plan_file, public_plan_record(meta))
        if self.canaries is not None:
            write_canary_secret(run.path, self.canaries)
        run.metrics_file.touch()
        self.run_dir = run.path
        return run.path

    def _resume_from_checkpoint(self) -> dict[str, Any]:
        run = RunDir(self.resume)
        self.run_dir = run.path
        step_event, steps = self.solved.step_event, self.plan.steps
        checkpoint = latest_checkpoint(run.path)
        if checkpoint is None:
            raise DpclipError(f"{run.path} has no checkpoint to resume from",
                              "the run stopped before its first step was saved; start a new run")
        state = load_checkpoint(checkpoint, self.model)
        check_world_size(state, self.world.size, run.path)
        self.step = int(state["step"])
        self.ledger = Ledger.from_dict(state["ledger"])
        check_ledger(self.ledger, step_event, self.step, where=checkpoint / "state.json")
        released = _read_ledger(run.ledger_file) if run.ledger_file.exists() else self.ledger
        check_ledger(released, step_event, range(self.step, steps + 1), where=run.ledger_file)
        self.released_steps = released.steps
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.engine.load_state_dict(state["engine"])
        torch.set_rng_state(state["torch_rng"])
        if self.continual is not None:
            self.continual.load_state_dict(state.get("continual"), run.metrics_file)
        # Steps after the checkpoint that already left the process are redone with the
        # checkpoint's generator states, so they must release exactly what they did.
        self.replay = _released_records(run.metrics_file, self.step)
        if self.canaries is not None:
            _check_canaries(run.path, self.canaries)
        _check_data(run, self.ordinary)
        if self.resume_changes:
            # The run directory says what its later steps were trained with (the privacy
            # fields, and so the fingerprint, are unchanged: checked in _setup_recipe).
            record_resume_changes(run, self.recipe, self.step, self.resume_changes)
        return state

    # ------------------------------------------------------------------ files

    def _save(self) -> None:
        if self.pipeline:  # rank 0 saves the whole model: each stage's weights from its rank
            sync_stages(self.model, self.engine.bounds, self.world)
        ranks = rank_states(self)  # every rank's sampler and RNG state, on rank 0 (None: one process)
        if not self.world.main:
            return
        # The ledger goes to disk before the checkpoint that depends on it is made current.
        self._write_ledger()
        state = {
            "step": self.step, "optimizer": self.optimizer.state_dict(), "sampler": self.sampler.state_dict(),
            "engine": self.engine.state_dict(), "torch_rng": torch.get_rng_state(), "ledger": self.ledger.to_dict(),
        }
        if self.continual is not None:
            state["continual"] = self.continual.state_dict()
        if ranks is not None:
            state["ranks"] = ranks
        save_checkpoint(self.run_dir, self.step, self.model, state, keep=self.recipe.checkpoint.keep)
        self._last_save = time.monotonic()

    def _write_ledger(self, every_step: bool = False) -> None:
        # Every step: no fsync (the rename is atomic against a killed process, the crash
        # that matters) and no ε (~0.1 s to compute); at checkpoints and the end: both.
        if self.world.main and self.ledger.steps >= self.released_steps:
            write_json_atomic(RunDir(self.run_dir).ledger_file, self.ledger.to_dict(with_epsilon=not every_step),
                              durable=not every_step)

    def _emit(self, record: dict[str, Any], kind: str) -> None:
        """Write a record and show it, unless it replays one that already left the process."""
        if not self.world.main:
            return
        previous = self.replay.get((kind, record["step"]))
        if previous is not None:
            if _released_part(previous) != _released_part(record):
                raise DpclipError(
                    f"resuming did not reproduce step {record['step']} as first run (its released "
                    "statistics differ), so continuing would release them twice",
                    "resume with the same dpclip and torch versions, device and thread count as the run "
                    "started with, or start a new run")
            return
        _append_metrics(RunDir(self.run_dir).metrics_file, record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        (self.observer.on_step if kind == "step" else self.observer.on_eval)(record)

    def _run_eval(self) -> dict[str, float]:
        if self.pipeline and self.recipe.privacy.exact_diagnostics:  # rank 0 evaluates the whole model
            sync_stages(self.model, self.engine.bounds, self.world)
        if not self.recipe.privacy.exact_diagnostics or not self.world.main:  # exact: not covered by ε
            return {}
        metrics = evaluate(self.model, self.loss_fn, self.data.test, self.data.task,
                           batch_size=self.recipe.eval.batch_size)
        self._emit({"step": self.step, "eval": metrics, "not_covered_by_epsilon": ["eval"]}, "eval")
        return metrics

    # ------------------------------------------------------------------ training

    def train(self) -> TrainResult:
        """Set up, then train until the planned steps, the ε cap or Ctrl-C; returns the result."""
        self.setup()
        check_logging(self.recipe)  # before the run directory exists
        info = self.info()
        if self.dry_run:
            return self._dry_run(info)
        self._setup_run_dir(info)
        if self.world.main:
            self.tensorboard = open_tensorboard(self.recipe, self.run_dir, self.engine.group_names,
                                                in_search=self.recipe.logging.tensorboard
                                                and search_of_run(Path(self.run_dir)) is not None)
        self.observer.on_start({**info, **self.info(), "run_dir": str(self.run_dir), "start_step": self.step,
                                "dry_run": False})  # self.info() again: the resumed phase
        stopped = self._loop()
        final_eval = self._run_eval() if stopped != "interrupted" else {}
        self._save()
        if not self.world.main:  # rank 0 has the ledger's ε and writes the summary
            return TrainResult(self.run_dir, self.step, self.plan.steps, float("nan"), float("nan"), self.plan.delta,
                               stopped)
        accounting = self.ledger.result()
        statement = run_statement(self.recipe, self.ledger, world_size=self.world.size)
        result = TrainResult(self.run_dir, self.step, self.plan.steps, accounting.epsilon, accounting.epsilon_rdp,
                             self.plan.delta, stopped, final_eval, statement.lines(), self.solved.step_metadata,
                             self.sigma_change, self.resume_changes, step_seconds=self.step_seconds)
        run = RunDir(self.run_dir)
        write_json_atomic(run.summary_file, result.to_dict())
        if self.tensorboard is not None:
            self.tensorboard.close()
        plot_run(run.path, self.engine.group_names, policy=self.recipe.clipping.threshold.kind,
                 epsilon_cap=self.recipe.privacy.epsilon, delta=self.plan.delta)
        self.diagnostics.finish(run.path)
        self.observer.on_end(result)
        return result

    def _dry_run(self, info: dict[str, Any]) -> TrainResult:
        self.observer.on_start({**info, "run_dir": None, "dry_run": True})
        self.engine.detach()
        solved = self.solved
        result = TrainResult(Path("-"), 0, self.plan.steps, solved.epsilon, solved.epsilon_rdp, self.plan.delta,
                             "dry-run", statement=replace(solved.statement, world_size=self.world.size,
                                                             parallel=self.recipe.training.parallel).lines(),
                             noise=solved.step_metadata,
                             sigma_change=self.sigma_change, resume_changes=self.resume_changes)
        self.observer.on_end(result)
        return result

    def _loop(self) -> str:
        """Steps until done; returns why it stopped ("completed", "budget" or "interrupted")."""
        step_event, cap = self.solved.step_event, self.recipe.privacy.epsilon
        self.model.train()
        with _deferred_interrupt() as interrupt:
            try:
                batches = iter(self.sampler)
                phases = self.continual
                if phases is not None and phases.run_public_phase(interrupt) == "interrupted":
                    return "interrupted"
                while self.step < (self.plan.steps if phases is None else phases.private_steps()):
                    if self.world.any(interrupt.requested):  # between steps only, never inside one; any rank's
                        return "interrupted"
                    # The cap is checked before the batch is touched, with the plan's event, which
                    # is asserted in each step to be the event the engine actually releases.
                    if cap is not None and not self.ledger.allows(step_event, cap):
                        return "budget"
                    self._train_step(next(batches))
            finally:
                self.engine.detach()
        return "completed"

    def _train_step(self, indices: torch.Tensor) -> None:
        """One private step, charged in the ledger on disk before its record is written."""
        recipe, plan, step_event = self.recipe, self.plan, self.solved.step_event
        lr = self.schedule.apply(self.step)
        step_fn = self.private_step if self.continual is None else self.continual.step_fn
        outcome = step_fn(indices, before_update=lambda report: _check_same_release(report.dp_event, step_event))
        outcome = global_outcome(self.world, outcome)  # loss and batch size of all ranks' parts
        self.ledger.record(step_event, metadata=self.solved.step_metadata)
        self.step += 1
        self.step_seconds += outcome.seconds
        # Charged before anything of this step leaves the process (a crash between
        # the two leaves the ledger ahead, never behind).
        self._write_ledger(every_step=True)
        epsilon_every = max(1, plan.steps // 50)  # ε with the ledger's accountant costs ~0.1 s: not every step
        live = self.world.main and (self.step == plan.steps or self.step % epsilon_every == 0)
        record = step_record(self.step, outcome.report, self.ledger.epsilon() if live else None, outcome.loss_sum,
                             outcome.batch_size, recipe.training.batch_size, lr, outcome.seconds, recipe.clipping.fn,
                             recipe.privacy.exact_diagnostics)
        self._emit(record if self.continual is None else {**record, **self.continual.record_fields()}, "step")
        self.diagnostics.maybe_record(self.step, self.run_dir)
        if recipe.eval.every_steps and self.step % recipe.eval.every_steps == 0 and self.step < plan.steps:
            self._run_eval()
        if self._checkpoint_due():
            self._save()

    def _checkpoint_due(self) -> bool:
        """checkpoint.every_steps, or checkpoint.every_minutes since the last checkpoint (a
        step boundary either way; docs/training.md, "Checkpoints and resuming")."""
        every_steps, every_minutes = self.recipe.checkpoint.every_steps, self.recipe.checkpoint.every_minutes
        due = bool(every_steps and self.step % every_steps == 0) or (
            every_minutes is not None and time.monotonic() - self._last_save >= 60.0 * every_minutes)
        return self.world.any(due)  # every rank saves together (any rank's clock)
