"""``PrivacyArguments``, the privacy half of a ``DPTrainer``'s arguments, and what DPTrainer reads from them and
from the training data: each example's person (user level), and the default per-sample loss (docs/python-api.md,
"Hugging Face Trainer")."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

from torch import Tensor, nn

from dpclip.data.user_sampler import number_people
from dpclip.errors import DpclipError
from dpclip.models.losses import cross_entropy, next_token_cross_entropy, no_generation_cache


@dataclass
class PrivacyArguments:
    """The privacy half of a DPTrainer's arguments (the other half is the TrainingArguments).

    ``target_epsilon`` or ``noise_multiplier`` (the total σ), ``delta``, and
    ``per_sample_max_grad_norm`` (a fixed threshold C; dp-transformers' name, distinct from
    TrainingArguments' ``max_grad_norm`` so that ``HfArgumentParser((TrainingArguments,
    PrivacyArguments))`` parses both; ``max_grad_norm=`` is accepted in Python) or ``clipping``
    (a recipe's ``clipping:`` block: docs/recipes.md)."""

    delta: float = field(metadata={"help": "δ of the guarantee"})
    target_epsilon: float | None = field(default=None, metadata={"help": "calibrate the noise to this ε"})
    noise_multiplier: float | None = field(default=None, metadata={"help": "or: the total noise multiplier σ"})
    per_sample_max_grad_norm: float | None = field(default=None, metadata={"help": "the clipping threshold C"})
    clipping: dict | str | None = field(default_factory=dict, metadata={   # str: HfArgumentParser reads JSON
        "help": "a recipe's clipping block (JSON)"})
    accountant: str = "pld"
    unsafe_seed: int | None = None
    verify_every: int = 0   # the certificate's period in steps, beyond its own checks (docs/certificate.md)
    users_column: str | None = field(default=None, metadata={
        "help": "user-level privacy: the dataset's column naming each example's person (docs/users.md)"})
    max_records_per_user: int | None = field(default=None, metadata={
        "help": "user-level privacy: the most records of one person in a step (k)"})
    compile: bool = field(default=False, metadata={
        "help": "each part's forward, backward and clip as one torch.compile graph, checked against the engine "
                "(docs/compiled.md); pad batches to one length, or each new length compiles again"})
    compile_backend: str = "inductor"   # torch.compile's backend for compile=True
    max_grad_norm: InitVar[float | None] = None   # the same as per_sample_max_grad_norm, in Python only

    def __post_init__(self, max_grad_norm: float | None) -> None:
        if max_grad_norm is not None:
            if self.per_sample_max_grad_norm is not None:
                raise DpclipError("give per_sample_max_grad_norm or max_grad_norm, not both",
                                  "PrivacyArguments(per_sample_max_grad_norm=1.0)")
            self.per_sample_max_grad_norm = max_grad_norm
        if isinstance(self.clipping, str):
            try:
                self.clipping = json.loads(self.clipping)
            except json.JSONDecodeError as exc:
                raise DpclipError(f"clipping is not JSON ({exc.msg} at character {exc.pos})", "--clipping "
                                  """'{"grouping": "layer", "threshold": {"kind": "fixed", "value": 1.0}}'""") from None
        if self.clipping is None:
            self.clipping = {}
        if not isinstance(self.clipping, dict):
            raise DpclipError(f"clipping is a {type(self.clipping).__name__}, not a recipe's clipping block",
                              "give a JSON object (a dict in Python): docs/recipes.md, clipping")


def trainer_people(dataset: Any, privacy: PrivacyArguments) -> Tensor | None:
    """Each example's person, numbered 0..U-1 by first appearance, from ``privacy.users_column``
    (None: example-level privacy)."""
    column, k = privacy.users_column, privacy.max_records_per_user
    if column is None and k is None:
        return None
    if column is None or k is None or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise DpclipError("user-level privacy needs users_column= and max_records_per_user= (a whole number >= 1)",
                          "PrivacyArguments(..., users_column='user_id', max_records_per_user=4)")
    try:
        ids = list(dataset[column]) if datasets_dataset(dataset) else [row[column] for row in dataset]
    except (KeyError, TypeError) as exc:
        raise DpclipError(f"the training data has no column {column!r} ({exc})",
                          "name the column that says whose each example is") from None
    return number_people(ids)


def datasets_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.Dataset`` (without importing ``datasets``)."""
    module = type(dataset).__module__
    return module.startswith("datasets.") and type(dataset).__name__ == "Dataset"


def default_per_sample_loss(model: nn.Module, inputs: Mapping[str, Tensor]) -> Tensor:
    """One loss per example from the model's logits and ``inputs["labels"]``: cross-entropy for
    logits ``[b, C]``, next-token cross-entropy (mean over each example's target tokens) for
    ``[b, T, V]``."""
    with no_generation_cache(model):
        logits = model(**{key: value for key, value in inputs.items() if key != "labels"}).logits
    batch = {"labels": inputs["labels"]}
    return next_token_cross_entropy(logits, batch) if logits.dim() == 3 else cross_entropy(logits, batch)
