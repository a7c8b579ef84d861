"""The recipe's ``continual:`` section: public pre-training, then private training.

Bu et al., "Pre-training Differentially Private Models with Limited Public Data"
(docs/continual.md): a little public data removes most of DP's slowdown. The schedules
are the paper's Table 2; the switch rules (its section 4.2) look at public data only and
so cost no budget. Rules that need the rest of the recipe are in :func:`check_continual`
(called by the Recipe's validator); rules that need the data are checked when it is loaded
(:mod:`dpclip.train.phases`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from dpclip.recipe.section import LearningRate, Section

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]

SCHEDULES = ("switch", "dpmd", "sample", "only-public", "only-private")
#: Schedules whose private steps also take a public gradient (α_t in (0, 1)).
MIXING = ("dpmd", "sample")


class SwitchRule(Section):
    """When the public phase of the ``switch`` (and ``only-public``) schedule ends. Every rule
    looks at public data only (the public block's held-out split, or a public batch), so
    deciding costs no privacy budget; ``max_public_steps`` caps the phase in any case."""

    rule: Literal["step", "early-stopping", "b-star"] = Field(
        "early-stopping", description="step: switch after at_step public steps; early-stopping: when the public "
        "validation metric has not improved for `patience` evaluations; b-star: when the public estimate of "
        "B*_DP falls below b_star_multiple x training.batch_size (needs dpclip.diagnose)")
    at_step: PositiveInt | None = Field(None, description="rule step: the number of public steps")
    patience: PositiveInt = Field(3, description="rule early-stopping: evaluations without improvement")
    metric: Literal["loss", "accuracy"] = Field(
        "loss", description="rule early-stopping: the public validation metric (accuracy: classification only)")
    every_steps: PositiveInt = Field(20, description="early-stopping / b-star: evaluate the rule every N public steps")
    b_star_multiple: PositiveFloat = Field(
        2.0, description="rule b-star: switch once B*_DP < b_star_multiple x training.batch_size")
    probes: PositiveInt = Field(20, description="rule b-star: Hutchinson probes of each estimate")
    max_public_steps: PositiveInt = Field(
        500, description="cap: the public phase ends here even if the rule never fired (the run says so)")

    @model_validator(mode="after")
    def _rule_fields(self) -> SwitchRule:
        if self.rule == "step":
            if self.at_step is None:
                raise ValueError("rule 'step' needs at_step (the number of public steps), e.g. at_step: 200")
            if self.at_step > self.max_public_steps:
                raise ValueError(f"at_step {self.at_step} is beyond the cap max_public_steps "
                                 f"{self.max_public_steps}: raise max_public_steps or lower at_step")
        elif self.at_step is not None:
            raise ValueError(f"at_step is for rule 'step', not {self.rule!r}: remove it or set rule: step")
        return self


class AtSwitch(Section):
    """What happens to the optimizer and the model when the public phase ends."""

    reset: list[Literal["m", "v", "t"]] = Field(
        default_factory=lambda: ["m"], description="optimizer states set to zero at the switch: m (Adam's first "
        "moment, SGD's momentum), v (Adam's second moment), t (Adam's step count); default [m], the paper's "
        "best in its ablation (appendix B.3)")
    reinit_head: bool = Field(
        False, description="re-initialise the output layer (the last Linear) for the private phase; required "
        "when the public and private data have different numbers of classes")
    linear_probe_epochs: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        0.0, description="DP linear probing before full DP training: this many epochs of private steps that "
        "update only the output layer; they are private steps, charged, and counted when σ is calibrated")

    @model_validator(mode="after")
    def _distinct(self) -> AtSwitch:
        if len(set(self.reset)) != len(self.reset):
            raise ValueError("reset lists a state twice")
        return self


class Continual(Section):
    """Public pre-training then private training, or a mix (docs/continual.md). Only
    steps that touch private data are charged; σ is calibrated for the private steps of
    ``training`` (plus DP linear probing), which never depend on the public phase."""

    schedule: Literal["switch", "dpmd", "sample", "only-public", "only-private"] = Field(
        "switch", description="switch: public steps, then the private steps of training: (the paper's Algorithm "
        "1); dpmd: every private step mixes in a public gradient with weight α_t = 1 - cos(πt/2K); sample: "
        "α = n_pub/(n_pub + n_priv); only-public: the public phase alone (ε = 0); only-private: ignore the "
        "public data")
    public_batch_size: PositiveInt = Field(64, description="rows of each public batch (plain shuffled batches)")
    public_lr: LearningRate | None = Field(
        None, description="learning rate of the public phase; default training.optimizer.lr")
    switch: SwitchRule = Field(default_factory=SwitchRule, description="when the public phase ends")
    at_switch: AtSwitch = Field(default_factory=AtSwitch, description="optimizer reset, head re-init, linear probing")


def check_continual(recipe: Any) -> None:
    """Rules across sections (the Recipe validator calls this): a continual schedule needs
    public data, a carve (data.public_fraction) needs a public block of the same source."""
    public, continual = recipe.public, recipe.continual
    carve = getattr(recipe.data, "public_fraction", None)
    if public is not None and continual is None:
        recipe.continual = continual = Continual()
    if continual is None:
        if carve is not None:
            raise ValueError("data.public_fraction carves public rows, but the recipe has no public: block; "
                             f"add public: {{source: {recipe.data.source}, ...}} (the same source) to declare them "
                             "public, with a continual: section")
        return
    if public is None and continual.schedule != "only-private":
        raise ValueError(f"continual.schedule {continual.schedule!r} needs public data: add a public: block "
                         "(e.g. public: {source: builtin, name: digits} with data.public_fraction: 0.1)")
    if public is not None and getattr(public, "public_fraction", None) is not None:
        raise ValueError("public.public_fraction has no meaning: carve public rows with data.public_fraction")
    if continual.schedule != "switch":
        probe = continual.at_switch.linear_probe_epochs
        if probe or continual.at_switch.reinit_head:
            raise ValueError(f"continual.at_switch applies to the switch schedule, not {continual.schedule!r}")


class Diagnostics(Section):
    """Hessian diagnostics recorded during training (docs/hessian-diagnostics.md)."""

    every_steps: PositiveInt | None = Field(
        None, description="measure tr(H), GᵀHG, tr(HΣ), the decelerator and B*_DP every N steps into "
        "RUN_DIR/diagnostics.jsonl; null: off")
    probes: Annotated[int, Field(ge=2)] = Field(20, description="Hutchinson probes (Rademacher) for tr(H)")
    per_sample: Annotated[int, Field(ge=2)] = Field(
        16, description="examples whose per-sample gradients estimate tr(HΣ) and E‖g_i‖²")
    data: Literal["public", "private"] = Field(
        "public", description="public: measured on the recipe's public data (free); private: on the private "
        "training data, exact and NOT covered by ε (needs private_not_covered: true)")
    private_not_covered: bool = Field(
        False, description="required for data: private: you accept that the diagnostics are exact functions "
        "of the private data outside ε; they are labelled so wherever they appear")

    @model_validator(mode="after")
    def _private_needs_consent(self) -> Diagnostics:
        if self.data == "private" and not self.private_not_covered:
            raise ValueError("data 'private' measures exact quantities of the private data that ε does not "
                             "cover; set diagnostics.private_not_covered: true to accept that (they are then "
                             "labelled 'not covered by ε'), or measure on public data (data: public)")
        return self
