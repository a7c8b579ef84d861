"""The base of every recipe section (dpclip/recipe/schema.py and the sections beside it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
