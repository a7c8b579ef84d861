"""The search space: which configurations a search trains, each one a validated recipe.

A configuration is a mapping ``{dotted recipe key: value}`` applied to the base recipe
with :func:`dpclip.recipe.load.apply_overrides`, then validated by the schema, so a
search can vary any recipe key and a value the schema refuses is an error before
anything runs. The space comes from the recipe's ``tuning:`` section, or from
``--grid key=v1,v2,...`` (which replaces the recipe's grid) and ``--random N``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from dpclip.errors import RecipeError
from dpclip.recipe.load import apply_overrides, validate_recipe
from dpclip.recipe.tuning import MAX_SEARCH_RUNS
from dpclip.recipe.schema import RandomRange, Recipe
from dpclip.rng import private_random
from dpclip.planning.plan import private_seed

# Keys a search may not vary: the search's budget is the recipe's privacy section, the
# data set is what the budget protects, and tuning/name/output_dir describe the search.
FORBIDDEN_PREFIXES = ("privacy", "tuning", "data", "name", "output_dir")

#: The most configurations a search may have (each validated as a recipe before anything runs).
MAX_CONFIGURATIONS = MAX_SEARCH_RUNS


@dataclass(frozen=True)
class Configuration:
    """One point of the search space and the recipe it gives."""

    values: dict[str, Any]
    recipe: Recipe

    def label(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.values.items()) or "(the recipe as is)"


def parse_grid_option(text: str) -> tuple[str, list[Any]]:
    """``key=v1,v2,...`` -> (key, [v1, v2, ...]); each value is read as YAML (``0.1`` -> 0.1)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip() or any(not part for part in key.split(".")):
        raise RecipeError(f"--grid {text!r} is not of the form key=v1,v2,...",
                          "example: --grid training.optimizer.lr=0.01,0.1,1")
    return key, [_parse_value(item.strip()) for item in raw.split(",")]


