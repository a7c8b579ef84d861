"""Recipe schema v1: every field a recipe may hold, with its default and its rule.

A recipe is pure data. Unknown keys are errors (``extra="forbid"``); variants are
discriminated unions on ``kind`` (model, optimizer, schedule, threshold policy) or
``source`` (data). Cross-field rules that need only the recipe live here as validators;
rules that need the data set size or the calibrated noise live where those are known
(``dpclip.planning.plan``).

The threshold policies' specs and their rules live in their own files
(dpclip/engine/policies/); ``clipping.threshold`` is the union of what is registered there,
rebuilt whenever a policy is (un)registered.

``Recipe.model_dump()`` of ``clipping`` is exactly the dict ``DPEngine(clipping=...)`` takes.

Length: a little over 400 lines (clipping.grouping's checks live in recipe/grouping.py), because the schema is one page: every section of a recipe
is read (and docs/recipes.md generated) from here; only the sections of one feature live beside it (``continual:``
and ``diagnostics:`` in recipe/continual.py, ``tuning:`` in recipe/tuning.py, ``data.labels`` in recipe/labels.py).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, GetCoreSchemaHandler, NonNegativeInt, field_validator, model_validator

from dpclip.engine.policies import on_registry_change, policy_spec, policy_specs
from dpclip.engine.policies.base import PositiveFloat, PositiveInt, UnitOpen
from dpclip.engine.spec import CLIPPING_DEFAULTS, ClippingSpec
from dpclip.recipe.audit import Audit, Canaries, Exposure, check_audit  # noqa: F401 (docs)
from dpclip.recipe.mechanism import BandedMF, Blt, DpSgd, MechanismConfig  # noqa: F401 (docs)
from dpclip.recipe.continual import AtSwitch, Continual, Diagnostics, SwitchRule, check_continual  # noqa: F401 (docs)
from dpclip.recipe.grouping import GROUPING_HELP, check_parallel, validate_grouping
from dpclip.recipe.labels import DataLabels
from dpclip.recipe.section import LearningRate, Section, Size, threshold_without_booleans
from dpclip.recipe.tuning import RandomRange, Tuning, check_tuning  # noqa: F401 (docs)
from dpclip.recipe.users import DataUsers, check_users


# --------------------------------------------------------------------------- data

class BuiltinData(DataUsers):
    """Data shipped with dpclip: no download, ever."""

    source: Literal["builtin"]
    name: Literal["digits", "synthetic-text", "synthetic-cuisine", "synthetic-users"] = Field(
        description="digits: scikit-learn's 1,797 8x8 handwritten digits; "
        "synthetic-text: seeded short structured sentences for causal-LM recipes; "
        "synthetic-cuisine: such sentences labelled with their cuisine (7 classes); "
        "synthetic-users: such sentences written by num_users people, each with a style of their own and "
        "a varying number of records (for privacy.unit: user)")
    test_fraction: UnitOpen = Field(0.2, description="held-out share, split with a key from OS entropy kept in meta.json (secret)")
    as_images: bool = Field(False, description="digits as 1x8x8 images (for cnn) instead of 64-vectors")
    num_examples: Size = Field(2000, description="synthetic-text/-cuisine/-users: sentences to generate")
    num_users: Size = Field(200, description="synthetic-users: people writing them")
    tokenizer: str = Field("byte", description="'byte' (builtin, no download) or a local HF tokenizer path "
                           "(relative: to the recipe file's directory)")
    max_length: Size = Field(64, description="text only: tokens per example after truncation/padding")
    public_fraction: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        None, description="carve this share of the rows out as PUBLIC data before the train/test split "
        "(seeded, disjoint from every private row); needs a public: block naming the same source "
        "(docs/continual.md, \"Public data\")")


class HFData(DataUsers, DataLabels):
    """A Hugging Face ``datasets`` data set: a hub name (needs network or a local cache) or a
    local folder of data files (csv, json, parquet; e.g. a downloaded hub repository),
    both read with ``datasets.load_dataset``. A folder written by ``save_to_disk`` is not
    read: export it with ``to_csv`` / ``to_parquet`` first."""

    source: Literal["hf"]
    name: str
    config: str | None = None
    split: str = "train"
    test_split: str | None = Field(None, description="use this split as the test set instead of test_fraction")
    test_fraction: UnitOpen = 0.2
    text_field: str | None = None
    label_field: str | None = None
    tokenizer: str = "byte"
    max_length: Size = 64
    public_fraction: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        None, description="carve this share of the rows out as PUBLIC data before the train/test split "
        "(seeded, disjoint from every private row); needs a public: block naming the same source "
        "(docs/continual.md, \"Public data\")")


class FilesData(DataUsers, DataLabels):
    """Local files: tables read into pandas (csv by pandas, json/jsonl by Python's json
    module, parquet by pyarrow) or text (one example per line); ``datasets`` is not used.
    Relative paths are relative to the recipe file's directory."""

    source: Literal["files"]
    format: Literal["csv", "json", "jsonl", "parquet", "text"]
    train: str = Field(description="path to the training file (relative: to the recipe file's directory)")
    test: str | None = Field(None, description="optional test file; otherwise test_fraction of train")
    test_fraction: UnitOpen = 0.2
    label_field: str | None = None
    text_field: str | None = None
    feature_fields: list[str] | None = Field(None, description="the inputs, in order; default: the columns but the label, as the file orders them")
    tokenizer: str = "byte"
    max_length: Size = 64
    public_fraction: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        None, description="carve this share of the rows out as PUBLIC data before the train/test split "
        "(seeded, disjoint from every private row); needs a public: block naming the same source "
        "(docs/continual.md, \"Public data\")")


