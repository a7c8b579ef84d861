"""The base of every recipe section (dpclip/recipe/schema.py and the sections beside it)."""

from __future__ import annotations

import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from dpclip.engine.policies import policy_spec


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type lists a boolean (bool, a Literal of True/False, Any)."""
    if annotation is bool or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(isinstance(arg, bool) for arg in typing.get_args(annotation))
    return any(_admits_bool(arg) for arg in typing.get_args(annotation))


def refuse_booleans_as_numbers(model: type[BaseModel], data: Any) -> Any:
    """``data`` unchanged, or a ValueError for a YAML true/false given to a field of ``model`` (or
    inside its list) whose type has no boolean: pydantic's lax mode reads ``batch_size: true`` as 1
    and ``hidden: [true]`` as [1]; a boolean where a number or a name is meant is a mistake, not a value."""
    if isinstance(data, dict):
        for name, value in data.items():
            field = model.model_fields.get(name) if isinstance(name, str) else None
            values = value if isinstance(value, list) else [value]
            flag = next((item for item in values if isinstance(item, bool)), None)
            if flag is not None and field is not None and not _admits_bool(field.annotation):
                # ".name" is completed to the field's dotted path (recipe/load.py, explain_error).
                raise ValueError(f".{name}: expected a number or a name, not the boolean {str(flag).lower()}")
    return data


def threshold_without_booleans(value: Any) -> Any:
    """``clipping.threshold`` checked as a Section is: the policy specs are the engine's models."""
    spec = policy_spec(value["kind"]) if isinstance(value, dict) and isinstance(value.get("kind"), str) else None
    return refuse_booleans_as_numbers(spec, value) if spec is not None else value


# A model or data size (layer width, channels, rank, kernel, tokens, examples) above this is a typo, not a
# model: torch refused 1e40 with a C++ backtrace, and a layer 2**31 wide already needs 512 GiB for one
# matrix; no published model comes within a factor of 10,000 of it (widths ~1e4, contexts ~1e6).
MAX_SIZE = 2**31 - 1


def _bounded_size(value: int) -> int:
    if value > MAX_SIZE:
        raise ValueError(f"{value} is not a size dpclip can build: sizes are at most {MAX_SIZE} (2**31 - 1); "
                         "was a digit or an exponent added by mistake?")
    return value


Size = Annotated[int, Field(gt=0), AfterValidator(_bounded_size)]
"""A positive model or data size, at most :data:`MAX_SIZE`."""

#: float32's largest number: torch's optimizers turn a learning rate into it (1e300 crashed in SGD.step)
FLOAT32_MAX = 3.4028234663852886e38


def _float32_rate(value: float) -> float:
    if value > FLOAT32_MAX:
        raise ValueError(f"{value:g} is beyond float32's range (at most {FLOAT32_MAX:.4g}), in which the optimizer "
                         "applies it; a useful learning rate is below 10")
    return value


LearningRate = Annotated[float, Field(gt=0, allow_inf_nan=False), AfterValidator(_float32_rate)]
"""A positive learning rate, finite in float32."""


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_as_number(cls, data: Any) -> Any:
        return refuse_booleans_as_numbers(cls, data)