def _parse_value(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    except RecursionError:
        raise RecipeError(f"--grid value {text[:20]}... is nested too deeply to be read",
                          "a grid value is a number or a name; check for repeated [ and { brackets") from None
    if isinstance(value, str):
        # YAML 1.1 reads 1e-3 as a string; a search over numbers means a number.
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_key(key: str, origin: str) -> None:
    head = key.split(".")[0]
    if head in FORBIDDEN_PREFIXES:
        raise RecipeError(f"{origin} {key}: a search cannot vary '{head}'",
                          "the search's budget is the recipe's privacy section and the data is what it protects; "
                          "search over training, model or clipping keys")


def _configuration(base: Mapping[str, Any], values: dict[str, Any], origin: str) -> Configuration:
    # apply_overrides creates the sections on each key's path (and refuses a path through a
    # value); the values themselves are then set directly, without a round-trip through YAML text.
    data = apply_overrides(dict(base), [f"{key}=" for key in values])
    for key, value in values.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    try:
        recipe = validate_recipe(data, source=origin)
    except RecipeError as exc:
        raise RecipeError(f"{exc.message}\n  in configuration: "
                          + ", ".join(f"{k}={v}" for k, v in values.items()),
                          "every value of a search is validated like a recipe key; see docs/recipes.md") from None
    return Configuration(dict(values), recipe)


def _draw(spec: RandomRange, rng: random.Random) -> float:
    if spec.log:
        return math.exp(rng.uniform(math.log(spec.low), math.log(spec.high)))
    return rng.uniform(spec.low, spec.high)


def search_space(base: Mapping[str, Any], recipe: Recipe, grid: Sequence[str] = (),
                 random_draws: int | None = None, rng: random.Random | None = None) -> list[Configuration]:
    """The configurations of the search.

    Args:
        base: the recipe as a plain mapping (YAML as written, overrides applied).
        recipe: ``base`` validated (its ``tuning`` section is read).
        grid: ``--grid key=v1,v2,...`` options; when given they replace the recipe's grid.
        random_draws: ``--random N``; when given (or ``tuning.random`` is set) the search
            draws N configurations: ranges uniformly (log-uniformly for ``log: true``),
            grid keys uniformly among their values.
        rng: the generator of those draws. Default: a private one (OS entropy, or the
            recipe's seed with ``privacy.unsafe_seeded_randomness``): which configurations
            a search tries is part of its secret randomness, so the recipe's seed must not
            predict them. ``tune-cost --run`` passes the search's own generator.
    """
    tuning = recipe.tuning
    axes, origin = _axes(recipe, grid)
    draws = random_draws if random_draws is not None else tuning.random

    if draws is not None:
        if draws < 1:
            raise RecipeError(f"--random must be at least 1, got {draws}", "e.g. --random 20")
        _check_size(draws, "--random draws", "draw fewer: e.g. --random 20")
        if not tuning.ranges and not axes:
            raise RecipeError("a random search needs tuning.ranges (or a grid to draw from)",
                              "add e.g. tuning: {ranges: {training.optimizer.lr: {low: 0.01, high: 1, log: true}}}")
        if rng is None:
            rng = private_random(private_seed(recipe), "tuning-space")
        points = []
        for _ in range(draws):
            point = {key: rng.choice(values) for key, values in axes.items()}
            point.update({key: _draw(spec, rng) for key, spec in tuning.ranges.items()})
            points.append(point)
    else:
        keys = list(axes)
        _check_size(math.prod(len(values) for values in axes.values()), f"the {origin}'s Cartesian product has",
                    "search fewer values per key, or draw a few configurations from the space with --random N "
                    "(tuning.random)")
        points = [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]
        configurations = [_configuration(base, point, str(origin)) for point in points]
        _check_distinct_configurations(configurations, origin)
        return configurations
    return [_configuration(base, point, str(origin)) for point in points]


def _check_size(count: int, what: str, fix: str) -> None:
    if count > MAX_CONFIGURATIONS:
        raise RecipeError(f"{what} {count:,} configurations, more than a search can train ({MAX_CONFIGURATIONS:,} at "
                          "most)", f"each configuration is a whole private training run: {fix}")


#: Above this many combinations, :func:`reachable_configurations` checks every pair of values together
#: (or, above as many pairs, each value once) rather than every combination.
REACHABLE_LIMIT = 2048


def reachable_configurations(base: Mapping[str, Any], recipe: Recipe, grid: Sequence[str] = (),
                             random_draws: int | None = None) -> list[Configuration]:
    """Every configuration the space can yield, for the checks that must hold for all of them
    (a random search draws its configurations again when it runs, so one draw proves nothing).

    A grid search: exactly its configurations. A random search: every combination of its grid
    values and its ranges' two ends; above :data:`REACHABLE_LIMIT` combinations, every pair of
    values together (the other keys at their first value), or, above as many pairs, each value
    once; :func:`space_checked` says which. A combination left unchecked is checked when
    ``--run`` draws it, before anything trains or is charged."""
    axes, origin = _axes(recipe, grid)
    draws = random_draws if random_draws is not None else recipe.tuning.random
    if draws is None:
        return search_space(base, recipe, grid)
    points, _ = _reachable_points(_random_axes(axes, recipe))
    return [_configuration(base, point, str(origin)) for point in points]


def space_checked(recipe: Recipe, grid: Sequence[str] = (), random_draws: int | None = None) -> str | None:
    """What :func:`reachable_configurations` checked of a random space too big to check whole (None: all of it)."""
    axes, _ = _axes(recipe, grid)
    draws = random_draws if random_draws is not None else recipe.tuning.random
    if draws is None:
        return None
    axes = _random_axes(axes, recipe)
    points, what = _reachable_points(axes)
    if what is None:
        return None
    total = math.prod(len(values) for values in axes.values())
    return (f"the random search's {total:,} combinations of grid values (each range at both ends) are too many to "
            f"check each: {what} were validated and checked for one privacy plan ({len(points):,} configurations); "
            "a combination the schema refuses or that changes the privacy plan is refused when --run draws it, "
            "before anything trains or is charged")


def _random_axes(axes: dict[str, list[Any]], recipe: Recipe) -> dict[str, list[Any]]:
    """A random search's grid keys and each range's two ends, as the axes of the reachable check."""
    ends = {key: [spec.low, spec.high] if spec.high != spec.low else [spec.low]
            for key, spec in recipe.tuning.ranges.items()}
    return {**axes, **ends}


def _reachable_points(axes: dict[str, list[Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """The points of the reachable check and, when they are not every combination, what they cover."""
    keys = list(axes)
    sizes = [len(axes[key]) for key in keys]
    if math.prod(sizes) <= REACHABLE_LIMIT:
        return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))], None
    first = {key: values[0] for key, values in axes.items()}
    if sum(a * b for i, a in enumerate(sizes) for b in sizes[i + 1:]) <= REACHABLE_LIMIT:
        points = [{**first, one: u, other: v} for i, one in enumerate(keys) for other in keys[i + 1:]
                  for u in axes[one] for v in axes[other]]
        what = "every pair of values together, the other keys at their first value"
    else:
        points = [{**first, key: value} for key in keys for value in axes[key]]
        what = "each grid value and range end once, the other keys at their first value"
    unique = {tuple(_value_identity(point[key]) for key in keys): point for point in points}
    return list(unique.values()), what


def _value_identity(value: Any) -> str:
    """A value as the recipe reads it: 1, 1.0 and 1e0 are one learning rate."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return json.dumps(value, sort_keys=True, default=repr)


def _check_distinct(key: str, values: Sequence[Any], origin: str) -> None:
    """A value listed twice would be trained twice and charged as two configurations (a random
    search would draw it twice as often): refused, since it is most likely a typo for another value."""
    seen: dict[str, Any] = {}
    for value in values:
        if (identity := _value_identity(value)) in seen:
            raise RecipeError(f"{origin} {key} lists the value {seen[identity]!r} more than once"
                              + ("" if value == seen[identity] and type(value) is type(seen[identity])
                                 else f" (also as {value!r})"),
                              "list each value once: every value of a grid is a whole private run, charged to the "
                              "search's ε")
        seen[identity] = value


def _check_distinct_configurations(configurations: Sequence[Configuration], origin: str) -> None:
    """Two points of a grid that validate to one recipe are one configuration trained and charged twice."""
    seen: dict[str, Configuration] = {}
    for config in configurations:
        text = config.recipe.model_dump_json()
        if text in seen:
            raise RecipeError(f"the {origin}'s configurations {seen[text].label()} and {config.label()} are the same "
                              "recipe once validated, so it would be trained more than once",
                              "list each configuration once: every one is a whole private run, charged to the "
                              "search's ε")
        seen[text] = config


def _axes(recipe: Recipe, grid: Sequence[str]) -> tuple[dict[str, list[Any]], str]:
    """The grid's keys and values (``--grid`` replacing the recipe's), each key checked, and where they came from."""
    tuning = recipe.tuning
    if grid:
        axes: dict[str, list[Any]] = {}
        for text in grid:
            key, values = parse_grid_option(text)
            if key in axes:
                raise RecipeError(f"--grid {key} is given twice", "list all its values in one --grid key=v1,v2,...")
            axes[key] = values
        origin = "--grid"
    else:
        axes = {key: list(values) for key, values in tuning.grid.items()}
        origin = "tuning.grid"
    for key, values in axes.items():
        _check_key(key, origin)
        if not values:
            raise RecipeError(f"{origin} {key} has no values", "list at least one value")
        _check_distinct(key, values, origin)
    for key in tuning.ranges:
        _check_key(key, "tuning.ranges")
    return axes, origin
