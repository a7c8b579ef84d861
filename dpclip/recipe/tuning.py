"""The ``tuning:`` section of a recipe: what a hyperparameter search tries and how its
trials are drawn and scored (docs/tuning.md)."""

from __future__ import annotations

import os.path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from dpclip.engine.policies.base import PositiveFloat, PositiveInt, UnitOpen
from dpclip.recipe.section import Section

#: the most runs a search may plan: its configurations (tuning/space.py) and E[K] of repeat-and-select;
#: each is a whole private training run
MAX_SEARCH_RUNS = 10_000


class RandomRange(Section):
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> RandomRange:
        if not self.low < self.high:
            raise ValueError("'low' must be below 'high'")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs 'low' > 0")
        return self


class Tuning(Section):
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="recipe key -> values")
    random: PositiveInt | None = Field(None, description="number of random draws over 'ranges'")
    ranges: dict[str, RandomRange] = Field(default_factory=dict)
    score: Literal["private", "public"] = Field(
        "private", description="private: the held-out split is private data, its score is released with "
        "noise and charged to the budget; public: the held-out split is public data (your claim), so it must be "
        "a separate file or split (data.test, data.test_split), not cut from the private rows by test_fraction")
    score_noise: PositiveFloat = Field(
        5.0, description="private score: std of the Gaussian noise on the count of correct held-out predictions")
    trials: Literal["poisson", "truncated-negative-binomial"] = Field(
        "truncated-negative-binomial",
        description="repeat-and-select (Papernot & Steinke): law of the random number of trials K")
    trials_mean: PositiveFloat | None = Field(
        None, description="E[K]; default: the number of configurations; at least 1 for poisson, above 1 for "
        "truncated-negative-binomial (K >= 1); at most 10,000")
    trials_shape: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        1.0, description="truncated negative binomial η (0 logarithmic, 1 geometric)")
    stop_probability: UnitOpen | None = Field(
        None, description="Liu–Talwar γ: stop after each run with this probability; default 1/(2G)")
    stop_delta: UnitOpen = Field(1e-20, description="Liu–Talwar δ₂: mass cut by the hard limit T")

    @model_validator(mode="after")
    def _trials_mean_in_range(self) -> Tuning:
        # The RDP bounds of repeat-and-select (Papernot & Steinke 2022) hold for these means only.
        mean = self.trials_mean
        if mean is not None and self.trials == "poisson" and mean < 1:
            raise ValueError(f"trials_mean must be at least 1 for trials: poisson, got {mean:g}; e.g. the number "
                             "of configurations")
        if mean is not None and self.trials == "truncated-negative-binomial" and mean <= 1:
            raise ValueError(f"trials_mean must be above 1 for trials: truncated-negative-binomial (K >= 1), got "
                             f"{mean:g}; e.g. the number of configurations")
        if mean is not None and mean > MAX_SEARCH_RUNS:
            # (the draw of K also stops counting at 10^7: a law cut there is not the one accounted)
            raise ValueError(f"trials_mean must be at most {MAX_SEARCH_RUNS:,}, got {mean:g}: a search trains E[K] "
                             "whole private runs; e.g. the number of configurations")
        return self


def cuts_held_out(data) -> bool:
    """Whether a recipe's ``data`` cuts its held-out split from the private rows (no separate test file or split)."""
    return getattr(data, "test", None) is None and getattr(data, "test_split", None) is None


def held_out_is_training_data(data) -> bool:
    """Whether a recipe's separate held-out set is named as its training data itself (the same
    file, the same hub split): its rows are the private training rows."""
    if getattr(data, "test", None) is not None:
        return os.path.normpath(data.test) == os.path.normpath(data.train)
    return getattr(data, "test_split", None) is not None and data.test_split == data.split


def held_out_is_private(data) -> bool:
    """Whether a recipe's held-out rows are private data whatever it claims: cut from the private
    rows, or named as the training data itself."""
    return cuts_held_out(data) or held_out_is_training_data(data)


def check_tuning(recipe) -> None:
    """The tuning block's rules that need the rest of the recipe.

    ``score: public`` claims the held-out split is public data, and the search then selects on its
    exact accuracy, charged nothing and released unlabelled (the selected run's search.json, the
    search's summary.json). A held-out split cut from the private rows (``data.test_fraction``) is
    private data whatever the recipe claims, so the claim is refused there rather than trusted, as it
    is where the held-out set is named as the training data itself (the same file or hub split).
    """
    if recipe.tuning.score == "public" and cuts_held_out(recipe.data):
        raise ValueError("tuning.score 'public' claims the held-out split is public data, but this recipe cuts it "
                         "from the private rows (data.test_fraction): its exact accuracy would be selected on and "
                         "released uncharged; give a separate public held-out set (data.test for files, "
                         "data.test_split for hf), or use tuning.score: private (noisy, charged)")
    if recipe.tuning.score == "public" and held_out_is_training_data(recipe.data):
        raise ValueError("tuning.score 'public' claims the held-out split is public data, but this recipe's held-out "
                         "set is its training data (data.test is data.train, or data.test_split is data.split); give "
                         "a separate public held-out set, or use tuning.score: private (noisy, charged)")
