"""User-level privacy in a recipe (docs/users.md): ``privacy.unit`` and the data fields that
say who wrote each record.

``privacy.unit: user`` makes the unit of privacy a person: the sampler draws people, takes
at most ``data.max_examples_per_user`` (k) of a drawn person's records, and the clipped sum
moves by at most C when all of one person's records are added or removed. The data say who
the person is: the builtin ``synthetic-users`` set has people of its own; files and Hugging
Face data name the column in ``data.user_field``.
"""

from __future__ import annotations

from pydantic import Field

from dpclip.engine.policies.base import PositiveInt
from dpclip.recipe.section import Section

#: Builtin data sets whose records carry the person who wrote them.
BUILTIN_WITH_USERS = ("synthetic-users",)


class DataUsers(Section):
    """The fields every data: variant has for user-level privacy."""

    user_field: str | None = Field(
        None, description="privacy.unit user: the column naming the person each record belongs to (files, hf; "
        "builtin synthetic-users has its own); never the label, text or a feature field")
    max_examples_per_user: PositiveInt | None = Field(
        None, description="privacy.unit user: k, the most records of one person a step takes (chosen at random "
        "by the private generator); required with privacy.unit: user")


def check_users(recipe) -> None:
    """The cross-section rules of ``privacy.unit: user`` that need only the recipe, among them what
    user-level training refuses (docs/users.md, "Not built yet"): refused here, ``dpclip validate``,
    ``account`` and ``tune-cost`` refuse it too, rather than state a guarantee no run can have."""
    data = recipe.data
    builtin_users = data.source == "builtin" and data.name in BUILTIN_WITH_USERS
    if getattr(data, "public_fraction", None) is not None and (builtin_users or data.user_field is not None):
        raise ValueError("data.public_fraction with users is not built yet: carve public data from data without "
                         "users, or name a separate public: block")
    if recipe.privacy.unit != "user":
        if data.max_examples_per_user is not None or data.user_field is not None:
            raise ValueError("data.user_field and data.max_examples_per_user belong to user-level privacy; set "
                             "privacy.unit: user, or remove them")
        return
    has_users = data.user_field is not None or builtin_users
    if not has_users:
        raise ValueError(f"privacy.unit 'user' needs to know who wrote each record: set data.user_field to the "
                         f"column naming the person (builtin data with users: {', '.join(BUILTIN_WITH_USERS)})")
    if data.source == "builtin" and data.user_field is not None:
        raise ValueError("builtin data sets name their own users: remove data.user_field")
    _check_user_field_unread(data)
    if data.max_examples_per_user is None:
        raise ValueError("privacy.unit 'user' needs data.max_examples_per_user (k, the most records of one person "
                         "a step takes), e.g. data.max_examples_per_user: 8")
    if recipe.training.sampling != "poisson":
        raise ValueError(f"privacy.unit 'user' does not run with training.sampling: {recipe.training.sampling} yet "
                         "(people are Poisson-sampled): set training.sampling: poisson")
    if recipe.training.parallel == "pipeline":
        raise ValueError("privacy.unit 'user' does not run on pipeline stages yet: set training.parallel: data "
                         "or fsdp")


def _check_user_field_unread(data) -> None:
    """The column naming the person is never what the model reads or predicts: as a label it would be
    learned and written out (the label names of every checkpoint list every person)."""
    user = data.user_field
    if user is None:
        return
    for name in ("label_field", "text_field"):
        if getattr(data, name, None) == user:
            raise ValueError(f"data.user_field {user!r} is also data.{name}: the model would read or predict "
                             "who each person is, and a trained model names them; set data.user_field to the "
                             f"column of person ids only, and data.{name} to another column")
    if user in (getattr(data, "feature_fields", None) or []):
        raise ValueError(f"data.feature_fields lists the user column {user!r}: a person's id is never a model "
                         "input; remove it from data.feature_fields")
