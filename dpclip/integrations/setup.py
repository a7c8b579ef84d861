"""What ``make_private`` and ``DPTrainer`` share: the clipping block, the plan, the engine and
the account of what was charged (docs/python-api.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from numbers import Integral
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn
from torch.utils.data import IterableDataset

from dpclip import layout
from dpclip.accounting import Ledger, PlanResult, PrivacyPlan, solve
from dpclip.accounting.statement import OWN_BATCHES_CAVEAT, PrivacyStatement
from dpclip.distributed import World
from dpclip.distributed.code import CODE_HINT, code_fingerprint
from dpclip.engine import DPEngine
from dpclip.engine.groups import build_groups, trainable_params
from dpclip.errors import DpclipError
from dpclip.files import made_private, write_json_atomic
from dpclip.integrations.rows_fingerprint import rows_fingerprint
from dpclip.planning.plan import forward_state_line
from dpclip.recipe.load import explain_error
from dpclip.recipe.schema import Clipping

PRIVACY_FORMAT = "dpclip-python-api-1"


@contextlib.contextmanager
def quiet_rdp_orders() -> Iterator[None]:
    """dp_accounting logs (through absl) each RDP order its series skips, which only loosens
    the RDP ε shown alongside; ``dpclip`` silences it the same way (dpclip/cli/main.py)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


#: the statement's line for a ledger that continues no checkpoint
NOTHING_SPENT = ("no step taken yet: ε spent so far is 0; the lines below are the plan's, its guarantee after all "
                 "{steps} planned steps")
FRESH_LEDGER = ("ledger: the steps taken since make_private (or the Trainer) started; a run continued without "
                "restoring its checkpoint (load_checkpoint, resume_from_checkpoint) starts ε again at 0 and "
                "understates what the model has spent")


#: the statement's line once the loop has read a private loss's value (make_private)
READ_LOSS = ("training loss values the loop read (loss.item(), float(loss), printing or comparing it, loss.per_sample, "
             "train_step's return): each drawn batch's mean loss (per_sample: each sample's), computed without noise")
#: make_private's loop sees the model's outputs on each drawn batch: what it computes from them, unseen
#: by dpclip, is stated as a fixed line (Opacus's examples log the training accuracy exactly so)
LOOP_OUTPUTS = ("anything else your loop computes from the drawn batches or the model's outputs on them and keeps "
                "or shows (training accuracy, printed predictions): computed without noise, unseen by dpclip")


