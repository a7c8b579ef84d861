"""The parts of a run, typed: what the run is (:class:`RunSetting`), what trains
(:class:`Learner`), what feeds it (:class:`Feed`), bundled in :class:`RunParts`, which
:func:`dpclip.train.parts.assemble` builds once, by keyword, in the one order that keeps a
seeded run reproducible. The engine and the sampler appear as the loop sees them
(:class:`PrivateEngine`, :class:`BatchSampler`).

The parts are frozen: the loop (:mod:`dpclip.train.trainer`) steps a
:class:`~dpclip.train.state.RunState` with them and never replaces one. The objects inside
(model, optimizer, sampler, engine) do change as they train; their states are what a
checkpoint holds (:mod:`dpclip.train.state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, TypedDict

import torch

from dpclip.accounting.plan import PlanResult, PrivacyPlan
from dpclip.accounting.split import NoiseSplit
from dpclip.data.canaries import CanarySet
from dpclip.data.dataset import PrivateData
from dpclip.data.exposure import ExposureSet
from dpclip.distributed import World
from dpclip.distributed.pipeline import PipelineStep
from dpclip.distributed.sharded import Shards
from dpclip.engine.noise import NoiseSource
from dpclip.models.losses import PerSampleLoss
from dpclip.planning.plan import correlated_noise_note
from dpclip.recipe import Recipe
from dpclip.train.diagnostics import DiagnosticsRecorder, Off
from dpclip.train.optim import LrSchedule
from dpclip.train.phases import Continual
from dpclip.train.step import PrivateStep


class PrivateEngine(Protocol):
    """The engine as the loop and the checkpointer see it: a :class:`~dpclip.engine.DPEngine`,
    or a pipeline stage's :class:`~dpclip.distributed.pipeline.PipelineEngine`."""

    group_names: list[str]
    noise: NoiseSource                 # a fork renews it (dpclip.rng)
    forward_written_state: set[str]    # saved buffers its training forwards wrote (the statement names them)

    def detach(self) -> None: ...
    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state: dict[str, object]) -> None: ...


class BatchSampler(Protocol):
    """The private batches as the loop sees them: an iterator of index tensors, one a step,
    whose position a checkpoint holds (:mod:`dpclip.data.sampler`, :mod:`dpclip.distributed.sampler`)."""

    def __iter__(self) -> Iterator[torch.Tensor]: ...
    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state: dict[str, object]) -> None: ...


class SigmaChange(TypedDict):
    """σ (or ε, at a given σ) of the recipe file's own plan beside this run's, when key=value
    overrides changed what the plan depends on (meta.json's ``sigma_change``; docs/training.md)."""

    changed: dict[str, list[object]]
    sigma_file: float
    sigma: float
    epsilon_file: float
    epsilon: float
    calibrated: bool
    target_epsilon: float | None


@dataclass(frozen=True, kw_only=True)
class RunSetting:
    """What the run is: the recipe on this world and device, its privacy plan and solution, and
    the seed of its private randomness (None: OS entropy). ``plan`` and ``solved`` are None
    only for :func:`assemble_for_timing`'s stand-in parts. ``sigma_change``: σ of the recipe
    file's own plan beside this run's, when overrides moved it (:func:`_sigma_change`)."""

    recipe: Recipe
    world: World
    device: torch.device
    plan: PrivacyPlan | None = None
    solved: PlanResult | None = None
    seed_of_noise: int | None = None
    sigma_change: SigmaChange | None = None


@dataclass(frozen=True, kw_only=True)
class Learner:
    """What trains: the model and its per-sample loss, the engine, the optimizer and its
    schedule, the one private step, and a sharded model's shards (training.parallel: fsdp)."""

    model: torch.nn.Module
    loss_fn: PerSampleLoss
    engine: PrivateEngine
    optimizer: torch.optim.Optimizer
    private_step: PrivateStep | PipelineStep
    schedule: LrSchedule | None = None
    shards: Shards | None = None


@dataclass(frozen=True, kw_only=True)
class Feed:
    """What feeds the steps. ``data`` is what they sample from (canaries and planted secrets
    included); ``ordinary`` the training data before the canaries went in (N, the sampling
    rate's denominator, counts these). ``continual``: the public data and phases, or None."""

    data: PrivateData
    ordinary: PrivateData
    sampler: BatchSampler
    canaries: CanarySet | None = None
    exposure: ExposureSet | None = None
    continual: Continual | None = None


@dataclass(frozen=True, kw_only=True)
class RunParts:
    """What a run is made of, built once by :func:`assemble` (module doc): what the run is
    (``setting``), what trains (``learner``), what feeds it (``feed``), and what it records
    beside the loop's own files (``diagnostics``, the Hessian diagnostics' recorder)."""

    setting: RunSetting
    learner: Learner
    feed: Feed
    diagnostics: DiagnosticsRecorder | Off = Off()

    @property
    def split(self) -> NoiseSplit:
        return self.setting.solved.split

    @property
    def pipeline(self) -> bool:
        return self.setting.recipe.training.parallel == "pipeline"

    def info(self, resume_changes: dict[str, list[object]]) -> dict[str, object]:
        """What the run is about to do (the observer's start, and meta.json's plan)."""
        setting, feed = self.setting, self.feed
        recipe, plan, split = setting.recipe, setting.plan, self.split
        return {
            "name": recipe.name, "steps": plan.steps, "sample_rate": plan.sample_rate, "sampling": plan.sampling,
            "cyclic_groups": plan.groups,
            "num_train": feed.ordinary.num_train, "num_test": feed.data.num_test,
            "num_users": plan.users,
            "canaries_included": None if feed.canaries is None else int(feed.canaries.included.sum()),
            "groups": self.learner.engine.group_names, "noise_multiplier": split.noise_multiplier,
            "gradient_noise_multiplier": split.gradient_noise_multiplier, "sigma_aux": split.sigma_aux,
            "planned_epsilon": setting.solved.epsilon, "delta": plan.delta, "accountant": plan.accountant,
            "epsilon_cap": recipe.privacy.epsilon,
            "parameters": sum(p.numel() for p in self.learner.model.parameters() if p.requires_grad),
            "seeded_randomness": recipe.privacy.unsafe_seeded_randomness,
            "exact_diagnostics": recipe.privacy.exact_diagnostics,
            "sigma_change": setting.sigma_change, "resume_changes": resume_changes,
            "threads": torch.get_num_threads(),  # a resume replays steps: same count (dpclip.threads)
            "device": str(setting.device),  # and on the same kind of device (dpclip.train.device)
            "world_size": setting.world.size,
            "continual": None if feed.continual is None else feed.continual.info(),
            "correlated_noise_note": correlated_noise_note(recipe),
        }
