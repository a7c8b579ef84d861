"""From a recipe (or command-line sizes) to the privacy plan the ledger will follow.

This is the one place that turns training settings into accounting inputs, used by
`dpclip account RECIPE` and by the training loop alike, so the two cannot disagree.
"""

from __future__ import annotations

from dpclip.accounting import AuxSpec, PrivacyPlan, steps_for_epochs
from dpclip.errors import AccountingError, RecipeError
from dpclip.recipe.schema import (
    DCSGDError,
    DCSGDPercentile,
    QuantileThreshold,
    Recipe,
)


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


def aux_spec(recipe: Recipe, groups: int | None = None) -> AuxSpec | None:
    """The threshold statistic released with each gradient, if the policy releases one."""
    threshold = recipe.clipping.threshold
    if isinstance(threshold, QuantileThreshold):
        kind, sigma = "quantile", threshold.sigma
    elif isinstance(threshold, (DCSGDPercentile, DCSGDError)):
        kind, sigma = "histogram", threshold.sigma_hist
    else:
        return None
    if groups is None:
        groups = count_fixed_groups(recipe.clipping.grouping)
    if groups is None:
        raise RecipeError(
            f"clipping.grouping {recipe.clipping.grouping!r} has a model-dependent number of groups, "
            f"and the {threshold.kind} statistic's sensitivity depends on it",
            "pass --groups K (the number of clipping groups of your model)")
    return AuxSpec(kind=kind, groups=groups, sigma=sigma, fraction=threshold.budget_fraction)


#: What a run shows and writes outside ε when ``privacy.exact_diagnostics`` is on.
EXACT_DIAGNOSTICS = (
    "training loss, clip fraction, median norm and realised batch size of every step (progress bar, "
    "metrics.jsonl 'diagnostics'), computed without noise from the private batch",
    "held-out metrics (progress bar, metrics.jsonl 'eval', summary.json 'final_eval'), computed without "
    "noise on the held-out split of the private data",
)


def not_covered(recipe: Recipe) -> tuple[str, ...]:
    """What a run of ``recipe`` releases outside ε (the statement lists it)."""
    return EXACT_DIAGNOSTICS if recipe.privacy.exact_diagnostics else ()


def private_seed(recipe: Recipe) -> int | None:
    """The seed of the private randomness (noise, batches): None (OS entropy) unless the
    recipe opts in to ``privacy.unsafe_seeded_randomness``."""
    return recipe.seed if recipe.privacy.unsafe_seeded_randomness else None


def privacy_plan(recipe: Recipe, dataset_size: int, groups: int | None = None) -> PrivacyPlan:
    """The accounting plan of a recipe trained on `dataset_size` private examples."""
    training, privacy = recipe.training, recipe.privacy
    sample_rate, steps = sampling_schedule(dataset_size, training.batch_size, training.epochs, training.steps)
    check_delta(privacy.delta, dataset_size)
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
    )


def check_against_data(recipe: Recipe) -> int | None:
    """The rules that need N (batch ≤ N, δ < 1/N), where N is known without loading tensors.

    Returns N, or None for sources whose size is only known after loading (Hugging Face).
    """
    from dpclip.data.size import training_set_size

    if recipe.data.source == "hf":
        return None
    dataset_size = training_set_size(recipe.data)
    sampling_schedule(dataset_size, recipe.training.batch_size, recipe.training.epochs, recipe.training.steps)
    check_delta(recipe.privacy.delta, dataset_size)
    return dataset_size


def plan_from_flags(*, delta: float | None, epsilon: float | None = None, noise_multiplier: float | None = None,
                    sample_rate: float | None = None, steps: int | None = None, dataset_size: int | None = None,
                    batch_size: int | None = None, epochs: float | None = None, accountant: str = "pld",
                    sampling: str = "poisson", aux: AuxSpec | None = None) -> PrivacyPlan:
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
                       sampling=sampling, target_epsilon=epsilon, noise_multiplier=noise_multiplier, aux=aux)


def plan_for_recipe(recipe: Recipe, dataset_size: int | None = None, groups: int | None = None) -> PrivacyPlan:
    """The plan of a recipe; N is read from its data section unless given."""
    if dataset_size is None:
        from dpclip.data.size import training_set_size

        dataset_size = training_set_size(recipe.data)
    return privacy_plan(recipe, dataset_size, groups)


def solve_plan(plan: PrivacyPlan, accountant: str = "pld"):
    """Solve a plan with 'pld', 'rdp', or 'both' (σ calibrated so both ε stay within the target)."""
    from dataclasses import replace

    from dpclip.accounting import solve

    if accountant != "both":
        return solve(replace(plan, accountant=accountant))
    if plan.target_epsilon is None:
        return solve(replace(plan, accountant="pld"))
    sigma_pld = solve(replace(plan, accountant="pld")).split.sigma_total
    sigma_rdp = solve(replace(plan, accountant="rdp")).split.sigma_total
    return solve(replace(plan, accountant="pld", target_epsilon=None, noise_multiplier=max(sigma_pld, sigma_rdp)))
