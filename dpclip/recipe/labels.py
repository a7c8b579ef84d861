"""A classifier's classes declared in the recipe (``data.labels``): the label set made public.

Without it, the label set is read from the private labels (the largest whole-number label + 1,
or the sorted class names), so one record with a rare label shows in the model's output size,
and the statement lists the label set as not covered by ε. Declared, the classes are the
recipe's: output i is ``labels[i]``, and a row whose label is not among them is refused
(:func:`dpclip.data.columns.encode_labels`), as Opacus and Hugging Face users give ``num_labels``
and ``id2label`` themselves.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import AfterValidator, Field, StrictInt, StrictStr, field_validator, model_validator

from dpclip.recipe.section import Section


def _distinct(labels: list | None) -> list | None:
    if labels is None:
        return None
    if len(labels) < 2:
        raise ValueError(f"data.labels declares {len(labels)} class(es): a classifier needs at least 2")
    seen: set = set()
    for label in labels:
        if label in seen:
            raise ValueError(f"data.labels names {label!r} twice: each class once, in the model's output order")
        seen.add(label)
    return labels


Labels = Annotated[Union[list[StrictInt], list[StrictStr]] | None, AfterValidator(_distinct)]


class DataLabels(Section):
    """The field of the files and hf data: variants that declares the classes."""

    labels: Labels = Field(
        None, description="the classes, declared (public): the model's output i is labels[i] (all whole numbers or "
        "all strings, as the label column holds them; a hub ClassLabel's ids by name or id); a row with another "
        "label is refused. Without it the label set is a hub data set's ClassLabel, or read from the private labels, "
        "which the statement lists as not covered by ε")

    @field_validator("labels", mode="before")
    @classmethod
    def _one_type(cls, labels):
        if isinstance(labels, list) and len({type(label) for label in labels}) > 1:
            raise ValueError(f"data.labels mixes types ({', '.join(repr(label) for label in labels[:4])}): "
                             "all whole numbers or all strings, as the label column holds them")
        return labels

    @model_validator(mode="after")
    def _needs_a_label_field(self):
        if self.labels is not None and getattr(self, "label_field", None) is None:
            raise ValueError("data.labels declares the classes of data.label_field: set data.label_field, or "
                             "remove data.labels")
        return self