DataConfig = Annotated[Union[BuiltinData, HFData, FilesData], Field(discriminator="source")]


# -------------------------------------------------------------------------- model

class MLPModel(Section):
    kind: Literal["mlp"]
    hidden: list[Size] = Field(default_factory=lambda: [128, 64])
    activation: Literal["relu", "tanh", "gelu"] = "relu"


class CNNModel(Section):
    """Small convolutional net with GroupNorm (BatchNorm mixes samples and is not DP-safe)."""

    kind: Literal["cnn"]
    channels: list[Size] = Field(default_factory=lambda: [16, 32])
    kernel_size: Size = 3
    norm_groups: Size = Field(4, description="GroupNorm groups per conv layer")
    pool_size: Size = Field(1, description="average-pool the last conv output to pool_size x pool_size "
                                   "positions before the dense layers (1: global average, which keeps no "
                                   "position; 2 or more keep where strokes are)")
    hidden: Size = 64


class LoRA(Section):
    """LoRA adapters through peft (docs/export.md, "LoRA"): only they are trained; the base is frozen."""

    r: Size = Field(8, description="rank of each adapter")
    alpha: PositiveFloat = Field(16.0, description="scaling numerator: the update is (alpha / r) B A x")
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: list[str] | None = Field(None, description="module names to adapt, e.g. [c_attn, c_proj] "
                                             "(GPT-2); default: peft's defaults for the model type")
    train_head: bool = Field(True, description="sequence-classification: also train the classifier head")


class HFModel(Section):
    """A transformers model: a config dict with random init, or a local pretrained path."""

    kind: Literal["hf"]
    task: Literal["causal-lm", "sequence-classification"]
    config: dict[str, Any] | None = Field(None, description="transformers config kwargs incl. model_type")
    pretrained: str | None = Field(None, description="local directory with a pretrained model (relative: to "
                                   "the recipe file's directory)")
    lora: LoRA | None = Field(None, description="add LoRA adapters (peft) and train only them")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward: less memory")

    @model_validator(mode="after")
    def _one_source(self) -> HFModel:
        if (self.config is None) == (self.pretrained is None):
            raise ValueError("give exactly one of 'config' (random init) or 'pretrained' (local path)")
        return self


class CustomModel(Section):
    """Your own model factory. Its module is looked for in ``module_dir`` first (the recipe
    file's directory unless given), then on the usual Python path."""

    kind: Literal["custom"]
    target: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                        description="'package.module:factory' returning an nn.Module")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    loss: str = Field("cross-entropy",
                      description="'cross-entropy', 'mse', or 'package.module:fn' giving per-sample losses")
    module_dir: str | None = Field(
        None, description="directory searched first for the modules of target and loss (only while they are "
        "imported); a recipe file sets it to its own directory, so 'mymodel:build' finds mymodel.py beside it")


ModelConfig = Annotated[Union[MLPModel, CNNModel, HFModel, CustomModel], Field(discriminator="kind")]


# ---------------------------------------------------------------------- training

