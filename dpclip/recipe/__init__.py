"""Recipes: the pydantic schema, YAML loading and ``key=value`` overrides."""

from dpclip.recipe.load import (apply_overrides, load_recipe, read_recipe_data, read_yaml, recipe_to_yaml, resolve_paths,
                                validate_recipe)
from dpclip.recipe.schema import Recipe

__all__ = ["Recipe", "apply_overrides", "load_recipe", "read_recipe_data", "read_yaml", "recipe_to_yaml",
           "resolve_paths", "validate_recipe"]
