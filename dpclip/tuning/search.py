"""``tune-cost --run``: perform the search with Papernot–Steinke repeat-and-select.

The mechanism (Papernot & Steinke 2022, Algorithm 1 with a random number of trials):

1. draw K from the recipe's distribution (Poisson, or truncated negative binomial) with
   mean E[K] (default: the number of configurations);
2. K times: pick a configuration uniformly at random, train it through the training
   workflow at the per-run σ that ``tune-cost`` calibrated, with noise and batches of its
   own, and score it on the held-out split — with a private score, the score is the count
   of correct predictions plus Gaussian noise of std ``tuning.score_noise`` (sensitivity 1);
3. release the best-scoring run and its score (nothing when K = 0).

Its privacy is ``RepeatAndSelectDpEvent(run event, E[K], shape)`` under the RDP
accountant, and that bound covers step 3's output only. So K, the configurations picked
and the score noise are the mechanism's secret randomness (OS entropy, unless the recipe
opts in to ``privacy.unsafe_seeded_randomness``), and nothing else is kept: a trial that
is beaten is deleted at once (model, checkpoints, metrics), the summary names neither K
nor the other trials, and with a private score no trial writes an exact held-out metric.

The search directory's ``ledger.json`` holds exactly the repeat-and-select event, so its
ε is the one ``tune-cost`` promised; the selected run carries ``search.json`` pointing to
it, and ``dpclip account`` reports the search's ε for both (:func:`read_search`); every headline
ε of the selected run comes from :func:`dpclip.rundir.searchdir.headline`. Reading a search
directory back lives in :mod:`dpclip.rundir.searchdir` (re-exported here).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Modules, not names: looked up at call time so that tests can stand in for
# ``workflow.train`` and ``tuning_math.draw_trial_count``.
import dpclip.accounting.tuning as tuning_math
import dpclip.train.workflow as workflow
from dpclip import layout
from dpclip.accounting import Ledger, bound_text, event_to_dict
from dpclip.accounting.statement import sampling_name
from dpclip.accounting.tuning import repeat_and_select_event
from dpclip.data import load_data
from dpclip.errors import DpclipError
from dpclip.files import OWNER_ONLY_DIR, private_dir, write_json_atomic
from dpclip.models import build_model, evaluate
from dpclip.recipe.load import validate_recipe
from dpclip.recipe.tuning import held_out_is_private
from dpclip.rng import derived_seed, private_random
from dpclip.rundir.checkpoint import latest_checkpoint, load_checkpoint
from dpclip.planning.plan import privacy_plan, privacy_units, private_seed, statistic_groups
from dpclip.rundir.run import RunDir
from dpclip.rundir.searchdir import SCORE_MEANING, SEARCH_FORMAT, search_statement_lines
from dpclip.train.tensorboard import rewrite_selected_log
from dpclip.tuning.privacy import REPEAT_AND_SELECT, run_release
from dpclip.tuning.cost import check_same_privacy
from dpclip.tuning.space import reachable_configurations, search_space

#: Written in the selected run's directory: what publishing that run costs is the search's ε.
SEARCH_MARKER = RunDir.SEARCH_MARKER
#: The purpose of the search's private generator (K, configurations, choices, score noise).
SEARCH_PURPOSE = "tuning-search"

NOT_RELEASED = ("the number of trials K, the other trials and their scores: repeat-and-select's guarantee "
                "covers the selected run and its score only, so the other trials were deleted as soon as "
                "they were beaten")


def search_random(recipe) -> random.Random:
    """The search's secret generator: OS entropy, or the recipe's seed when it opts in."""
    return private_random(private_seed(recipe), SEARCH_PURPOSE)


def _trial_recipe(config_recipe, sigma: float, runs_dir: Path, name: str, *, index: int, private_score: bool):
    """The configuration's recipe trained at the search's per-run σ (no per-run ε: the search holds the budget)."""
    data = copy.deepcopy(config_recipe.model_dump(mode="json"))
    data["name"] = name
    data["output_dir"] = str(runs_dir)
    data["privacy"]["noise_multiplier"] = sigma
    data["privacy"]["epsilon"] = None
    if private_score:
        # Exact held-out metrics and training loss are not covered by ε; the search's only
        # look at the held-out split is its own noisy count.
        data["privacy"]["exact_diagnostics"] = False
    if config_recipe.privacy.unsafe_seeded_randomness:
        # The workflow seeds noise and batches from the recipe's seed in this mode: each
        # trial needs a seed of its own, or all trials would share noise and batches.
        data["seed"] = derived_seed(config_recipe.seed, f"search-trial-{index}")
    data["tuning"] = {}
    return validate_recipe(data, source=f"search trial {name}")


def _new_trial_dir(runs_dir: Path, name: str) -> Path:
    # A random name: a counter or a time stamp in the selected run's name would tell how
    # many trials came before it, which repeat-and-select keeps secret.
    while True:
        path = runs_dir / f"{name}-trial-{secrets.token_hex(4)}"
        if not path.exists():
            return path


def _discard(run_dir: Path | None) -> None:
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class _Candidate:
    run_dir: Path
    configuration: dict[str, Any]
    score: float
    epsilon_alone: float


def run_search(base: Mapping[str, Any], recipe, report, *, grid: Sequence[str] = (),
               random_draws: int | None = None,
               on_trial: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """Perform the search ``report`` describes; returns the search summary (also in summary.json).

    ``on_trial(number, label)`` is told of each trial as it starts (the CLI prints it on
    the operator's console). It learns how many trials ran, which the released result
    does not: never pass it anything that ends up in a published file.
    """
    privacy = report.privacy
    strategy = _feasible_strategy(privacy)
    data = _held_out_data(recipe, privacy)
    rng = search_random(recipe)
    configurations = search_space(base, recipe, grid, random_draws, rng=rng)
    # tune-cost checked every configuration the space can yield; these are the ones drawn now.
    check_same_privacy([*configurations, *reachable_configurations(base, recipe, grid, random_draws)],
                       report.dataset_size)
    sigma, mean, shape = strategy.noise_multiplier, strategy.detail["mean"], strategy.detail["shape"]
    _check_priced(privacy, report.dataset_size, recipe, configurations[0].recipe, data, sigma)
    trials = tuning_math.draw_trial_count(mean, shape, rng)

    release = privacy.release
    planned_training = release.training(sigma)
    search_event = repeat_and_select_event(release.event(sigma), mean, shape)
    ledger = _search_ledger(search_event, recipe, privacy, strategy)
    search = RunDir.new_search(recipe.output_dir, recipe.name)
    search_dir, runs_dir = search.path, search.search_runs
    private_dir(search_dir)
    runs_dir.mkdir(mode=OWNER_ONLY_DIR)
    # Written before the first run: the whole search's cost is committed from the start.
    write_json_atomic(search.ledger_file, ledger.to_dict())
    summary = _opening_summary(search_dir, recipe, privacy, strategy, ledger)

    def write_summary() -> None:
        write_json_atomic(search.summary_file, json.loads(json.dumps(summary)))

    write_summary()
    try:
        best, stopped = _run_trials(trials, configurations, rng, recipe=recipe, data=data, sigma=sigma,
                                    runs_dir=runs_dir, planned_training=planned_training,
                                    score_noise=privacy.score_noise, on_trial=on_trial)
    except BaseException as exc:
        summary["stopped"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        write_summary()
        raise
    summary["stopped"] = stopped
    if best is not None:
        summary.update({
            "selected_run": str(best.run_dir),
            "selected_run_dir": best.run_dir.relative_to(search_dir).as_posix(),
            "selected_configuration": best.configuration,
            "selected_score": best.score,
        })
    write_summary()
    if best is not None:
        _mark_selected(best, search_dir, summary)
    return summary


def _feasible_strategy(privacy):
    """The repeat-and-select strategy of a search ``--run`` can perform and record, or a refusal."""
    strategy = privacy.strategy(REPEAT_AND_SELECT)
    if strategy.detail["distribution"] == "truncated-negative-binomial" and strategy.detail["mean"] <= 1:
        # Only a space of one configuration gets here (a recipe's own trials_mean is above 1): nothing to select.
        raise DpclipError(f"the search space has {privacy.configurations} configuration, so repeat-and-select "
                          f"(E[K] = {strategy.detail['mean']:g}, K >= 1) has nothing to select from",
                          "give the search values to try (tuning.grid, --grid key=v1,v2, or tuning.ranges with "
                          "--random N), or set tuning.trials_mean above 1; one configuration alone is `dpclip train`")
    if strategy.noise_multiplier is None:
        raise DpclipError(f"repeat-and-select cannot keep this search within ε: {strategy.detail['infeasible']}",
                          "raise privacy.epsilon or search fewer configurations")
    if privacy.sensitivities:
        # The search directory's reader (dpclip/rundir/searchdir.py) knows Poisson-sampled and banded-MF
        # runs only: a BLT search would train every trial, then fail to state or check the selected run's ε.
        raise DpclipError("--run cannot perform a BLT search yet: its search directory could not state or check "
                          "the selected run's ε",
                          "tune-cost without --run prices a BLT search; --run performs a privacy.mechanism: dp-sgd "
                          "or banded-mf search")
    if strategy.detail["shape"] is None:
        # dpclip's ledger stores finite numbers only, and Poisson is dp_accounting's shape = inf.
        raise DpclipError("--run cannot record a Poisson number of trials in the search ledger yet",
                          "use tuning.trials: truncated-negative-binomial (the default; tuning.trials_shape=1 is "
                          "geometric)")
    return strategy


def _check_priced(privacy, dataset_size: int, recipe, trial_recipe, data, sigma: float) -> None:
    """Refuse a report priced for other runs (another N, recipe or score) before anything is charged: the
    search's ledger is the report's event, and each trial must spend exactly its training."""
    hint = ("price the search with tune_cost(base, recipe, grid=..., random_draws=...) on the recipe's own data "
            "(no dataset_size), then call run_search with the same base, recipe, grid and random_draws")
    units = privacy_units(trial_recipe, data)
    if units != dataset_size:
        raise DpclipError(f"the search was priced for N = {dataset_size:,}, and the recipe's training data has "
                          f"{units:,}: each trial would spend another event than the search charges", hint)
    plan = privacy_plan(trial_recipe, units, groups=statistic_groups(trial_recipe))
    if event_to_dict(run_release(recipe, plan).event(sigma)) != event_to_dict(privacy.release.event(sigma)):
        raise DpclipError("the search was priced for other runs than this recipe's (another sampling rate, number "
                          "of steps, mechanism or selection score): each trial would spend another event than the "
                          "search charges", hint)


def _held_out_data(recipe, privacy):
    """The data every trial trains and is scored on, split once (so all share one held-out split)."""
    if privacy.score_noise is None and held_out_is_private(recipe.data):
        # validate_recipe refuses it (check_tuning); a recipe built past validation (model_copy) is refused here
        raise DpclipError("the search's score is public (exact, uncharged), but the recipe's held-out rows are "
                          "private: cut from them (data.test_fraction) or its training data itself",
                          "give a separate public held-out set (data.test for files, data.test_split for hf), or "
                          "use tuning.score: private (noisy, charged)")
    # Drawn with a key from OS entropy (each trial's meta.json keeps it, secret), the recipe's
    # seed only in unsafe seeded mode, so that the released recipe says nothing of who is a member.
    key = None if recipe.privacy.unsafe_seeded_randomness else secrets.randbits(63)
    data = load_data(recipe.data, seed=recipe.seed, split_key=key)
    if privacy.score_noise is not None and data.task != "classification":
        raise DpclipError("a private selection score needs held-out accuracy (a classification task)",
                          "give a public held-out set (data.test / data.test_split) and set tuning.score: public")
    return data


def _search_ledger(search_event, recipe, privacy, strategy) -> Ledger:
    """The search directory's ledger: exactly the repeat-and-select event, under RDP (its only accountant)."""
    ledger = Ledger(privacy.delta, "rdp")
    ledger.record(search_event, metadata={
        "search": REPEAT_AND_SELECT, "trials_distribution": strategy.detail["distribution"],
        "trials_mean": strategy.detail["mean"], "trials_shape": strategy.detail["shape"],
        "sigma_per_run": strategy.noise_multiplier, "sample_rate": privacy.sample_rate,
        "steps_per_run": privacy.steps, "bands": privacy.bands,
        "sampling": sampling_name(privacy.sampling, privacy.bands, bool(privacy.sensitivities)),
        "score": privacy.score, "score_noise": privacy.score_noise, "seeded_randomness": recipe.privacy.unsafe_seeded_randomness,
        "unit": recipe.privacy.unit, "max_examples_per_user": recipe.data.max_examples_per_user,
    })
    return ledger


def _opening_summary(search_dir: Path, recipe, privacy, strategy, ledger: Ledger) -> dict[str, Any]:
    """The search's summary.json as written before the first trial (nothing selected yet)."""
    private_score = privacy.score_noise is not None
    return {
        "search_format": SEARCH_FORMAT,
        "search_dir": str(search_dir),
        "mechanism": "repeat-and-select (Papernot & Steinke 2022)",
        "trials_distribution": strategy.detail["distribution"],
        "trials_mean": strategy.detail["mean"],
        "trials_shape": strategy.detail["shape"],
        "sigma_per_run": strategy.noise_multiplier,
        "sample_rate": privacy.sample_rate,
        "steps_per_run": privacy.steps,
        "score": privacy.score,
        "score_meaning": (f"noisy held-out accuracy: {SCORE_MEANING[recipe.privacy.unit]}, charged to every run"
                          if private_score else
                          "held-out accuracy, the held-out split being public data by the recipe's claim"),
        "score_noise": privacy.score_noise,
        "seeded_randomness": recipe.privacy.unsafe_seeded_randomness,
        "promised_epsilon": strategy.epsilon,
        "epsilon": ledger.epsilon(),
        "delta": ledger.delta,
        "accountant": "rdp",
        "stopped": "running",
        "selected_run": None,
        "selected_run_dir": None,
        "selected_configuration": None,
        "selected_score": None,
        "not_released": NOT_RELEASED,
    }


def _run_trials(trials: int, configurations, rng: random.Random, *, recipe, data, sigma: float, runs_dir: Path,
                planned_training, score_noise: float | None,
                on_trial: Callable[[int, str], None] | None) -> tuple[_Candidate | None, str]:
    """Steps 2 and 3 of the mechanism: ``trials`` runs of configurations picked at random, each
    beaten one deleted at once; returns the best (None when none was kept) and how the search stopped."""
    best: _Candidate | None = None
    current: Path | None = None
    stopped = "completed"
    try:
        for index in range(trials):
            config = rng.choice(configurations)
            current = _new_trial_dir(runs_dir, recipe.name)
            trial = _trial_recipe(config.recipe, sigma, runs_dir, current.name, index=index,
                                  private_score=score_noise is not None)
            if on_trial is not None:
                on_trial(index + 1, config.label())
            result = workflow.train(trial, data=data, run_dir=current)
            if result.stopped != "completed":
                stopped = result.stopped
                break
            run_ledger = RunDir(current).ledger()
            if event_to_dict(run_ledger.composed_event()) != event_to_dict(planned_training):
                raise RuntimeError(f"run {current} spent {run_ledger.composed_event()} but the search accounts "
                                   f"{planned_training}: this is a dpclip bug")
            score = _released_score(current, trial, data, score_noise, rng)
            if score is not None and (best is None or score > best.score):
                _discard(best.run_dir if best else None)
                best = _Candidate(current, dict(config.values), score, result.epsilon)
            else:
                _discard(current)
            current = None
    except BaseException:
        # An unfinished search releases nothing: best-of-fewer-trials is not the mechanism
        # the ledger charges. The ledger still stands (the runs happened).
        _discard(current)
        _discard(best.run_dir if best else None)
        raise
    if stopped != "completed":
        _discard(current)
        _discard(best.run_dir if best else None)
        best = None
    return best, stopped


def held_out_people_accuracy(model, loss_fn, data, batch_size: int) -> tuple[float, int]:
    """(Σ over held-out people of each one's accuracy, the number of held-out people). One person's
    held-out records would move a count of correct records by as many as they wrote; this sum moves
    by at most 1 (docs/tuning.md)."""
    people = data.test_users.unique()
    total = sum(evaluate(model, loss_fn, {name: t[data.test_users == person] for name, t in data.test.items()},
                         data.task, batch_size=batch_size)["accuracy"] for person in people)
    return total, len(people)


def _released_score(run_dir: Path, trial, data, score_noise: float | None, rng: random.Random) -> float | None:
    """The score the search may look at: exact accuracy for a public split, noisy for a private one.

    Computed here from the trial's final checkpoint, in memory: with a private score the
    exact count never reaches a file."""
    model, loss_fn = build_model(trial.model, data, seed=trial.seed)
    load_checkpoint(latest_checkpoint(run_dir), model)
    metrics = evaluate(model, loss_fn, data.test, data.task, batch_size=trial.eval.batch_size)
    accuracy = metrics.get("accuracy")
    if accuracy is None:
        if score_noise is not None:
            raise DpclipError("a private selection score needs held-out accuracy (a classification task)",
                              "give a public held-out set (data.test / data.test_split) and set tuning.score: public")
        loss = metrics.get("loss")
        return None if loss is None or not math.isfinite(loss) else -loss
    if score_noise is None:
        return accuracy
    if data.test_users is not None:
        total, people = held_out_people_accuracy(model, loss_fn, data, trial.eval.batch_size)
        return (total + rng.gauss(0.0, score_noise)) / people
    held_out = data.num_test
    correct = round(accuracy * held_out)
    # Gaussian mechanism on the count of correct predictions (sensitivity 1 under add/remove).
    return (correct + rng.gauss(0.0, score_noise)) / held_out


def _mark_selected(best: _Candidate, search_dir: Path, summary: Mapping[str, Any]) -> None:
    """Make the selected run say what publishing it costs: the whole search's ε."""
    run = RunDir(best.run_dir)
    to_search = os.path.relpath(search_dir, best.run_dir)
    marker = {
        "search_format": SEARCH_FORMAT,
        "search_dir": Path(to_search).as_posix(),
        "ledger": (Path(to_search) / layout.LEDGER).as_posix(),
        "epsilon": summary["epsilon"],
        "delta": summary["delta"],
        "score": best.score,
        "configuration": best.configuration,
        "note": (f"this run was selected by a repeat-and-select search: publishing it costs the search's "
                 f"ε = {bound_text(summary['epsilon'])} (δ = {summary['delta']:g}); its own ledger.json "
                 f"(ε = {bound_text(best.epsilon_alone)}) covers its training alone and understates that"),
    }
    write_json_atomic(run.search_marker, marker)
    record = run.summary()
    record_statement = record.get("statement", [])
    record.update({
        "epsilon": summary["epsilon"],
        "epsilon_rdp": summary["epsilon"],
        "delta": summary["delta"],
        "epsilon_this_run_alone": best.epsilon_alone,
        "selected_by_search": marker,
        "statement": [marker["note"], *search_statement_lines(search_dir), "this run's own training alone:",
                      *(f"  {line}" for line in record_statement)],
    })
    write_json_atomic(run.summary_file, record)
    # The trial logged its own ε under another tag (dpclip/train/tensorboard.py): the headline is the search's,
    # in a log rewritten without the clock or the file count that would tell how many trials ran.
    rewrite_selected_log(run.path, summary["epsilon"], run.ledger().steps, list(run.public_plan().get("groups", [])))