class SGD(Section):
    kind: Literal["sgd"]
    lr: LearningRate
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    nesterov: bool = False
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class Adam(Section):
    kind: Literal["adam"]
    lr: LearningRate
    betas: tuple[UnitOpen, UnitOpen] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class AdamW(Section):
    kind: Literal["adamw"]
    lr: LearningRate
    betas: tuple[UnitOpen, UnitOpen] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: Annotated[float, Field(ge=0)] = 0.01


OptimizerConfig = Annotated[Union[SGD, Adam, AdamW], Field(discriminator="kind")]


class Schedule(Section):
    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    final_lr_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="linear/cosine: lr at the last step as a fraction of lr")


class Training(Section):
    epochs: PositiveFloat | None = Field(None, description="steps = ceil(epochs / q), q = batch_size / N")
    steps: PositiveInt | None = Field(None, description="alternative to epochs")
    batch_size: PositiveInt = Field(description="expected logical batch; Poisson rate q = batch_size / N")
    micro_batch_size: PositiveInt | None = Field(None, description="physical chunk; default batch_size")
    fixed_shapes: bool = Field(False, description="pad every micro-batch to micro_batch_size rows (loss weight 0, "
                               "adding nothing): one batch shape whatever the Poisson draw, for compiled steps "
                               "(docs/training.md, \"Fixed shapes\")")
    compile: bool = Field(False, description="each micro-batch's forward, book-kept backward and clip as one "
                          "torch.compile graph, checked against the engine's eager micro-batch; implies "
                          "fixed_shapes (docs/compiled.md)")
    sampling: Literal["poisson", "shuffle"] = Field(
        "poisson", description="shuffle = fixed-size batches; its ε carries an 'assumes Poisson' caveat")
    parallel: Literal["data", "pipeline", "fsdp"] = Field(
        "data", description="across --nproc N processes: data (each holds the model), pipeline (one stage of "
                            "clipping.grouping.stages each, per-device clipping) or fsdp (each holds 1/N of every "
                            "parameter, gradient and optimizer state: FSDP2; docs/distributed.md)")
    optimizer: OptimizerConfig
    schedule: Schedule = Field(default_factory=Schedule)
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="the forward and the loss under autocast: bf16 (CPU and CUDA) or fp16 (CUDA only, "
        "static loss scale); weights, optimizer, per-sample norms, clipped sums and noise stay float32; "
        "ε does not change (docs/engine.md, \"Mixed precision\")")
    device: str = Field(
        "cpu", description="where the run trains: cpu, cuda (the current GPU), cuda:N, or auto (cuda where torch "
        "sees one and one process trains, else cpu); a resumed run keeps its device (docs/training.md, \"Device\")")

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> str:
        if not isinstance(value, str) or not re.fullmatch(r"cpu|auto|cuda(:\d+)?", value):
            raise ValueError(f"{value!r} is not a device: use cpu, cuda, cuda:N (e.g. cuda:1) or auto")
        return value

    @model_validator(mode="after")
    def _epochs_or_steps(self) -> Training:
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("give exactly one of 'epochs' or 'steps'")
        return self

    @model_validator(mode="after")
    def _compile_limits(self) -> Training:   # one float32 graph per process (docs/compiled.md)
        if self.compile and self.parallel != "data":
            raise ValueError(f"training.compile compiles one process's whole model; training.parallel "
                             f"{self.parallel!r} splits it; set training.compile: false")
        if self.compile and self.precision != "fp32":
            raise ValueError(f"training.compile runs in float32; set training.precision: fp32 (or "
                             f"training.compile: false to train in {self.precision})")
        return self


# ----------------------------------------------------------------------- privacy

