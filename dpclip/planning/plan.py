"""From a recipe (or command-line sizes) to the privacy plan the ledger will follow.

This is the one place that turns training settings into accounting inputs, used by
`dpclip account RECIPE` and by the training loop alike, so the two cannot disagree.

Length: a little over 400 lines, because the statement's "not covered by ε" lines are written
here, beside the plan whose run releases them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from dpclip.accounting import AuxSpec, PrivacyPlan, solve, steps_for_epochs
from dpclip.accounting.blt import blt_groups
from dpclip.data import load_data
from dpclip.data.size import public_summary, training_set_size
from dpclip.engine import build_groups, trainable_params
from dpclip.engine.blt import blt_strategy, participation_sensitivities
from dpclip.engine.spec import ClippingSpec
from dpclip.engine.workload import SGD, Workload
from dpclip.errors import AccountingError, DpclipError
from dpclip.models import build_model
from dpclip.recipe.schema import Recipe
from dpclip.recipe.tuning import cuts_held_out


def sampling_schedule(dataset_size: int, batch_size: int, epochs: float | None = None,
                      steps: int | None = None) -> tuple[float, int]:
    """(q, steps) for Poisson sampling with expected batch `batch_size` out of `dataset_size`."""
    if dataset_size < 1:
        raise AccountingError(f"dataset size must be a positive whole number, got {dataset_size}",
                              "pass the number of private training examples")
    if batch_size < 1:
        raise AccountingError(f"batch size must be a positive whole number, got {batch_size}",
                              "pass the expected logical batch size")
    if batch_size > dataset_size:
        raise AccountingError(f"batch size {batch_size} exceeds the dataset size {dataset_size}",
                              "the Poisson rate q = batch_size / N must be at most 1")
    sample_rate = batch_size / dataset_size
    return sample_rate, count_steps(sample_rate, epochs, steps)


def count_steps(sample_rate: float, epochs: float | None, steps: int | None) -> int:
    """Steps from exactly one of epochs (ceil(epochs / q)) or steps."""
    if (epochs is None) == (steps is None):
        raise AccountingError("give exactly one of epochs or steps", "e.g. --epochs 10 or --steps 2000")
    if steps is None:
        if not epochs > 0:
            raise AccountingError(f"epochs must be positive, got {epochs:g}", "e.g. --epochs 10")
        return steps_for_epochs(epochs, sample_rate)
    if steps < 1:
        raise AccountingError(f"steps must be a positive whole number, got {steps}", "e.g. --steps 2000")
    return steps


def check_delta(delta: float, dataset_size: int) -> None:
    """δ ≥ 1/N permits releasing one whole example outright; refuse it."""
    if delta >= 1.0 / dataset_size:
        raise AccountingError(
            f"delta {delta:g} is not below 1/N = 1/{dataset_size} = {1.0 / dataset_size:.3g}",
            f"a δ of 1/N or more allows leaking a whole example; choose δ ≤ 1/N^1.1 ≈ {dataset_size ** -1.1:.1g}")


def count_fixed_groups(grouping) -> int | None:
    """Groups known from the recipe alone (None when they depend on the model's layers)."""
    if grouping == "all-layer":
        return 1
    if isinstance(grouping, dict):
        (key, arg), = grouping.items()
        return arg if key == "uniform" else len(arg)
    return None


def count_groups(recipe: Recipe, model: Any = None) -> int:
    """The number K of clipping groups of a recipe's run: the one place that counts them.

    Known from ``clipping.grouping`` alone when it fixes K; else counted on ``model``; else
    on the model built from the recipe (which loads its data, as training does).
    """
    known = count_fixed_groups(recipe.clipping.grouping)
    if known is not None:
        return known
    if model is None:
        data = load_data(recipe.data, seed=recipe.seed)
        model, _ = build_model(recipe.model, data, seed=recipe.seed)
    return len(build_groups(model, recipe.clipping.grouping, trainable_params(model)).names)


def statistic_groups(recipe: Recipe, model: Any = None) -> int | None:
    """K when the recipe's threshold policy releases a statistic (its sensitivity depends on K), else None."""
    return count_groups(recipe, model) if recipe.clipping.threshold.releases_statistic() else None


def aux_spec(recipe: Recipe, groups: int | None = None) -> AuxSpec | None:
    """What the planner charges for the threshold policy's statistic, if it releases one."""
    threshold = recipe.clipping.threshold
    if not threshold.releases_statistic():
        return None
    return threshold.statistic(count_groups(recipe) if groups is None else groups)


def engine_clipping(recipe: Recipe, sigma_aux: float | None) -> ClippingSpec:
    """The clipping spec for DPEngine, with the statistic's noise std ``sigma_aux`` (from the
    budget split) filled in by the policy's spec."""
    return recipe.clipping.engine_spec(sigma_aux)


def timing_clipping(recipe: Recipe, stand_in_sigma: float) -> ClippingSpec:
    """The clipping spec for timing a step: a statistic's noise std is the recipe's, else
    ``stand_in_sigma`` (its value does not change the cost of a step)."""
    return engine_clipping(recipe, recipe.clipping.threshold.aux_sigma or stand_in_sigma)


#: What a run shows and writes outside ε when ``privacy.exact_diagnostics`` is on.
EXACT_DIAGNOSTICS = (
    "training loss, clip fraction, median norm and realised batch size of every step (progress bar, "
    "metrics.jsonl 'diagnostics'), computed without noise from the private batch",
    "wall time of every step (metrics.jsonl 'seconds', TensorBoard, the progress bar's time remaining), which "
    "follows the realised batch size",
    "held-out metrics (progress bar, metrics.jsonl 'eval', summary.json 'final_eval'), computed without "
    "noise on the held-out split of the private data",
)


#: The steps checkpoint.every_minutes saves at, named by the released checkpoint folders: the clock
#: sums the steps' wall times, which follow the realised batch sizes (listed with or without exact diagnostics).
CLOCK_CHECKPOINTS = (
    "the steps at which checkpoint.every_minutes made a checkpoint (the checkpoints/step_* folder names, LATEST, "
    "an export's checkpoint_step): the clock adds up the steps' wall time, which follows the realised batch sizes")


#: A run a step's error stopped (plan.json ``stopped_on_private_batch``): the model's error or a refusal
#: on a private batch, so the step the run stopped at follows that batch (docs/accounting.md).
PRIVATE_STOP = ("the step at which an error raised on a private batch stopped the run (where its ledger, metrics and "
                "checkpoints ended then): whether the model, its loss or the certificate fails on a batch follows the "
                "batch")


#: A user-level run's count of records (plan.json ``num_train``): N counts people there, and adding or
#: removing a person moves the records by theirs.
USER_RECORD_COUNT = ("the number of records (plan.json num_train): at the user level a person added or removed moves it "
                     "by their own records' count (the number of people is treated as public)")


#: What a run writes outside ε when its Hessian diagnostics are measured on private data.
PRIVATE_HESSIAN_DIAGNOSTICS = (
    "Hessian diagnostics (diagnostics.jsonl, hessian_over_training.png: tr(H), GᵀHG, tr(HΣ), gradient norms, "
    "decelerator, B*_DP), computed without noise on batches of the private training data "
    "(diagnostics.data: private)")



#: A held-out split cut from the private data (test_fraction): the guarantee is for the training split, the cut
#: (a fixed-size draw) taken as given; one example added to the data can move another across it (a swap).
HELD_OUT_CUT = ("the cut of the private data into training and held-out rows (data.test_fraction, a secret draw of "
                "fixed size): ε is for one example of the training split (one person at the user level) added or "
                "removed with the cut given; one added to the data can also move another across the cut (give a "
                "separate test file or split to have no cut)")

LABEL_SET = ("the label set, read from the private data's labels: the task, the number of classes (the largest whole-number "
             "label + 1) or the class names, so the model's output size (a rare label shows; data.labels declares it)")


#: A tokenizer the recipe gives (data.tokenizer: a directory), as the weights depend on it and an
#: export ships it (docs/export.md); dpclip's builtin byte tokenizer is fixed and needs no line.
TOKENIZER = ("the tokenizer data.tokenizer names: released with the model as given (its vocabulary), taken as "
             "public (built from public text)")


def reads_text(data) -> bool:
    """Whether a recipe's ``data`` section is text, which its tokenizer encodes."""
    if data.source == "builtin":
        return data.name != "digits"
    return getattr(data, "format", None) == "text" or data.text_field is not None


def forward_state_line(names) -> tuple[str, ...]:
    """The statement's line for the persistent buffers the model's training forward was seen
    writing (:attr:`dpclip.engine.DPEngine.forward_written_state`), none without any: they pass
    the certificate (written alike whatever the batch) and are saved with the weights, but they
    advance once per forward, and the number of forwards depends on the realised batch sizes
    (micro-batches per step, an empty draw's skipped forward), which ε does not cover."""
    if not names:
        return ()
    return (f"model state written by each training forward (buffers {', '.join(sorted(names))}): saved with the "
            "weights, it advances once per forward, and the number of forwards depends on the realised batch "
            "sizes; that a write does not depend on the batch is checked on the certificate's checked forwards "
            "only (privacy.verify_every), not between them",)


def not_covered(recipe: Recipe) -> tuple[str, ...]:
    """What a run of ``recipe`` releases outside ε (the statement lists it), and the public
    data it trains on, which ε does not cover (docs/continual.md)."""
    out = EXACT_DIAGNOSTICS if recipe.privacy.exact_diagnostics else ()
    if recipe.checkpoint.every_minutes is not None:
        out += (CLOCK_CHECKPOINTS,)
    if recipe.privacy.unit == "user":
        out += (USER_RECORD_COUNT,)
    # a builtin data set's classes are public, data.labels declares them; a causal LM has no label set
    if recipe.data.source != "builtin" and getattr(recipe.model, "task", None) != "causal-lm" and not recipe.data.labels:
        out += (LABEL_SET,)
    if cuts_held_out(recipe.data):
        out += (HELD_OUT_CUT,)
    if recipe.data.tokenizer != "byte" and reads_text(recipe.data):
        out += (TOKENIZER,)
    if recipe.diagnostics.every_steps and recipe.diagnostics.data == "private":
        out += (PRIVATE_HESSIAN_DIAGNOSTICS,)
    if uses_public_data(recipe):
        out += (f"public data: {public_summary(recipe.data, recipe.public)}, declared public by you "
                "(the guarantee assumes it is public)",)
    return out


def not_covered_of_run(recipe: Recipe, plan: dict | None = None) -> tuple[str, ...]:
    """:func:`not_covered` of ``recipe``, the lines of each recipe a resume replaced (the run's
    plan.json ``earlier_not_covered``: a clock checkpoint's folder stays when a resume turns the
    clock off) and :data:`PRIVATE_STOP` where a step's error stopped the run (plan.json
    ``stopped_on_private_batch``)."""
    plan = plan or {}
    earlier = plan.get("earlier_not_covered", [])
    if not isinstance(earlier, list) or not all(isinstance(line, str) for line in earlier):
        raise DpclipError(f"plan.json records earlier_not_covered {earlier!r}, which is not a list of lines",
                          "the run directory was modified: restore plan.json")
    lines = list(not_covered(recipe))
    lines += [line for line in earlier if line not in lines]
    return tuple(lines) + ((PRIVATE_STOP,) if plan.get("stopped_on_private_batch") is True else ())


def uses_public_data(recipe: Recipe) -> bool:
    """Whether what a run of ``recipe`` releases depends on its public data: not under
    ``continual.schedule: only-private`` (loaded and checked, never trained on), unless the
    recorded Hessian diagnostics measure it."""
    if recipe.public is None:
        return False
    only_private = recipe.continual is not None and recipe.continual.schedule == "only-private"
    return not only_private or bool(recipe.diagnostics.every_steps and recipe.diagnostics.data == "public")


def only_public(recipe: Recipe) -> bool:
    """Whether a run of ``recipe`` never leaves its public phase (``continual.schedule:
    only-public``): it takes no private step, and spends ε = 0."""
    return recipe.continual is not None and recipe.continual.schedule == "only-public"


def planned_private_steps(recipe: Recipe, steps: int) -> int:
    """The private steps a run of ``recipe`` plans, as the run states them (summary, report,
    card): ``steps``, its privacy plan's, or none under :func:`only_public`. Its privacy plan
    keeps its steps (a plan has at least one): σ is calibrated for a private phase that never runs."""
    return 0 if only_public(recipe) else steps


def probe_steps(recipe: Recipe, sample_rate: float) -> int:
    """Private steps of DP linear probing at the switch (continual.at_switch.linear_probe_epochs):
    ceil(epochs / q), charged like every private step, so σ is calibrated for them too."""
    continual = recipe.continual
    if continual is None or continual.schedule != "switch" or not continual.at_switch.linear_probe_epochs:
        return 0
    return steps_for_epochs(continual.at_switch.linear_probe_epochs, sample_rate)


def private_seed(recipe: Recipe) -> int | None:
    """The seed of the private randomness (noise, batches): None (OS entropy) unless the
    recipe opts in to ``privacy.unsafe_seeded_randomness``."""
    return recipe.seed if recipe.privacy.unsafe_seeded_randomness else None


def privacy_plan(recipe: Recipe, dataset_size: int, groups: int | None = None) -> PrivacyPlan:
    """The accounting plan of a recipe trained on `dataset_size` private examples.

    ``groups`` (K) matters only when the threshold policy releases a statistic; without it,
    :func:`count_groups` counts them (building the model if K depends on its layers).
    """
    training, privacy = recipe.training, recipe.privacy
    sample_rate, steps = sampling_schedule(dataset_size, training.batch_size, training.epochs, training.steps)
    steps += probe_steps(recipe, sample_rate)
    check_delta(privacy.delta, dataset_size)
    if privacy.noise_multiplier is not None and privacy.noise_multiplier > SIGMA_ACCOUNTED:  # as account --sigma
        raise AccountingError(f"privacy.noise_multiplier {privacy.noise_multiplier:g} is beyond what the accountants "
                              "compute (σ² overflows)",
                              f"ε is already about 0 far below it: use a σ up to {SIGMA_ACCOUNTED:g}")
    return PrivacyPlan(
        sample_rate=sample_rate,
        steps=steps,
        delta=privacy.delta,
        accountant=privacy.accountant,
        sampling=training.sampling,
        target_epsilon=None if privacy.noise_multiplier is not None else privacy.epsilon,
        noise_multiplier=privacy.noise_multiplier,
        aux=aux_spec(recipe, groups),
        seeded_randomness=recipe.privacy.unsafe_seeded_randomness,
        not_covered=not_covered(recipe),
        bands=privacy.mechanism.bands,
        **blt_fields(privacy.mechanism.buffers, sample_rate, steps, strategy_workload(recipe)),
        unit=privacy.unit,
        users=dataset_size if privacy.unit == "user" else None,
        max_examples_per_user=recipe.data.max_examples_per_user,
    )


def privacy_units(recipe: Recipe, data) -> int:
    """What q = batch_size / N counts: the training records, or with ``privacy.unit: user``
    the people (docs/users.md)."""
    if recipe.privacy.unit != "user":
        return data.num_train
    if data.num_users is None:
        raise DpclipError("privacy.unit 'user' but the data carry no users",
                          "name the person's column in data.user_field (or use builtin synthetic-users)")
    return data.num_users


def blt_fields(buffers: int, sample_rate: float, steps: int, workload: Workload = SGD) -> dict:
    """The PrivacyPlan fields of a BLT run (none otherwise): its buffers and the squared
    sensitivities of its strategy, one per participation (docs/formulas.md, "BLT")."""
    if not buffers:
        return {}
    groups = blt_groups(sample_rate)
    strategy = blt_strategy(buffers, steps, groups, workload)
    return {"buffers": buffers, "sensitivities": participation_sensitivities(strategy, steps, groups)}


def strategy_workload(recipe: Recipe) -> Workload:
    """What the correlated noise's strategy is optimised for: SGD's momentum (heavy ball or
    Nesterov) at a constant learning rate; plain prefix sums for any other optimizer."""
    optimizer = recipe.training.optimizer
    if optimizer.kind == "sgd":
        return Workload(float(optimizer.momentum), bool(optimizer.nesterov and optimizer.momentum))
    return SGD


def correlated_noise_note(recipe: Recipe) -> str | None:
    """A warning when the recipe's optimizer does something the strategy does not model."""
    kind = recipe.privacy.mechanism.kind
    if kind == "dp-sgd":
        return None
    unmodelled = []
    if recipe.training.optimizer.kind != "sgd":
        unmodelled.append(f"{recipe.training.optimizer.kind} (its steps are not a running sum of the gradients; on "
                          "the digits CNN banded MF lost to DP-SGD with Adam, docs/methods.md)")
    if recipe.training.schedule.kind != "constant" or recipe.training.schedule.warmup_steps:
        unmodelled.append(f"the {recipe.training.schedule.kind} learning-rate schedule")
    if not unmodelled:
        return None
    return (f"privacy.mechanism {kind}: the noise's strategy is optimised for SGD at a constant learning rate "
            f"(with its momentum), not for " + " nor for ".join(unmodelled) + "; ε is unaffected, the utility may be")


def check_against_data(recipe: Recipe) -> int | None:
    """The rules that need N (batch ≤ N, δ < 1/N), where N is known without loading tensors.

    Returns N, or None for sources whose size is only known after loading (Hugging Face, and
    the people of a user-level recipe). Also refuses a logging.tensorboard the environment
    cannot serve.
    """
    check_logging(recipe)
    if recipe.data.source == "hf" or recipe.privacy.unit == "user":
        return None
    dataset_size = training_set_size(recipe.data)
    sampling_schedule(dataset_size, recipe.training.batch_size, recipe.training.epochs, recipe.training.steps)
    check_delta(recipe.privacy.delta, dataset_size)
    return dataset_size


#: the largest σ `dpclip account --sigma` takes: above about 1e154, σ² overflows the RDP arithmetic
SIGMA_ACCOUNTED = 1e100


def plan_from_flags(*, delta: float | None, epsilon: float | None = None, noise_multiplier: float | None = None,
                    sample_rate: float | None = None, steps: int | None = None, dataset_size: int | None = None,
                    batch_size: int | None = None, epochs: float | None = None, accountant: str = "pld",
                    sampling: str = "poisson", aux: AuxSpec | None = None, bands: int = 1,
                    buffers: int = 0, unit: str = "example", max_examples_per_user: int | None = None) -> PrivacyPlan:
    """A plan from `dpclip account` flags: (q, steps) or (N, B, epochs|steps), and ε or σ."""
    if delta is None:
        raise AccountingError("--delta is required", "e.g. --delta 1e-5 (below 1/N)")
    if not 0 < delta < 1:
        raise AccountingError(f"delta must lie in (0, 1), got {delta:g}", "e.g. --delta 1e-5 (below 1/N)")
    if (epsilon is None) == (noise_multiplier is None):
        raise AccountingError("give exactly one of --eps (calibrate σ) or --sigma (compute ε)",
                              "e.g. --eps 8 --delta 1e-5 ...")
    if epsilon is not None and not epsilon > 0:
        raise AccountingError(f"epsilon must be positive, got {epsilon:g}", "e.g. --eps 8")
    if noise_multiplier is not None and not noise_multiplier > 0:
        raise AccountingError(f"sigma must be positive, got {noise_multiplier:g}", "e.g. --sigma 1.1")
    if noise_multiplier is not None and noise_multiplier > SIGMA_ACCOUNTED:   # σ² overflows the accountants
        raise AccountingError(f"sigma {noise_multiplier:g} is beyond what the accountants compute (σ² overflows)",
                              f"ε is already about 0 far below it: use a σ up to {SIGMA_ACCOUNTED:g}")
    if sample_rate is not None:
        if dataset_size is not None or batch_size is not None:
            raise AccountingError("give either --sample-rate or --dataset-size with --batch-size, not both",
                                  "q = batch_size / dataset_size")
        if not 0 < sample_rate <= 1:
            raise AccountingError(f"sample rate must lie in (0, 1], got {sample_rate:g}", "e.g. --sample-rate 0.004")
        steps = count_steps(sample_rate, epochs, steps)
    elif dataset_size is not None and batch_size is not None:
        sample_rate, steps = sampling_schedule(dataset_size, batch_size, epochs, steps)
        check_delta(delta, dataset_size)
    else:
        raise AccountingError("the sampling is not specified",
                              "give --sample-rate Q with --steps T (or --epochs E), or "
                              "--dataset-size N --batch-size B with --epochs E (or --steps T)")
    return PrivacyPlan(sample_rate=sample_rate, steps=steps, delta=delta, accountant=accountant,
                       sampling=sampling, target_epsilon=epsilon, noise_multiplier=noise_multiplier, aux=aux,
                       bands=bands, **blt_fields(buffers, sample_rate, steps), unit=unit,
                       users=dataset_size if unit == "user" else None, max_examples_per_user=max_examples_per_user)


def plan_for_recipe(recipe: Recipe, dataset_size: int | None = None, groups: int | None = None) -> PrivacyPlan:
    """The plan of a recipe; N is read from its data section unless given (the people, loaded,
    for a user-level recipe)."""
    if dataset_size is None:
        dataset_size = recipe_units(recipe)
    return privacy_plan(recipe, dataset_size, groups)


def recipe_units(recipe: Recipe) -> int:
    """N of q = B/N for a recipe, read from its data: the records (counted without loading
    where the source allows), or the people of a user-level recipe (loaded)."""
    if recipe.privacy.unit == "user":
        return privacy_units(recipe, load_data(recipe.data, seed=recipe.seed))
    return training_set_size(recipe.data)


def solve_plan(plan: PrivacyPlan, accountant: str = "pld"):
    """Solve a plan with 'pld', 'rdp', or 'both' (σ calibrated so both ε stay within the target)."""
    if accountant != "both":
        return solve(replace(plan, accountant=accountant))
    if plan.target_epsilon is None:
        return solve(replace(plan, accountant="pld"))
    sigma_pld = solve(replace(plan, accountant="pld")).split.noise_multiplier
    sigma_rdp = solve(replace(plan, accountant="rdp")).split.noise_multiplier
    return solve(replace(plan, accountant="pld", target_epsilon=None, noise_multiplier=max(sigma_pld, sigma_rdp)))


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def check_logging(recipe) -> None:
    """Refuse ``logging.tensorboard: true`` when the tensorboard package is missing."""
    if recipe.logging.tensorboard and not tensorboard_installed():
        raise DpclipError("logging.tensorboard is true, but the tensorboard package is not installed",
                          "pip install 'dpclip[tensorboard]' (or pip install tensorboard), "
                          "or set logging.tensorboard: false")
