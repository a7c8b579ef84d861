"""Assembly: a recipe -> the frozen parts of a run (data, model, plan, engine, optimizer,
sampler, step), built by keyword into :class:`~dpclip.train.run_parts.RunParts`, in the one
order that keeps a seeded run reproducible.

Every caller that needs the training step builds it here: ``dpclip train``
(:mod:`dpclip.train.workflow`), ``tune-cost``'s timing (:mod:`dpclip.tuning.timing`),
``dpclip bench`` and ``dpclip diagnose`` (:mod:`dpclip.train.diagnose`). The order matters:
the global RNG is seeded first and drives the model's initial weights and dropout (never
noise or batches: those have their own generators, :mod:`dpclip.rng`).

The parts' types, and why they are frozen: :mod:`dpclip.train.run_parts`.
"""

from __future__ import annotations

import json
import secrets as os_entropy
from pathlib import Path

import torch

from dpclip import layout
from dpclip.accounting import solve
from dpclip.accounting.plan import PlanResult, PrivacyPlan
from dpclip.data import PoissonSampler, ShuffleSampler, load_data, select
from dpclip.data.canaries import canary_seed, make_canaries, with_canaries
from dpclip.data.exposure import draw_exposure, stored_exposure, with_exposure
from dpclip.data.user_sampler import UserPoissonSampler
from dpclip.distributed import ShardedPoissonSampler, ShardedShuffleSampler, World
from dpclip.distributed.pipeline import PipelineStep, pipeline_engine, pipeline_input
from dpclip.distributed.sharded import ShardReducer, Shards, lockstep_micro_batches
from dpclip.engine import DPEngine
from dpclip.engine.blt import blt_strategy
from dpclip.engine.compiled import CompiledMicroBatch
from dpclip.engine.correlated import banded_strategy
from dpclip.engine.spec import ClippingSpec
from dpclip.engine.workload import SGD
from dpclip.errors import DpclipError
from dpclip.models import build_model
from dpclip.planning.plan import (count_groups, engine_clipping, privacy_plan, privacy_units, private_seed,
                                  strategy_workload, timing_clipping)
from dpclip.recipe import Recipe
from dpclip.rundir.privacy_fields import PLAN_FIELDS, recipe_changes
from dpclip.train.device import recorded_device, resolve_device
from dpclip.train.diagnostics import recorder_for
from dpclip.train.optim import LrSchedule, build_optimizer
from dpclip.train.phases import continual_run
from dpclip.train.ranks import check_ranks
from dpclip.train.run_parts import Feed, Learner, RunParts, RunSetting, SigmaChange
from dpclip.train.step import PrivateStep, step_micro_batch_size, step_precision

# Stand-in noise for timing only: the cost of a step does not depend on σ.
#: training rows a sharded or staged model is certified on before it is cut (docs/certificate.md)
CHECK_ROWS = 8
TIMING_SIGMA = 1.0
TIMING_STATISTIC_SIGMA = 5.0


def seeded_data(recipe: Recipe, data=None, split_key: int | None = None):
    """The global RNG seeded with the recipe's seed, then the data (``data`` when given), split
    with ``split_key`` (:func:`split_key`; None: the recipe's seed)."""
    # The global RNG drives only what is not private (dropout); noise and batches have their own
    # generators from OS entropy (dpclip.rng).
    torch.manual_seed(recipe.seed)
    return load_data(recipe.data, seed=recipe.seed, split_key=split_key) if data is None else data


def stored_split_key(run_dir: Path) -> int | None:
    """The key a run's train/test split was drawn with (meta.json, secret); None for a run whose
    split the recipe's seed drew (seeded randomness, or made before runs had a key)."""
    path = Path(run_dir) / layout.META
    if not path.exists():
        raise DpclipError(f"{run_dir} has no meta.json, so its members cannot be rebuilt",
                          "pass the folder that `dpclip train` created under runs/")
    key = json.loads(path.read_text(encoding="utf-8")).get("split_key")
    if key is not None and (isinstance(key, bool) or not isinstance(key, int) or key < 0):
        raise DpclipError(f"{path} records split_key {str(key)[:40]!r}, which is not the key of a split (its members "
                          "cannot be rebuilt)", "the run directory was modified: restore meta.json from a backup")
    return key


def split_key(recipe: Recipe, world: World, run_dir: Path | None) -> int | None:
    """The key of the run's train/test split, i.e. of who is a member (dpclip.data.dataset): the
    run's own, from its meta.json (secret), when resuming; None (the recipe's seed draws the split)
    with privacy.unsafe_seeded_randomness, or for a run made before runs had a key; otherwise fresh
    OS entropy, rank 0's on every rank. The released recipe's seed then says nothing of membership."""
    if run_dir is not None:
        return stored_split_key(run_dir)
    if recipe.privacy.unsafe_seeded_randomness:
        return None
    return world.broadcast(os_entropy.randbits(63))