class Privacy(Section):
    unit: Literal["example", "user"] = Field(
        "example", description="what ε protects: one record (example) or all records of one person (user: "
        "data.user_field and data.max_examples_per_user; docs/users.md)")
    mechanism: MechanismConfig = Field(
        default_factory=DpSgd, description="dp-sgd (independent noise), {kind: banded-mf, bands: b} or {kind: blt, "
        "buffers: k}: noise correlated across steps, with cyclic sampling (docs/methods.md, 'Correlated noise')")
    epsilon: PositiveFloat | None = Field(
        None, description="target ε; σ is calibrated to it, and training never exceeds it")
    delta: Annotated[float, Field(gt=0, lt=1)] = Field(description="must be below 1/N")
    accountant: Literal["pld", "rdp"] = "pld"
    noise_multiplier: PositiveFloat | None = Field(
        None, description="total σ given explicitly instead of calibrated from epsilon")
    unsafe_seeded_randomness: bool = Field(
        False, description="UNSAFE, for tests and experiments: derive the gradient and statistic noise and the "
        "Poisson batches from 'seed', so a run can be repeated exactly. Anyone who holds the recipe can then "
        "regenerate and subtract the noise and knows every batch: ε does not hold against them. "
        "Default: OS entropy, independent of 'seed'")
    verify_every: NonNegativeInt = Field(
        0, description="the certificate checks the engine's per-sample clipping against each checked sample's "
        "own gradient at the first step, on each new shape of the batch and after each resume; N > 0 also "
        "every N steps (docs/certificate.md)")
    exact_diagnostics: bool = Field(
        True, description="show and write training loss, clip fraction, norm median, realised batch size and "
        "held-out metrics; they are computed WITHOUT noise from private data and are not covered by ε. "
        "false keeps them out of the console, metrics.jsonl and summary.json (for runs whose logs are shared)")

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "secure" in data:
            raise ValueError("'secure' was removed after dpclip 0.1.0: noise and batches now always come from OS "
                             "entropy, independent of 'seed'. Remove the field (unsafe_seeded_randomness: true "
                             "restores the old seeded behaviour, without the guarantee)")
        return data

    @model_validator(mode="after")
    def _epsilon_or_sigma(self) -> Privacy:
        if self.epsilon is None and self.noise_multiplier is None:
            raise ValueError("give 'epsilon' (σ is calibrated) or 'noise_multiplier' (or both: ε is then a cap)")
        return self


# ---------------------------------------------------------------------- clipping

def threshold_union() -> Any:
    """``clipping.threshold``: one of the registered policies' specs, chosen by ``kind``."""
    specs = tuple(policy_specs())
    return Annotated[Union[specs], Field(discriminator="kind")] if len(specs) > 1 else specs[0]


class ThresholdConfig:
    """The type of ``clipping.threshold``: :func:`threshold_union` of the registry as it is when
    the schema is built, so that a registered policy joins at the next ``model_rebuild``."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return handler.generate_schema(threshold_union())


def annotation_now(annotation: Any) -> Any:
    """``annotation`` with :class:`ThresholdConfig` replaced by the union it stands for now (for
    the docs generator and the error messages, which read the field annotations)."""
    return threshold_union() if annotation is ThresholdConfig else annotation


def _default_threshold() -> Any:
    kind = CLIPPING_DEFAULTS["threshold"]["kind"]
    return policy_spec(kind)(kind=kind)


class Clipping(Section):
    # The defaults come from the engine's one table (dpclip.engine.spec.CLIPPING_DEFAULTS).
    grouping: Any = Field(CLIPPING_DEFAULTS["grouping"], description=GROUPING_HELP)
    fn: Literal["abadi", "auto"] = Field(CLIPPING_DEFAULTS["fn"],
                                         description="abadi: min(1, C/||g||); auto: C/(||g|| + gamma)")
    gamma: PositiveFloat = Field(CLIPPING_DEFAULTS["gamma"], description="auto clipping stability constant")
    noise_allocation: Literal["global", "equal-budget", "weighted"] = CLIPPING_DEFAULTS["noise_allocation"]
    threshold: ThresholdConfig = Field(default_factory=_default_threshold)
    strict: bool = Field(CLIPPING_DEFAULTS["strict"], description="refuse the torch.func fallback for unsupported layers")
    norm_method: Literal["auto", "ghost", "instantiate"] = Field(
        CLIPPING_DEFAULTS["norm_method"], description="per-sample norms of Linear-like layers; auto = ghost when 2T^2 < p*d")

    _check_grouping = field_validator("grouping", mode="before")(validate_grouping)
    _no_boolean_threshold = field_validator("threshold", mode="before")(threshold_without_booleans)

    @model_validator(mode="after")
    def _policy_composes(self) -> Clipping:
        """The policy's own rules across grouping, clip function and allocation (its ``check_clipping``).

        Every other combination composes: histograms, quantile counts and the tail split are
        per group and work with any grouping; dcsgd-p and discriminative set thresholds that
        AUTO uses as its scale C/(||g|| + gamma).
        """
        self.threshold.check_clipping(self)
        return self

    def engine_spec(self, sigma_aux: float | None) -> ClippingSpec:
        """What the engine is given: these settings, with the statistic's noise std
        ``sigma_aux`` (from the budget split) filled in by the threshold's spec."""
        settings = {name: getattr(self, name) for name in CLIPPING_DEFAULTS}
        return ClippingSpec(**{**settings, "threshold": self.threshold.for_engine(sigma_aux)})