@dataclass
class Account:
    """The ledger of the steps charged so far and the plan they were charged under."""

    ledger: Ledger
    plan: PlanResult
    writes: bool = True   # False on the ranks other than 0 of a data-parallel run: rank 0 writes
    world_size: int = 1   # processes training together (the statement's distribution line)
    restored: bool = False   # the ledger continues a checkpoint's (load_checkpoint)
    #: the steps a loaded checkpoint's run had released (its log's): ε counts them until they are redone
    released_steps: int = 0
    own_batches: bool = False   # the caller's loader draws the batches (make_private(poisson_sampling=False))
    #: the persistent buffers the model's forward was seen writing (the engine's forward_written_state)
    written_state: Callable[[], set[str]] = set
    #: whether the loop read a private loss's value (make_private's DrawTracker.losses_read)
    losses_read: Callable[[], bool] = bool
    #: what else has left without noise so far (DPTrainer: evaluate() and predict() metrics)
    released_outside: Callable[[], list[str]] = list
    #: lines stated for as long as the caller's own loop runs (make_private: :data:`LOOP_OUTPUTS`)
    loop_lines: tuple[str, ...] = ()
    #: each privacy.json written: its statement without labels, whether restored, whether before any step, what was written
    written: dict[Path, tuple[PrivacyStatement, bool, bool, dict[str, Any]]] = field(default_factory=dict)

    def not_covered(self) -> list[str]:
        """What the statement lists outside ε: the plan's, and the saved buffers the training
        forwards have written so far (docs/certificate.md), and the loss values the loop read."""
        read = [READ_LOSS] if self.losses_read() else []
        lines = (list(self.plan.plan.not_covered) + read + list(self.loop_lines)
                 + list(forward_state_line(self.written_state())) + list(self.released_outside()))
        return replace(self.plan.statement, not_covered=lines).not_covered   # with the statement's own (N's)

    @property
    def step_metadata(self) -> dict[str, Any]:
        """What each charged step's ledger entry holds: the plan's (your loader's batches: their caveat)."""
        metadata = self.plan.step_metadata
        return {**metadata, "caveats": [OWN_BATCHES_CAVEAT]} if self.own_batches else metadata

    @property
    def noise_multiplier(self) -> float:
        """σ_eff, the total noise multiplier the accountant sees (``dpclip account --sigma``)."""
        return self.plan.split.noise_multiplier

    def charged(self) -> Ledger:
        """The ledger, with the steps a loaded checkpoint's run released after it and this run has
        not redone yet (they left the crashed process: their redoing catches the ledger up)."""
        behind = self.released_steps - self.ledger.steps
        if behind <= 0:
            return self.ledger
        ledger = Ledger.from_dict(self.ledger.to_dict(with_epsilon=False))
        ledger.record(self.plan.step_event, count=behind, metadata=self.step_metadata)
        return ledger

    def epsilon(self, delta: float | None = None) -> float:
        """ε of the steps released so far, at the plan's δ or at ``delta`` (0 before the first step)."""
        ledger = self.charged()
        if not ledger.steps:
            return 0.0
        with quiet_rdp_orders():
            return ledger.epsilon() if delta is None else ledger.epsilon_at(delta)

    def _taken(self) -> PrivacyStatement:
        """The statement of the steps taken so far (the plan's before the first), without its labels."""
        steps = self.charged().steps
        if not steps:
            return replace(self.plan.statement, world_size=self.world_size, own_batches=self.own_batches)
        taken = replace(self.plan.plan, steps=steps, target_epsilon=None,
                        noise_multiplier=self.plan.split.noise_multiplier)
        with quiet_rdp_orders():
            return replace(solve(taken).statement, world_size=self.world_size, own_batches=self.own_batches)

    @staticmethod
    def _lines(taken: PrivacyStatement, not_covered: list[str], restored: bool, planned: bool = False) -> list[str]:
        """``planned``: no step taken, ``taken`` is the plan's statement; a first line says so."""
        lines = replace(taken, not_covered=not_covered).lines()
        lines = [NOTHING_SPENT.format(steps=taken.steps)] + lines if planned else lines
        return lines + [FRESH_LEDGER] if not restored else lines

    def statement(self) -> list[str]:
        """The privacy statement of the steps taken so far (the plan's before the first)."""
        return self._lines(self._taken(), self.not_covered(), self.restored, not self.charged().steps)

    def restate(self) -> None:
        """Add what has left outside ε since (a loss read, an evaluation) to each privacy.json this
        account wrote, as long as it is still the one written there: its ε and steps stay those of
        its save, its labels are the run's (docs/python-api.md, "The example")."""
        now = self.not_covered()
        for path, (taken, restored, planned, written) in list(self.written.items()):
            new = [line for line in now if line not in written["not_covered_by_epsilon"]]
            if not new:
                continue
            try:
                unchanged = json.loads(path.read_text()) == written
            except (OSError, ValueError):
                unchanged = False
            if not unchanged:   # deleted, or replaced since (a later save, another run): not this account's
                del self.written[path]
                continue
            labels = written["not_covered_by_epsilon"] + new
            restated = {**written, "not_covered_by_epsilon": labels,
                        "statement": self._lines(taken, labels, restored, planned)}
            write_json_atomic(path, restated)
            self.written[path] = (taken, restored, planned, restated)

    def save(self, directory: str | Path) -> Path:
        """Write ``ledger.json`` (every charged step) and ``privacy.json`` (ε, δ, statement); on
        rank 0 only, in a data-parallel run."""
        out = Path(directory)
        if not self.writes:
            return out
        made_private(out)
        with quiet_rdp_orders():
            write_json_atomic(out / layout.LEDGER, self.charged().to_dict())
        plan, taken, labels = self.plan.plan, self._taken(), self.not_covered()
        written = {
            "format": PRIVACY_FORMAT,
            "epsilon": self.epsilon(),
            "delta": plan.delta,
            "accountant": plan.accountant,
            "steps": self.charged().steps,
            "steps_planned": plan.steps,
            "sample_rate": plan.sample_rate,
            "sampling": "loader" if self.own_batches else plan.sampling,
            "noise_multiplier": self.plan.split.noise_multiplier,
            "gradient_noise_multiplier": self.plan.split.gradient_noise_multiplier,
            "seeded_randomness": plan.seeded_randomness,
            "not_covered_by_epsilon": labels,
            "statement": self._lines(taken, labels, self.restored, not self.charged().steps),
        }
        write_json_atomic(out / "privacy.json", written)
        self.written[(out / "privacy.json").resolve()] = (taken, self.restored, not self.charged().steps,
                                                          json.loads(json.dumps(written)))
        return out


