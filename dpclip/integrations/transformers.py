"""``DPTrainer``: a Hugging Face ``Trainer`` script made private in a few lines (docs/python-api.md,
"Hugging Face Trainer").

    from dpclip.integrations.transformers import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=TrainingArguments(..., max_grad_norm=0),
                        train_dataset=train, data_collator=collate,
                        privacy=PrivacyArguments(target_epsilon=8.0, delta=1e-5, max_grad_norm=1.0))
    trainer.train()
    trainer.save_model()      # the weights, plus ledger.json and privacy.json beside them

What changes against a plain ``Trainer``:

- the training loader draws each example into each logical batch with probability q = B/N (B = per-device batch ×
  gradient accumulation steps), from OS entropy; each draw is cut into ``gradient_accumulation_steps``
  micro-batches, so that the Trainer's own accumulation sums one logical batch per optimizer step (an empty part
  skips its forward);
- each micro-batch's per-sample losses (cross-entropy for classification, next-token
  cross-entropy for causal LMs, or ``per_sample_loss``) go through the engine's one backward;
- the optimizer step adds the noise, normalises by the expected B and charges the ledger;
- the training loss the Trainer logs (no noise, from the private batches), its timings, and once they run,
  ``evaluate()``'s and ``predict()``'s metrics are stated as not covered by ε (and, from the start, the weights
  ``load_best_model_at_end`` keeps, a learning rate a ReduceLROnPlateau or GreedyLR scheduler sets from them, and
  the memory metrics of ``skip_memory_metrics=False``).

Launched on several processes (``torchrun``, ``accelerate launch``), it trains data-parallel as ``dpclip train
--nproc`` does (docs/distributed.md): B counts every rank's part, each rank draws its own examples' part of each
Poisson batch, the engine sums the clipped gradients over the ranks with the noise drawn once by rank 0, and rank 0
writes. The model is not wrapped in DistributedDataParallel: the engine's backward leaves autograd no gradient to
all-reduce.

Checkpoints (``save_strategy``) hold, besides the Trainer's files, ``ledger.json``, ``privacy.json`` and each rank's
``dpclip_state_rank{r}.pt``: its Poisson sampler and the engine's threshold policy and noise generators (a secret:
docs/accounting.md, "Threat model"). ``train(resume_from_checkpoint=...)`` restores them with the Trainer's state:
the ledger goes on from the checkpoint's steps, the steps redone after it replay the same batches and noise
(checked: integrations/releases.py), later steps draw fresh OS-entropy streams (unless seeded); no data skip. The
folders it and the Trainer make are owner-only (0700).

``total_flos`` counts nothing (it would give the draws' realised sizes away); a ``per_sample_loss`` is checked on
the certificate's steps, compiled or not, to give each checked example alone its loss in the batch
(integrations/loss_alone.py). Refused before any step: ``max_grad_norm > 0`` in the TrainingArguments (it would clip
the noisy gradient again), ``label_smoothing_factor > 0`` (never applied), ``include_num_input_tokens_seen``,
``neftune_noise_alpha`` (its noise scales with the batch's padded length), ``train_sampling_strategy`` other than
random (never applied: the draws are Poisson), ``auto_find_batch_size`` (a retry with another B), ``model_init``
(a model rebuilt outside the engine), ``tail_rule: top_fraction`` with ``gradient_accumulation_steps > 1``
(it ranks each whole draw in one backward), several GPUs in one process (``DataParallel``), a second ``train()``, and a
resume from a checkpoint without dpclip's state, made under another privacy plan, or whose run's release log is not
beside it (its redone steps could not be checked). The TrainingArguments are checked again as ``train()`` starts and
at each part: one set on ``trainer.args`` since (by a callback too) is refused before it acts.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from dpclip import layout
from dpclip.files import made_private, missing_folders, narrow, owner_only
from dpclip.accounting import Ledger
from dpclip.data.sampler import PoissonSampler
from dpclip.data.user_sampler import UserPoissonSampler
from dpclip.distributed import ShardedPoissonSampler
from dpclip.engine.compiled import CompiledMicroBatch
from dpclip.errors import DpclipError
from dpclip.integrations.collate import EmptyDrawCollate
from dpclip.integrations.loss_alone import check_losses_alone, outputs_recorded
from dpclip.integrations.loaders import PoissonParts
from dpclip.integrations.parts import PrivateOptimizer
from dpclip.integrations.privacy_arguments import (PrivacyArguments, datasets_dataset, default_per_sample_loss,
                                                    trainer_people)
from dpclip.integrations.releases import ReleaseLog
from dpclip.integrations.trainer_arguments import (missing_rng_state, refuse_dataset, refuse_model_init,
                                                    refuse_training_arguments, stated_arguments, warn_slow_arguments)
from dpclip.integrations.train_step import check_backend
from dpclip.integrations.trainer_card import EVALUATED, LOGGED_LOSS, TIMED, with_statement
from dpclip.integrations.rows import unit_weights
from dpclip.integrations.trainer_rows import PartRows, part_rows as _rows
from dpclip.integrations.setup import check_whole_draws, clipping_spec, private_engine, running_world, unit_key
from dpclip.torch_compat import import_dynamo

# Before any process group exists (TrainingArguments makes one under torchrun): imported after, torch._dynamo
# holds the group, whose gloo threads outlive destroy_process_group and can SIGABRT a finished run at exit
# (dpclip.distributed.world, _import_what_would_outlive_the_group; seen in CI).
import_dynamo()


def _private_optimizer(optimizer: Any) -> PrivateOptimizer | None:   # inside accelerate's wrapper, or None
    while optimizer is not None and not isinstance(optimizer, PrivateOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD / DP-Adam (see the module doc)."""

    def __init__(self, *args: Any, privacy: PrivacyArguments,
                 per_sample_loss: Callable[[nn.Module, Mapping[str, Tensor]], Tensor] | None = None, **kwargs: Any):
        made = missing_folders(getattr(kwargs.get("args", (*args, None, None)[1]), "output_dir", None) or "trainer_output")
        super().__init__(*args, **kwargs)
        narrow(made)
        training = self.args
        refuse_training_arguments(training)
        warn_slow_arguments(training)
        refuse_model_init(self.model_init)   # train() would build a model the engine does not clip
        self.world = running_world() if training.world_size > 1 else None
        refuse_dataset(self.train_dataset)   # Poisson draws by index: a map-style dataset with a length
        if type(self).compute_loss is not Trainer.compute_loss or self.compute_loss_func is not None:
            raise DpclipError("DPTrainer computes each example's loss with per_sample_loss, so a compute_loss "
                              "override (or compute_loss_func) would never run", "pass DPTrainer(per_sample_loss="
                              "fn), fn(model, inputs) -> one loss per example (reduction='none')")
        self.per_sample_loss = per_sample_loss or default_per_sample_loss
        self.parts = training.gradient_accumulation_steps
        self.people = trainer_people(self.train_dataset, privacy)   # user-level: each example's person, else None
        self.row_weight = None if self.people is None else 1.0 / privacy.max_records_per_user
        self.max_records_per_user = privacy.max_records_per_user
        num_examples = len(self.train_dataset) if self.people is None else int(self.people.max()) + 1
        self.ranks = 1 if self.world is None else self.world.size
        self.expected_batch_size = training.per_device_train_batch_size * self.parts * self.ranks
        self.steps_per_pass = math.ceil(num_examples / self.expected_batch_size)
        steps = training.max_steps if training.max_steps > 0 else \
            math.ceil(training.num_train_epochs * self.steps_per_pass)
        self.stated = stated_arguments(training, self.lr_scheduler)   # optimizers=(opt, scheduler)'s too
        spec = clipping_spec(privacy.clipping, privacy.per_sample_max_grad_norm, "per_sample_max_grad_norm")
        check_whole_draws(spec, self.parts if self.parts > 1 else None, "gradient_accumulation_steps > 1",
                          "set gradient_accumulation_steps=1 (per_device_train_batch_size is then B per process)")
        self.engine, self.account = private_engine(
            self.model, spec, num_examples=num_examples, batch_size=self.expected_batch_size, steps=steps,
            delta=privacy.delta, target_epsilon=privacy.target_epsilon, noise_multiplier=privacy.noise_multiplier,
            accountant=privacy.accountant, sampling="poisson", unsafe_seed=privacy.unsafe_seed,
            not_covered=(LOGGED_LOSS, TIMED, *self.stated), world=self.world, verify_every=privacy.verify_every,
            records_per_user=None if self.people is None else privacy.max_records_per_user,
            dataset=self.train_dataset)
        self.unsafe_seed = privacy.unsafe_seed
        self.evaluated = False   # evaluate() or predict() has run: their metrics are stated outside ε
        self.account.released_outside = self._released_outside
        self.compiled = self._compiled(privacy)
        self.train_sampler = None
        self.parts_fetched = PartRows()   # training_step's inputs: these, in order (trainer_rows.py)
        self.releases = ReleaseLog.new_run(training.output_dir, self.world)   # a resume: its checkpoint's run
        self.loaded_steps = 0   # the ledger's steps train() may start at: 0, or the resumed checkpoint's
        if self.world is not None:  # every rank starts from rank 0's weights; no DDP (module doc)
            self.world.broadcast_([p.data for p in self.model.parameters()])
            prepare_model = self.accelerator.prepare_model

            def prepare_without_ddp(model: nn.Module, device_placement: bool | None = None,
                                    evaluation_mode: bool = False) -> nn.Module:
                # evaluation_mode: accelerate's device placement and mixed precision, without the DDP wrap
                return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

            self.accelerator.prepare_model = prepare_without_ddp

    def _released_outside(self) -> list[str]:
        """What has left outside ε since: evaluate()'s or predict()'s metrics once they ran, and the lines of the
        arguments set since ``__init__`` (on ``trainer.args``, or a scheduler a create_scheduler override made)."""
        later = [line for line in stated_arguments(self.args, self.lr_scheduler) if line not in self.stated]
        return ([EVALUATED] if self.evaluated else []) + later

    def _compiled(self, privacy: PrivacyArguments) -> CompiledMicroBatch | None:
        """PrivacyArguments(compile=True): the parts through one compiled graph (docs/compiled.md)."""
        if not privacy.compile:
            return None
        if self.args.bf16 or self.args.fp16:
            raise DpclipError("PrivacyArguments(compile=True) runs in float32, and the TrainingArguments ask for "
                              "bf16 or fp16", "leave bf16 and fp16 off, or compile=False")
        check_backend(privacy.compile_backend)
        return CompiledMicroBatch(self.engine, self.model, self._checked_losses, backend=privacy.compile_backend)

    def _compiled_losses(self, inputs: dict[str, Any], weights: Tensor | None) -> Tensor:
        """A part through the compiled graph, in pieces of ``per_device_train_batch_size`` rows, the
        last padded with copies of its first row (loss weight 0: they add nothing, docs/training.md,
        "Fixed shapes"): one batch shape, whatever the Poisson draw."""
        rows, size = _rows(inputs), self.args.per_device_train_batch_size
        if any(not isinstance(v, Tensor) or v.dim() == 0 or len(v) != rows for v in inputs.values()):
            raise DpclipError("PrivacyArguments(compile=True) needs every input a tensor with one row per "
                              "example", "collate the batch into tensors only, or compile=False")
        losses = []
        for start in range(0, rows, size):
            piece = {key: value[start:start + size] for key, value in inputs.items()}
            samples = _rows(piece)
            if samples < size:
                piece = {key: torch.cat([value, value[:1].expand(size - samples, *value.shape[1:])])
                         for key, value in piece.items()}
            losses.append(self.compiled(piece, samples, None if weights is None else weights[start:start + size]))
        return torch.cat(losses)

    # ------------------------------------------------------------------ the Trainer's hooks

    def _sampler(self) -> PoissonParts:
        if self.train_sampler is None:  # one sampler for the whole run: its draws continue across passes
            plan, num_examples = self.account.plan.plan, len(self.train_dataset)
            if self.people is not None:   # people sampled, at most k records each (this rank's people)
                draws = UserPoissonSampler(self.people, plan.sample_rate, plan.steps, self.max_records_per_user,
                                           seed=self.unsafe_seed, rank=0 if self.world is None else self.world.rank,
                                           world_size=self.ranks)
            elif self.world is None:
                draws = PoissonSampler(num_examples, plan.sample_rate, plan.steps, seed=self.unsafe_seed)
            else:  # this rank's examples' part of each draw
                draws = ShardedPoissonSampler(num_examples, plan.sample_rate, plan.steps, rank=self.world.rank,
                                              world_size=self.world.size, seed=self.unsafe_seed)
            self.train_sampler = PoissonParts(draws, self.steps_per_pass, self.parts)
        return self.train_sampler

    def get_train_dataloader(self) -> DataLoader:
        # The Trainer's own column handling, as its loader does: the columns the model's forward does
        # not take (a text column beside the token ids) are dropped before batches are collated.
        dataset, collator = self.train_dataset, self.data_collator
        if datasets_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        # The workers' seed from a generator of its own: iter() after a resume's RNG restore moved dropout's.
        return DataLoader(dataset, batch_sampler=self._sampler(), collate_fn=EmptyDrawCollate(dataset, collator),
                          num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
                          generator=torch.Generator().manual_seed(torch.initial_seed()))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        private = _private_optimizer(optimizer)   # a second create_optimizer: accelerate's wrapper around it
        if private is None:
            private = PrivateOptimizer(optimizer, self.engine, self.account)
            private.record_grad_norm = True
            private.parts_per_step = self.parts   # each noisy step after its draw's parts (no callback's)
            private.on_release = self.releases.check
        self.optimizer = private   # accelerate wraps it (again) in train(): once, around the private step
        return private

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # The Trainer measures the gradient before optimizer.step(), where the engine has not yet written
        # it (0 every time): the norm logged is the noisy gradient's the step applied (covered by ε).
        private = _private_optimizer(self.optimizer)
        noisy = None if private is None else private.last_grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm if noisy is None else noisy, *args, **kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        parts, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.parts_fetched.fetch(parts)
        return parts, items

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        # The Trainer sums this into total_flos (every trainer_state.json): counted on the private draws,
        # 6·P·Σ|B_t|·T_t would release the realised batch sizes and lengths without noise. Nothing counted.
        return 0

    def _checked_losses(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
        """``per_sample_loss``, one per row, each checked row's alone its loss in the batch when the
        certificate checks (eager micro-batches only, a compiled run's too: integrations/loss_alone.py)."""
        if torch.compiler.is_compiling():
            return self.per_sample_loss(model, inputs)
        with outputs_recorded(model) as outputs, PartRows.forwards_over(model, inputs):
            losses = self.per_sample_loss(model, inputs)
        if losses.dim() != 1 or len(losses) != _rows(inputs):
            raise DpclipError(f"per_sample_loss returned shape {tuple(losses.shape)}, not one loss per example",
                              "return the loss of each example (reduction='none'), never a batch mean")
        if self.engine.certificate.checking():
            check_losses_alone(model, self.per_sample_loss, inputs, losses, outputs,
                               self.engine.certificate.rows(len(losses)))
        return losses

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        self._check_arguments()   # again: set on trainer.args (a callback's) since, before they act
        _private_optimizer(self.optimizer).count_part(self.parts)   # each part once per step, an empty one too
        model.train()
        inputs = self._prepare_inputs(inputs)
        self.parts_fetched.take(inputs)   # the part the loader drew, as it came (an override's mixup refused)
        if _rows(inputs) == 0:  # an empty part of the Poisson draw: nothing to clip, the step still adds noise
            return torch.zeros((), device=self.args.device)
        if self.compiled is not None:
            weights = None if self.row_weight is None else unit_weights(_rows(inputs), self.row_weight)
            losses = self._compiled_losses(inputs, weights)
            return losses.sum() * self.ranks / self.expected_batch_size
        with self.compute_loss_context_manager():
            losses = self._checked_losses(model, inputs)
        weights = None if self.row_weight is None else unit_weights(losses.shape[0], self.row_weight)
        self.engine.backward(losses, row_weights=weights)   # user-level: every row 1/k (a person weighs ≤ 1)
        # Summed over the parts by the Trainer, averaged over the ranks when it logs: the batch's loss over B.
        return losses.detach().sum() * self.ranks / self.expected_batch_size

    def train(self, resume_from_checkpoint: Any = None, **kwargs: Any):
        self._check_arguments()   # as __init__ did: the arguments may have been set on trainer.args since
        drawn = self.train_sampler is not None and self.train_sampler.draws.step > self.loaded_steps
        if self.account.ledger.steps > self.loaded_steps or drawn:
            raise DpclipError("this DPTrainer has already trained: a second train() would go past its plan, or a "
                              "resume replace a ledger holding this process's steps", "build a new DPTrainer for "
                              "each train(); to continue a run, pass resume_from_checkpoint= to its train()")
        if resume_from_checkpoint:
            if resume_from_checkpoint is True:
                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is None:
                    raise DpclipError(f"no checkpoint in {self.args.output_dir} to resume from",
                                      "train from the start, or pass the checkpoint's folder")
            self._load_private_state(str(resume_from_checkpoint))
            # The sampler continues where it stopped: the Trainer must not draw batches to skip them.
            self.args.ignore_data_skip = True
        result = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        self.account.save(self.args.output_dir)
        self._restate_card()
        return result

    def _check_arguments(self) -> None:
        refuse_training_arguments(self.args)
        if self.args.gradient_accumulation_steps != self.parts:
            raise DpclipError(f"TrainingArguments(gradient_accumulation_steps) is {self.args.gradient_accumulation_steps}"
                              f" now, {self.parts} when this DPTrainer was built: its plan (B) and its loader's parts "
                              "per draw were fixed then", "set gradient_accumulation_steps before building the "
                              "DPTrainer, and leave it as it is")

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        # evaluate() and predict() (during training too): stated before anything is computed, and in a
        # statement already written to the output directory, and in every privacy.json saved before
        self.evaluated = True
        if self.account.ledger.steps and (Path(self.args.output_dir) / "privacy.json").exists():
            self.account.save(self.args.output_dir)
        self.account.restate()
        self._restate_card()
        return super().evaluation_loop(*args, **kwargs)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)   # its training results: exact losses, stated as such
        if self.is_world_process_zero():
            with_statement(Path(self.args.output_dir) / "README.md", self.account.statement())

    def _restate_card(self) -> None:   # a card written before (create_model_card) states the steps and releases since
        if self.is_world_process_zero():
            with_statement(Path(self.args.output_dir) / "README.md", self.account.statement(), restate=True)

    # ------------------------------------------------------------------ checkpoints

    def _plan_key(self) -> dict[str, Any]:
        plan = self.account.plan.plan
        return {"sample_rate": plan.sample_rate, "steps": plan.steps, "delta": plan.delta,
                "accountant": plan.accountant, "noise_multiplier": self.account.noise_multiplier,
                "ranks": self.ranks, **unit_key(plan, self.people, self.max_records_per_user)}

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # Written before the Trainer's own files: a folder the Trainer finished always has them.
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        made_private(folder)
        rank = 0 if self.world is None else self.world.rank
        secret = os.path.join(folder, layout.TRAINER_STATE.format(rank=rank))   # generators' states
        torch.save({"plan": self._plan_key(), "sampler": self._sampler().state_at(self.account.ledger.steps),
                    "engine": self.engine.state_dict(), "steps": self.account.ledger.steps,
                    "run": self.releases.run}, secret)
        owner_only(secret)
        self.account.save(folder)
        super()._save_checkpoint(model, trial)

    def _load_private_state(self, folder: str) -> None:
        rank = 0 if self.world is None else self.world.rank
        path = os.path.join(folder, layout.TRAINER_STATE.format(rank=rank))
        ledger_path = os.path.join(folder, layout.LEDGER)
        if not os.path.isfile(path) or not os.path.isfile(ledger_path):
            raise DpclipError(f"{folder} has no dpclip state ({layout.TRAINER_STATE.format(rank=rank)}, ledger.json): it was "
                              "not written by a DPTrainer, or by one with another number of processes",
                              "resume from a checkpoint this DPTrainer script wrote, with the same number of processes")
        state = torch.load(path, weights_only=True)
        if state["plan"] != self._plan_key():
            now = self._plan_key()
            changed = sorted(k for k in state["plan"].keys() | now.keys() if state["plan"].get(k) != now.get(k))
            raise DpclipError(f"{folder} was trained under another privacy plan (it differs in {', '.join(changed)})",
                              "resume with the arguments the run started with (batch size, steps, ε or σ, δ, "
                              "processes, users_column and max_records_per_user on the same people)")
        ledger = Ledger.from_dict(json.loads(Path(ledger_path).read_text()))
        if ledger.steps != state["steps"]:
            raise DpclipError(f"{folder}: ledger.json holds {ledger.steps} steps and the state {state['steps']}",
                              "the checkpoint was modified or half written: resume from an earlier one")
        self.account.ledger = ledger
        self.account.restored = True
        stated = Path(folder) / "privacy.json"   # an evaluation of the run's earlier processes stays stated
        self.evaluated |= stated.is_file() and EVALUATED in json.loads(stated.read_text())["not_covered_by_epsilon"]
        self.loaded_steps = ledger.steps
        self.releases.resume_after(ledger.steps, Path(folder).parent, state.get("run"), required=ledger.steps > 0)
        self.releases.cause = missing_rng_state(folder)   # said first if a redone step differs
        self.account.released_steps = max(self.releases.redo, default=ledger.steps)   # ε counts them until redone
        self._sampler().draws.load_state_dict(state["sampler"])
        self.engine.load_state_dict(state["engine"])
        self.releases.fork_after_redone(self.engine.noise, self._sampler(), ledger.steps)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if not _internal_call:
            self.account.save(output_dir or self.args.output_dir)