# --------------------------------------------------------------- the rest

class Eval(Section):
    every_steps: PositiveInt | None = Field(None, description="evaluate every N steps (and always at the end)")
    batch_size: PositiveInt = 256


class Checkpoint(Section):
    """When a run saves what ``dpclip train --resume`` continues from (always at step 0, at
    the end, and on Ctrl-C or SIGTERM): every N steps, every M minutes, or both."""

    every_steps: PositiveInt | None = Field(None, description="checkpoint every N steps (and at the end)")
    every_minutes: PositiveFloat | None = Field(
        10.0, description="also checkpoint at the first step boundary M minutes after the last checkpoint, so a "
        "killed run loses at most about M minutes; null: only every_steps")
    keep: PositiveInt = Field(2, description="checkpoints kept on disk")


class Logging(Section):
    tensorboard: bool = Field(False, description="also write metrics as TensorBoard event files in RUN_DIR/tensorboard/ "
                              "(diagnostics tagged not_covered_by_epsilon/); needs pip install 'dpclip[tensorboard]'")


class Recipe(Section):
    """A dpclip recipe. See docs/recipes.md."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200,
                      description="run name, at most 200 characters; used in the run directory's name")
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = Field(
        0, description="seeds what is not private: the model init, dropout, synthetic data. Noise, batches, the "
        "train/test split (who is a member) and the audit's canaries and planted secrets come from OS entropy "
        "(see privacy.unsafe_seeded_randomness)")
    output_dir: str = Field("runs", description="where run directories are created")
    data: DataConfig = Field(description="where the private training data comes from")
    model: ModelConfig = Field(description="what is trained; input and output sizes are inferred from the data")
    training: Training = Field(description="steps, batches, sampling, optimizer, schedule")
    privacy: Privacy = Field(description="the (ε, δ) guarantee and how noise is set")
    clipping: Clipping = Field(default_factory=Clipping, description="grouping, clip function, noise allocation, threshold policy")
    eval: Eval = Field(default_factory=Eval, description="evaluation on the held-out split")
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="checkpoint frequency and retention")
    logging: Logging = Field(default_factory=Logging, description="where metrics go besides metrics.jsonl")
    audit: Audit = Field(default_factory=Audit, description="membership-inference audit settings")
    tuning: Tuning = Field(default_factory=Tuning, description="hyperparameter search space for tune-cost")
    diagnostics: Diagnostics = Field(default_factory=Diagnostics,
                                     description="Hessian diagnostics during training (off by default)")
    public: DataConfig | None = Field(
        None, description="PUBLIC data (your claim: not covered by ε): any data: variant (source builtin, files, "
        "hf); never sampled by the private sampler, never charged; its held-out split is the public validation "
        "set of the switch rules; used by the continual: schedule (docs/continual.md)")
    continual: Continual | None = Field(
        None, description="public pre-training then private training, or a public/private mix (docs/continual.md); "
        "default with a public: block: the switch schedule")

    @model_validator(mode="after")
    def _cross_section(self) -> Recipe:
        self.clipping.threshold.check_recipe(self)
        if (self.training.fixed_shapes or self.training.compile) and self.clipping.threshold.ranks_whole_batch():
            raise ValueError("training.fixed_shapes (or compile) pads micro-batches to one size, but this clipping.threshold "
                             "ranks the whole logical batch in one backward, whose size is the Poisson draw's; "
                             "set training.fixed_shapes: false (and training.compile: false)")
        if self.diagnostics.every_steps and self.diagnostics.data == "public" and getattr(self, "public", None) is None:
            raise ValueError("diagnostics.data 'public' needs public data and the recipe has no 'public:' block; "
                             "add one, or measure on the private data (diagnostics.data: private with "
                             "diagnostics.private_not_covered: true; not covered by ε)")
        if self.model.kind == "cnn" and self.data.source == "builtin" and self.data.name == "digits" \
                and not self.data.as_images:
            raise ValueError("model.kind 'cnn' needs images: set data.as_images: true")
        for check in (check_continual, check_users, check_audit, check_parallel, check_tuning):
            check(self)
        return self


def _rebuild_threshold_union() -> None:
    """Rebuild the models that contain ``clipping.threshold`` after the registry changed."""
    Clipping.model_rebuild(force=True)
    Recipe.model_rebuild(force=True)


on_registry_change(_rebuild_threshold_union)