def load_model(recipe: Recipe, data=None):
    """(data, model, loss_fn): :func:`seeded_data`, then the model at its initial weights."""
    data = seeded_data(recipe, data)
    model, loss_fn = build_model(recipe.model, data, seed=recipe.seed)
    return data, model, loss_fn


def canary_records(recipe: Recipe) -> int:
    """Records per canary: k for a user-level run's canary people, else 1."""
    return recipe.data.max_examples_per_user if recipe.privacy.unit == "user" else 1


def noise_strategy(plan, workload=SGD):
    """The strategy the engine correlates its noise with, optimised for ``workload`` (the
    recipe's: :func:`~dpclip.planning.plan.strategy_workload`): banded MF's coefficients, BLT's
    poles (the ones the plan's sensitivities were computed from), or None for DP-SGD."""
    if plan.buffers:
        return blt_strategy(plan.buffers, plan.steps, plan.groups, workload)
    return banded_strategy(plan.bands, plan.steps, workload) if plan.bands > 1 else None


def build_engine(model: torch.nn.Module, clipping: ClippingSpec, *, gradient_noise_multiplier: float, batch_size: int,
                 seed: int | None = None, sample_rate: float | None = None, world: World | None = None,
                 pipeline: bool = False, shards: Shards | None = None, probe_rows=None, loss_fn=None,
                 noise_correlation=None, records_per_unit: int = 1, verify_every: int = 0):
    """The engine on ``model``: a :class:`~dpclip.engine.DPEngine`, or this rank's pipeline
    stage (docs/distributed.md, "Pipeline stages"). ``shards``: the model is cut over the ranks
    once the engine has probed it (docs/distributed.md, "Sharded training"). A sharded or staged
    model is certified first on ``probe_rows``, a few training rows, whole (docs/certificate.md)."""
    if pipeline:
        return pipeline_engine(model, clipping, world, run_losses=lambda: loss_fn(model, probe_rows),
                               gradient_noise_multiplier=gradient_noise_multiplier, expected_batch_size=batch_size,
                               seed=seed, sample_rate=sample_rate,
                               noise_correlation=noise_correlation)  # each stage correlates its own parameters' noise
    if shards is not None:
        engine = DPEngine(model, clipping, gradient_noise_multiplier=gradient_noise_multiplier,
                          expected_batch_size=batch_size, seed=seed, sample_rate=sample_rate,
                          reducer=ShardReducer(shards.world), noise_correlation=noise_correlation,
                          records_per_unit=records_per_unit, verify_every=verify_every)
        # the whole model is checked before it is cut: a rank of a sharded one cannot replay alone
        shards.world.on_every_rank(lambda: engine.certify(lambda: loss_fn(model, probe_rows), before="sharding"))
        shards.shard(engine)
        return engine
    return DPEngine(model, clipping, gradient_noise_multiplier=gradient_noise_multiplier, expected_batch_size=batch_size,
                    seed=seed, sample_rate=sample_rate, reducer=None if world is None else world.reducer,
                    noise_correlation=noise_correlation, records_per_unit=records_per_unit,
                    verify_every=verify_every)


def build_step(recipe: Recipe, model, loss_fn, engine, train_rows, *, pipeline: bool = False,
               world: World | None = None, users=None):
    """(optimizer, private step): the recipe's optimizer over the trainable parameters this
    process owns (a pipeline stage: its own; a sharded model: its shards), and the one private step."""
    training = recipe.training
    owned = engine.module if pipeline else model
    optimizer = build_optimizer(training.optimizer, [p for p in owned.parameters() if p.requires_grad])
    if pipeline:
        return optimizer, PipelineStep(engine, optimizer, train_rows, loss_fn.criterion, pipeline_input(loss_fn),
                                       training.micro_batch_size or training.batch_size)
    lockstep = None
    if training.parallel == "fsdp" and world is not None and world.size > 1:
        def lockstep(count: int) -> int:
            return lockstep_micro_batches(world, count)
    compiled = CompiledMicroBatch(engine, model, loss_fn) if training.compile else None
    return optimizer, PrivateStep(model, loss_fn, engine, optimizer, train_rows,
                                  micro_batch_size=step_micro_batch_size(recipe),
                                  precision=step_precision(recipe, model), lockstep=lockstep, users=users,
                                  fixed_rows=training.fixed_shapes or training.compile, compiled=compiled)


