"""The ``audit:`` block of a recipe: what a run plants for its audits (docs/auditing.md).

- ``canaries``: examples (or people) each trained on with probability ½, for the one-run
  audit; the inclusion secret is kept in the run's ``audit/canaries.json``.
- ``exposure``: secret sequences planted in a language model's training text, each repeated
  a number of times, for canary exposure (Carlini et al. 2019, "The Secret Sharer"); the
  secrets are drawn from OS entropy (never from the recipe seed) and kept in the run's
  ``audit/exposure.json``.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from dpclip.data.exposure import SECRET_SLOT
from dpclip.engine.policies.base import PositiveInt
from dpclip.recipe.section import Section


class Canaries(Section):
    count: Annotated[int, Field(ge=2)] = Field(
        100, description="canaries made (at least 2: the one-run audit guesses on m/20 to m/2 of them); each goes "
        "into the training set with prob 1/2")
    kind: Literal["mislabel", "ood"] = Field(
        "mislabel", description="mislabel: held-out examples with a wrong label (record-level runs only: they are "
        "real people's rows); ood: uniform-noise inputs")
    seed: Annotated[int, Field(ge=0)] | None = Field(
        None, description="draws the canaries and their inclusion; default: fresh OS entropy, kept in the run's "
        "audit/canaries.json. Setting it makes them reproducible from the recipe, which is then as secret as "
        "that answer key")
    domain: tuple[float, float] | None = Field(
        None, description="ood: the PUBLIC [low, high] every feature is drawn in (in the model's feature units); "
        "default: what a builtin data set declares (digits: [0, 1], grey levels 0..16 scaled by 1/16); "
        "never taken from the private data")

    @model_validator(mode="after")
    def _domain_is_an_interval(self) -> Canaries:
        if self.domain is not None:
            low, high = self.domain
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ValueError(f"audit.canaries.domain must be [low, high] with finite low < high, not {list(self.domain)}")
        return self


class Exposure(Section):
    template: str = Field(
        "my secret number is {secret}", description="the planted text; {secret} is replaced by each secret")
    alphabet: str = Field("0123456789", min_length=2, description="the characters a secret is drawn from")
    length: PositiveInt = Field(6, description="characters per secret: the candidate space has |alphabet|^length "
                                "members")
    repetitions: list[PositiveInt] = Field(
        [1, 4, 16], min_length=1, description="one planted secret per entry, put into the training text that many "
        "times")
    controls: PositiveInt = Field(
        8, description="secrets drawn the same way and never planted: their exposure is chance (about 1.44 bits)")
    candidates: PositiveInt = Field(
        100_000, description="a space up to this size is ranked in full; a larger one by this many random "
        "candidates, extrapolated (skew-normal fit) where the secret beats them all")

    @field_validator("template")
    @classmethod
    def _one_slot(cls, template: str) -> str:
        if template.count(SECRET_SLOT) != 1:
            raise ValueError(f"audit.exposure.template must hold {SECRET_SLOT} exactly once, not {template!r}")
        return template

    @field_validator("alphabet")
    @classmethod
    def _distinct(cls, alphabet: str) -> str:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"audit.exposure.alphabet repeats a character: {alphabet!r}")
        return alphabet

    @property
    def space(self) -> int:
        """|R|, the number of possible secrets."""
        return len(self.alphabet) ** self.length


class Audit(Section):
    canaries: Canaries | None = Field(
        None, description="one-run audit canaries; the inclusion secret is kept in the run's audit/canaries.json")
    exposure: Exposure | None = Field(
        None, description="canary exposure of a causal LM: planted secrets, kept in the run's audit/exposure.json "
        "(docs/auditing.md)")


def check_audit(recipe) -> None:
    """The audit block's rules that need the rest of the recipe.

    ``mislabel`` canaries are refused at the user level: they are held-out rows of real people,
    and a canary person built of them would put one real person's records into several privacy
    units (several canary people, each clipped and sampled on its own), so that person would get
    only group privacy, not the per-person ε of the ledger. ``ood`` canaries are noise, nobody's rows.
    """
    canaries = recipe.audit.canaries
    if canaries is not None and canaries.kind == "mislabel" and recipe.privacy.unit == "user":
        raise ValueError("audit.canaries.kind 'mislabel' (the default) cannot be used with privacy.unit: user: a "
                         "mislabel canary is a real held-out record, and a canary person made of them would split "
                         "real people's records across several privacy units (only group privacy for them); use "
                         "audit.canaries.kind: ood, with audit.canaries.domain: [low, high] (the public range of "
                         "the features) unless the builtin data set declares one")
    if recipe.audit.exposure is not None and getattr(recipe.model, "task", None) != "causal-lm":
        raise ValueError("audit.exposure plants secrets in a language model's training text; it needs model.kind "
                         "hf with task causal-lm (use audit.canaries for classifiers)")
