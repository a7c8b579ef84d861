"""``tune-cost --run``: perform the search with Papernot–Steinke repeat-and-select.

The mechanism (Papernot & Steinke 2022, Algorithm 1 with a random number of trials):

1. draw K from the recipe's distribution (Poisson, or truncated negative binomial) with
   mean E[K] (default: the number of configurations);
2. K times: pick a configuration uniformly at random, train it through the training
   workflow at the per-run σ that ``tune-cost`` calibrated, and score it on the held-out
   split — with a private score, the score released is the count of correct predictions
   plus Gaussian noise of std ``tuning.score_noise`` (sensitivity 1);
3. release the best-scoring run (none when K = 0).

Its privacy is ``RepeatAndSelectDpEvent(run event, E[K], shape)`` under the RDP
accountant, whatever K turned out to be: K, the configurations picked and the noise are
the mechanism's secret randomness (seeded by the recipe's seed for reproducibility unless
``privacy.secure``). The search directory's ``ledger.json`` holds exactly that event, so
its ε is the one ``tune-cost`` promised. Each trained run also keeps its own directory
and ledger (its cost alone) under ``runs/``.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from dpclip.errors import DpclipError


def new_search_dir(output_dir: str, name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(output_dir) / f"{name}-search-{stamp}"
    path, suffix = base, 1
    while path.exists():
        suffix += 1
        path = base.with_name(f"{base.name}-{suffix}")
    return path


def _trial_recipe(config_recipe, sigma: float, runs_dir: Path, name: str):
    """The configuration's recipe trained at the search's per-run σ (no per-run ε: the search holds the budget)."""
    from dpclip.recipe.load import validate_recipe

    data = copy.deepcopy(config_recipe.model_dump(mode="json"))
    data["name"] = name
    data["output_dir"] = str(runs_dir)
    data["privacy"]["noise_multiplier"] = sigma
    data["privacy"]["epsilon"] = None
    data["tuning"] = {}
    return validate_recipe(data, source=f"search trial {name}")


def run_search(base: Mapping[str, Any], recipe, report, *, grid: Sequence[str] = (),
               random_draws: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Perform the search ``report`` describes; returns the search summary (also in summary.json)."""
    import dp_accounting

    from dpclip.accounting import Ledger, event_to_dict, training_event
    from dpclip.accounting.tuning import draw_trial_count, repeat_and_select_event
    from dpclip.train.files import read_json, write_json_atomic
    from dpclip.train.workflow import train
    from dpclip.tuning.privacy import REPEAT_AND_SELECT
    from dpclip.tuning.space import search_space

    privacy = report.privacy
    strategy = privacy.strategy(REPEAT_AND_SELECT)
    if strategy.sigma_total is None:
        raise DpclipError(f"repeat-and-select cannot keep this search within ε: {strategy.detail['infeasible']}",
                          "raise privacy.epsilon or search fewer configurations")
    if strategy.detail["shape"] is None:
        # dpclip's ledger stores finite numbers only, and Poisson is dp_accounting's shape = inf.
        raise DpclipError("--run cannot record a Poisson number of trials in the search ledger yet",
                          "use tuning.trials: truncated-negative-binomial (the default; tuning.trials_shape=1 is "
                          "geometric)")
    configurations = search_space(base, recipe, grid, random_draws)
    sigma = strategy.sigma_total
    mean = strategy.detail["mean"]
    shape = float("inf") if strategy.detail["shape"] is None else strategy.detail["shape"]
    rng = random.SystemRandom() if recipe.privacy.secure else random.Random(f"dpclip-search-{recipe.seed}")
    trials = draw_trial_count(mean, shape, rng)

    planned_training = training_event(privacy.sample_rate, sigma, privacy.steps)
    run_event = planned_training if privacy.score_noise is None else dp_accounting.ComposedDpEvent(
        [planned_training, dp_accounting.GaussianDpEvent(privacy.score_noise)])
    search_event = repeat_and_select_event(run_event, mean, shape)

    ledger = Ledger(privacy.delta, "rdp")  # RepeatAndSelect: RDP accountant only
    ledger.record(search_event, metadata={
        "search": REPEAT_AND_SELECT, "trials_distribution": strategy.detail["distribution"], "trials_mean": mean,
        "sigma_per_run": sigma, "score": privacy.score, "score_noise": privacy.score_noise,
    })
    search_dir = new_search_dir(recipe.output_dir, recipe.name)
    runs_dir = search_dir / "runs"
    runs_dir.mkdir(parents=True)
    # Written before the first run: the whole search's cost is committed from the start.
    write_json_atomic(search_dir / "ledger.json", ledger.to_dict())

    records: list[dict[str, Any]] = []
    stopped = "completed"
    for index in range(trials):
        config = rng.choice(configurations)
        trial = _trial_recipe(config.recipe, sigma, runs_dir, f"{recipe.name}-trial{index + 1:03d}")
        if not quiet:
            from dpclip.cli.render import console

            console.print(f"trial {index + 1}/{trials}: {config.label()}")
        result = train(trial)
        run_ledger = Ledger.from_dict(read_json(result.run_dir / "ledger.json"))
        if result.stopped == "completed" and \
                event_to_dict(run_ledger.composed_event()) != event_to_dict(planned_training):
            raise RuntimeError(f"run {result.run_dir} spent {run_ledger.composed_event()} but the search accounts "
                               f"{planned_training}: this is a dpclip bug")
        records.append({"trial": index + 1, "configuration": config.values, "run_dir": str(result.run_dir),
                        "stopped": result.stopped,
                        "score": _released_score(result, privacy.score_noise, rng)})
        if result.stopped != "completed":
            stopped = result.stopped
            break

    scored = [r for r in records if r["score"] is not None and r["stopped"] == "completed"]
    best = max(scored, key=lambda r: r["score"]) if scored else None
    summary = {
        "search_dir": str(search_dir),
        "mechanism": "repeat-and-select (Papernot & Steinke 2022)",
        "trials": trials,
        "trials_distribution": strategy.detail["distribution"],
        "trials_mean": mean,
        "trials_shape": strategy.detail["shape"],
        "sigma_per_run": sigma,
        "steps_per_run": privacy.steps,
        "score": privacy.score,
        "score_meaning": ("noisy held-out accuracy: (correct + N(0, score_noise²)) / held-out size, charged to "
                          "every run" if privacy.score_noise is not None else
                          "held-out accuracy, the held-out split being public data by the recipe's claim"),
        "score_noise": privacy.score_noise,
        "promised_epsilon": strategy.epsilon,
        "epsilon": ledger.epsilon(),
        "delta": ledger.delta,
        "accountant": "rdp",
        "stopped": stopped,
        "selected_run": best["run_dir"] if best else None,
        "selected_configuration": best["configuration"] if best else None,
        "runs": records,
    }
    write_json_atomic(search_dir / "summary.json", json.loads(json.dumps(summary)))
    return summary


def _released_score(result, score_noise: float | None, rng: random.Random) -> float | None:
    """The score the search may look at: exact accuracy for a public split, noisy for a private one."""
    from dpclip.train.files import read_json

    accuracy = result.final_eval.get("accuracy")
    if accuracy is None:
        if score_noise is not None:
            raise DpclipError("a private selection score needs held-out accuracy (a classification task)",
                              "set tuning.score: public if the held-out split is public data")
        loss = result.final_eval.get("loss")
        return None if loss is None else -loss
    if score_noise is None:
        return accuracy
    held_out = int(read_json(result.run_dir / "meta.json")["plan"]["num_test"])
    correct = round(accuracy * held_out)
    # Gaussian mechanism on the count of correct predictions (sensitivity 1 under add/remove).
    return (correct + rng.gauss(0.0, score_noise)) / held_out