def private_engine(model: nn.Module, spec: Clipping, *, num_examples: int, batch_size: int, steps: int,
                   delta: float, target_epsilon: float | None, noise_multiplier: float | None, accountant: str,
                   sampling: str, unsafe_seed: int | None, not_covered: tuple[str, ...] = (), verify_every: int = 0,
                   world: World | None = None, records_per_user: int | None = None,
                   dataset: Any = None) -> tuple[DPEngine, Account]:
    """The plan of ``steps`` Poisson steps at q = B/N (noise calibrated to ``target_epsilon`` or
    given as the total ``noise_multiplier``; a threshold statistic shares the budget), the
    engine that takes them, and an empty account. ``records_per_user`` = k: user-level privacy,
    N people, at most k records of a person in a step (docs/users.md). Across ranks, ``dataset``
    (the rows each rank draws by position) must be the same on every rank (:mod:`rows_fingerprint`)."""
    if (target_epsilon is None) == (noise_multiplier is None):
        raise DpclipError("give exactly one of target_epsilon and noise_multiplier",
                          "target_epsilon=8.0 calibrates the noise; noise_multiplier=1.1 gives the ε it costs")
    if not 1 <= batch_size <= num_examples:
        raise DpclipError(f"batch size {batch_size} is not between 1 and the {num_examples} examples",
                          "the Poisson rate q = batch_size / N must be in (0, 1]")
    if unsafe_seed is not None and (isinstance(unsafe_seed, bool) or not isinstance(unsafe_seed, Integral)):
        raise DpclipError(f"unsafe_seed must be a whole number, got {unsafe_seed!r}: it seeds the noise and the "
                          "batches, which voids the guarantee", "leave unsafe_seed out (None) for a private run: OS "
                          "entropy; unsafe_seed=0 seeds a test or an experiment")
    if unsafe_seed is not None:
        warnings.warn("unsafe_seed: the noise and the batches can be regenerated by anyone who knows the seed, "
                      "which voids the guarantee; for tests and experiments only", stacklevel=4)
    if world is not None:   # rank 0 sizes the noise for every rank's examples: they must share the plan
        check_ranks_agree(world, {
            "the dpclip code (version, source hash, torch release)": code_fingerprint(),
            "the number of examples (len(dataset))": num_examples, "the batch size (per rank × ranks)": batch_size,
            "steps": steps, "delta": delta, "target_epsilon": target_epsilon, "noise_multiplier": noise_multiplier,
            "accountant": accountant, "sampling": sampling, "unsafe_seed": unsafe_seed, "verify_every": verify_every,
            "max_records_per_user": records_per_user, "clipping (max_grad_norm, clipping=)": spec.model_dump(),
            "the trainable parameters (names, shapes, dtypes)": [
                (name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters() if p.requires_grad],
            "the training rows in their order (the dataset's rows fingerprint)":
                None if dataset is None else rows_fingerprint(dataset)})
    sample_rate = batch_size / num_examples
    groups = len(build_groups(model, spec.grouping, trainable_params(model)).names)
    with quiet_rdp_orders():
        plan = solve(PrivacyPlan(
            sample_rate=sample_rate, steps=steps, delta=delta, accountant=accountant, sampling=sampling,
            target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
            seeded_randomness=unsafe_seed is not None, not_covered=tuple(not_covered),
            aux=spec.threshold.statistic(groups) if spec.threshold.releases_statistic() else None,
            **({} if records_per_user is None else {"unit": "user", "users": num_examples,
                                                    "max_examples_per_user": records_per_user})))
    engine = DPEngine(model, spec.engine_spec(plan.split.sigma_aux), gradient_noise_multiplier=plan.split.gradient_noise_multiplier,
                      expected_batch_size=batch_size, seed=unsafe_seed, sample_rate=sample_rate,
                      reducer=None if world is None else world.reducer, verify_every=verify_every,
                      records_per_unit=records_per_user or 1)
    return engine, Account(Ledger(delta, accountant), plan, writes=world is None or world.main,
                           world_size=1 if world is None else world.size, own_batches=sampling == "shuffle",
                           written_state=lambda: engine.forward_written_state)


def check_ranks_agree(world: World, values: dict[str, Any]) -> None:
    """Refuse, on every rank and before anything is drawn, ranks whose privacy arguments or model
    differ: rank 0 draws the noise for the sum of every rank's clipped examples, so a rank with a
    larger clip, another rate or another model would be released under rank 0's plan."""
    ranks = world.all_gather(values)
    for what, ours in ranks[0].items():
        other = next((r for r, theirs in enumerate(ranks) if theirs.get(what) != ours), None)
        if other is not None:
            raise DpclipError(f"the ranks disagree on {what}: rank {other} has {ranks[other].get(what)!r}, rank 0 "
                              f"{ours!r}", CODE_HINT if what.startswith("the dpclip code") else "call make_private (or DPTrainer) with the same arguments, data set (the "
                              "same rows in the same order: shuffle with one seed on every rank, or not at all) "
                              "and model on every rank: rank 0's noise covers every rank's examples only then")


def clipping_spec(clipping: Mapping[str, Any] | None, max_grad_norm: float | None,
                  norm_name: str = "max_grad_norm") -> Clipping:
    """The clipping block, validated as a recipe's; ``max_grad_norm`` is a fixed threshold (the
    argument the caller knows it by: ``norm_name``). An error names the argument as written."""
    block = dict(clipping or {})
    if max_grad_norm is not None:
        if "threshold" in block:
            raise DpclipError(f"give {norm_name} or clipping['threshold'], not both",
                              f"{norm_name}=1.0 is clipping={{'threshold': {{'kind': 'fixed', 'value': 1.0}}}}")
        try:
            value = float(max_grad_norm)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(max_grad_norm, bool) or not math.isfinite(value) or value <= 0:
            raise DpclipError(f"{norm_name} must be a finite number > 0, got {max_grad_norm!r}",
                              f"the per-sample clipping threshold C, e.g. {norm_name}=1.0")
        block["threshold"] = {"kind": "fixed", "value": value}
    elif "threshold" not in block:
        raise DpclipError("no clipping threshold", f"pass {norm_name}=1.0, or clipping={{'threshold': {{...}}}}")
    try:
        return Clipping.model_validate(block)
    except ValidationError as exc:   # named as a recipe's clipping: block (no pydantic location text)
        first = exc.errors()[0]
        text = explain_error({**first, "loc": ("clipping", *first["loc"])}, {"clipping": block})
        if max_grad_norm is not None and text.startswith("clipping.threshold.value"):
            text = norm_name + text[len("clipping.threshold.value"):]
        raise DpclipError(text, "the clipping block takes a recipe's clipping: keys (docs/recipes.md)") from None


def check_whole_draws(spec: Clipping, parts: int | None, what: str = "max_physical_batch_size",
                      fix: str = "leave max_physical_batch_size=None") -> Clipping:
    """A threshold policy that ranks the whole logical batch (discriminative clipping's top-fraction
    rule) takes each draw in one backward: refused where ``parts`` (the draw cut into several backwards:
    ``what``, undone by ``fix``) would have it fail at the first large draw, after the steps before it
    were charged (a recipe refuses training.micro_batch_size with it the same way). Returns ``spec``."""
    if parts is not None and spec.threshold.ranks_whole_batch():
        raise DpclipError(f"clipping.threshold {spec.threshold.kind} with tail_rule top_fraction ranks each whole "
                          f"draw in one backward, and {what} cuts a draw into several",
                          f"{fix}, or use tail_rule: threshold (docs/methods.md)")
    return spec


def check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer moves must be one the engine privatises."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in trainable]
    if outside:
        raise DpclipError(f"the optimizer holds {len(outside)} parameter(s) that are not trainable parameters of "
                          "the model", "build the optimizer on model.parameters() after freezing what stays frozen: "
                          "a parameter the engine does not see would be updated without noise")


def sampling_world(poisson_sampling: bool) -> World | None:
    """The processes of a distributed run (None: one), where the sampling can hold across them."""
    world = running_world()
    if world is not None and not poisson_sampling:
        raise DpclipError("poisson_sampling=False across several processes is not supported",
                          "keep poisson_sampling=True: each rank then draws its own examples' part of each batch")
    return world


def check_loop_parts(optimizer, data_loader, epochs, steps, max_physical_batch_size) -> None:
    """Refuse, with the fix, the optimizer, data loader and step options make_private cannot use."""
    if optimizer is None or data_loader is None:
        raise DpclipError("make_private needs the model, the optimizer and the data loader",
                          "make_private(model, optimizer, data_loader, criterion=..., ...)")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise DpclipError("LBFGS evaluates the loss several times per step (a closure): each evaluation would be "
                          "another release of the batch", "use a first-order optimizer (SGD, Adam, AdamW)")
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise DpclipError("make_private needs a dataset with a length and indexable rows",
                          "use a map-style Dataset (e.g. TensorDataset): Poisson sampling draws examples by index")
    if data_loader.batch_size is None:
        raise DpclipError("the data loader has no batch_size (it was built with a batch_sampler)",
                          "build it as DataLoader(dataset, batch_size=B): B is the expected batch size of the "
                          "Poisson draws")
    if (epochs is None) == (steps is None):
        raise DpclipError("give exactly one of epochs and steps", "e.g. epochs=3")
    if max_physical_batch_size is not None and (isinstance(max_physical_batch_size, bool) or not isinstance(
            max_physical_batch_size, int) or max_physical_batch_size < 1):
        raise DpclipError(f"max_physical_batch_size must be a whole number >= 1, got {max_physical_batch_size!r}",
                          "the most rows one backward takes, e.g. 32 (None: whole batches)")


def running_world() -> World | None:
    """The data-parallel ranks this process belongs to, if torch.distributed is initialised
    with more than one (torchrun, ``accelerate launch``, or your own ``init_process_group``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    size = torch.distributed.get_world_size()
    if size == 1:
        return None
    return World(torch.distributed.get_rank(), size, int(os.environ.get("LOCAL_RANK", 0)),
                 int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def unit_key(plan: PrivacyPlan, people: torch.Tensor | None, records_per_user: int | None) -> dict[str, Any]:
    """A checkpoint's privacy unit, beside its q, σ, steps and δ: steps that protected a record are
    not continued by a run that states its ε per person, nor one person's steps by a run whose
    people own other records (docs/users.md). Nothing for an example-level plan (as before it)."""
    if plan.unit != "user":
        return {}
    numbers = torch.as_tensor(people, dtype=torch.int64).cpu().numpy().tobytes()
    return {"unit": "user", "max_records_per_user": records_per_user,
            "people": hashlib.sha256(numbers).hexdigest()}
