"""The base of every recipe section (dpclip/recipe/schema.py and the sections beside it)."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type lists a boolean (bool, a Literal of True/False, Any)."""
    if annotation is bool or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(isinstance(arg, bool) for arg in typing.get_args(annotation))
    return any(_admits_bool(arg) for arg in typing.get_args(annotation))


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_as_number(cls, data: Any) -> Any:
        # pydantic's lax mode reads `batch_size: true` as 1; a YAML true/false where a number
        # or a name is meant is a mistake, not a value.
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and not _admits_bool(field.annotation):
                    # ".name" is completed to the field's dotted path (recipe/load.py, explain_error).
                    raise ValueError(f".{name}: expected a number or a name, not the boolean {str(value).lower()}")
        return data