def build_sampler(recipe: Recipe, plan, num_train: int, world: World, seed: int | None, users=None):
    """The private batches: Poisson or shuffled, one process's or this rank's part; people,
    at most k records each, for a user-level recipe (docs/users.md)."""
    training = recipe.training
    groups, rate = plan.groups, plan.group_rate  # banded MF, BLT: G groups sampled in turn at q·G (1: plain Poisson)
    if recipe.privacy.unit == "user":  # each rank its own people (u mod W), all their records
        return UserPoissonSampler(users, rate, plan.steps, recipe.data.max_examples_per_user, seed=seed,
                                  rank=world.rank, world_size=world.size, groups=groups)
    sharded = world.size > 1 and training.parallel != "pipeline"  # a pipeline's batches are rank 0's draws
    if sharded and training.sampling == "poisson":  # each rank draws its own examples' part
        return ShardedPoissonSampler(num_train, rate, plan.steps, rank=world.rank,
                                     world_size=world.size, seed=seed, groups=groups)
    if sharded:  # rank 0 draws each epoch's permutation; each rank takes its slice
        return ShardedShuffleSampler(num_train, training.batch_size, plan.steps, rank=world.rank,
                                     world_size=world.size, broadcast_=world.broadcast_, seed=seed)
    if training.sampling == "poisson":
        return PoissonSampler(num_train, rate, plan.steps, seed=seed, groups=groups)
    return ShuffleSampler(num_train, training.batch_size, plan.steps, seed=seed)


def assemble(recipe: Recipe, *, data=None, world: World | None = None, file_recipe: Recipe | None = None,
             resuming: bool = False, run_dir: Path | None = None) -> RunParts:
    """The parts of a run of ``recipe``, in this order (the global RNG is seeded first, so the
    order matters): data, the ranks' agreement on it, model, privacy plan (canaries join the
    data after N is counted), engine, optimizer and step, sampler, continual schedule,
    diagnostics. ``file_recipe``: the recipe before key=value overrides (σ is compared with
    its plan; not on a resume). ``run_dir``: the run being resumed, whose planted secrets
    (audit.exposure) are read back instead of drawn."""
    world = world or World()
    pipeline = recipe.training.parallel == "pipeline"
    # Before anything is loaded or written; a resumed run keeps its device (dpclip.train.device).
    trained_on = recorded_device(run_dir) if resuming and run_dir is not None else None
    device = resolve_device(recipe.training.device, world.size, trained_on)
    ordinary = seeded_data(recipe, data, None if data is not None else split_key(recipe, world, run_dir))
    check_ranks(recipe, world, ordinary)  # before the model: a rank with other data stops here
    model, loss_fn = build_model(recipe.model, ordinary, seed=recipe.seed)
    model.to(device)  # built on the CPU from the seeded global RNG: the same initial weights on any device
    shards = None
    if recipe.training.parallel == "fsdp":  # every rank starts from rank 0's weights, then holds its shards
        world.broadcast_(list(model.state_dict().values()))
        shards = Shards(model, world)
    # A statistic's sensitivity grows with the number of groups, which depends on the model.
    num_groups = count_groups(recipe, model)
    # N is the number of ordinary training examples, counted before any canary goes in
    # (see dpclip.data.canaries: q = B/N applies to canaries too, as `dpclip account` says).
    plan = privacy_plan(recipe, privacy_units(recipe, ordinary), groups=num_groups)
    canaries, data = None, ordinary
    if recipe.audit.canaries is not None:
        # The stored seed on a resume, the recipe's if it sets one, else fresh OS entropy (rank 0's).
        seed_of_canaries = canary_seed(recipe.audit.canaries, run_dir)
        if seed_of_canaries is None:
            seed_of_canaries = world.broadcast(os_entropy.randbits(63))
        canaries = make_canaries(ordinary, recipe.audit.canaries, seed_of_canaries, records=canary_records(recipe))
        data = with_canaries(ordinary, canaries)
    exposure = None
    if recipe.audit.exposure is not None:
        # Fresh OS entropy, never the recipe seed (dpclip.data.exposure); rank 0's for every rank.
        exposure = (stored_exposure(run_dir, recipe.audit.exposure) if run_dir is not None
                    else draw_exposure(recipe.audit.exposure, world.broadcast(os_entropy.randbits(128))))
        data = with_exposure(data, exposure)
    solved = solve(plan)
    sigma_change = None if resuming else _sigma_change(file_recipe, recipe, privacy_units(recipe, ordinary), num_groups,
                                                       plan, solved)
    # Private randomness (noise, batches) comes from OS entropy unless the recipe opts in.
    seed = private_seed(recipe)
    engine = build_engine(model, engine_clipping(recipe, solved.split.sigma_aux),
                          gradient_noise_multiplier=solved.split.gradient_noise_multiplier, batch_size=recipe.training.batch_size,
                          seed=seed, sample_rate=plan.group_rate, world=world, pipeline=pipeline, shards=shards,
                          noise_correlation=noise_strategy(plan, strategy_workload(recipe)),
                          # the rows stay in the process: the check's outcome is the run going on, or a
                          # refusal labelled not covered by ε (docs/accounting.md)
                          probe_rows=select(ordinary.train, torch.arange(min(CHECK_ROWS, ordinary.num_train))),
                          loss_fn=loss_fn,
                          records_per_unit=recipe.data.max_examples_per_user if recipe.privacy.unit == "user" else 1,
                          verify_every=recipe.privacy.verify_every)
    optimizer, private_step = build_step(recipe, model, loss_fn, engine, data.train, pipeline=pipeline, world=world,
                                         users=data.train_users if recipe.privacy.unit == "user" else None)
    # Base lrs are read now, before a resumed optimizer state overwrites the scheduled ones.
    schedule = LrSchedule(optimizer, recipe.training.schedule, plan.steps)
    sampler = build_sampler(recipe, plan, data.num_train, world, seed, users=data.train_users)
    # Public data and phases (docs/continual.md), or None.
    continual = continual_run(recipe, model=model, loss_fn=loss_fn, engine=engine, optimizer=optimizer,
                              private_step=private_step, private_data=ordinary, plan=plan,
                              gradient_noise_multiplier=solved.split.gradient_noise_multiplier, seed=seed)
    diagnostics = recorder_for(recipe, model=model, loss_fn=loss_fn, engine=engine, private_data=ordinary,
                               sigma=solved.split.gradient_noise_multiplier,
                               public_rows=None if continual is None or continual.public is None
                               else continual.public.train)
    return RunParts(
        setting=RunSetting(recipe=recipe, world=world, device=device, plan=plan, solved=solved, seed_of_noise=seed,
                           sigma_change=sigma_change),
        learner=Learner(model=model, loss_fn=loss_fn, engine=engine, optimizer=optimizer, private_step=private_step,
                        schedule=schedule, shards=shards),
        feed=Feed(data=data, ordinary=ordinary, sampler=sampler, canaries=canaries, exposure=exposure,
                  continual=continual),
        diagnostics=diagnostics)


def assemble_for_timing(recipe: Recipe, steps: int) -> RunParts:
    """Stand-in parts that time ``steps`` private steps of ``recipe``: the same data, model,
    engine, optimizer and step, with stand-in noise (its value does not change a step's cost)
    and no privacy plan (nothing of these steps is released)."""
    device = resolve_device(recipe.training.device)
    data, model, loss_fn = load_model(recipe)
    model.to(device)
    batch_size = min(recipe.training.batch_size, data.num_train)
    sample_rate = batch_size / data.num_train
    clipping = timing_clipping(recipe, TIMING_STATISTIC_SIGMA)
    engine = build_engine(model, clipping, gradient_noise_multiplier=TIMING_SIGMA, batch_size=batch_size,
                          sample_rate=sample_rate)
    optimizer, private_step = build_step(recipe, model, loss_fn, engine, data.train)
    sampler = PoissonSampler(data.num_train, sample_rate, steps)
    return RunParts(setting=RunSetting(recipe=recipe, world=World(), device=device),
                    learner=Learner(model=model, loss_fn=loss_fn, engine=engine, optimizer=optimizer,
                                    private_step=private_step),
                    feed=Feed(data=data, ordinary=data, sampler=sampler))


#: Privacy fields that do not move σ: named beside a changed plan field, they read as its cause.
NOT_PLAN_PRIVACY_FIELDS = frozenset({"privacy.exact_diagnostics", "privacy.verify_every",
                                     "privacy.unsafe_seeded_randomness"})


def _sigma_change(reference: Recipe | None, recipe: Recipe, num_train: int, num_groups: int, plan: PrivacyPlan,
                  solved: PlanResult) -> SigmaChange | None:
    """σ (or ε, at a given σ) of the recipe file's own plan beside this run's, when the
    overrides changed what the plan depends on (steps, batch size, sampling): ε is what
    the recipe fixes, so fewer steps mean less noise per step (docs/training.md)."""
    if reference is None or reference.data != recipe.data:
        return None
    changed = {key: value for key, value in recipe_changes(reference, recipe).items()
               if key in PLAN_FIELDS or key.startswith("privacy.") and key not in NOT_PLAN_PRIVACY_FIELDS}
    if not any(key in PLAN_FIELDS for key in changed):
        return None
    try:
        before = solve(privacy_plan(reference, num_train, groups=num_groups))
    except DpclipError:
        return None  # the file's own plan is not feasible on this data; the run's is
    return {"changed": changed, "sigma_file": before.split.noise_multiplier, "sigma": solved.split.noise_multiplier,
            "epsilon_file": before.epsilon, "epsilon": solved.epsilon,
            "calibrated": plan.target_epsilon is not None, "target_epsilon": plan.target_epsilon}
