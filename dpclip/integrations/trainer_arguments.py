"""The ``TrainingArguments`` (and training data, ``model_init``) a ``DPTrainer`` refuses before any step, each
with a hint, and those whose use of the data it states outside ε (docs/python-api.md, "Hugging Face Trainer")."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import IterableDataset
from transformers import optimization

from dpclip.errors import DpclipError


def refuse_training_arguments(training: Any) -> None:
    """TrainingArguments DPTrainer would ignore silently, that would break the sensitivity or the plan,
    or that release the realised batch sizes."""
    if training.max_grad_norm and training.max_grad_norm > 0:
        raise DpclipError(f"TrainingArguments(max_grad_norm={training.max_grad_norm:g}) would clip the noisy "
                          "gradient again", "set TrainingArguments(max_grad_norm=0); the clipping threshold is "
                          "PrivacyArguments(per_sample_max_grad_norm=...)")
    if training.n_gpu > 1:
        raise DpclipError(f"DPTrainer trains on one device per process, and this process drives {training.n_gpu} "
                          "GPUs (DataParallel)", "launch one process per GPU: torchrun --nproc-per-node N "
                          "your_script.py (or accelerate launch)")
    if training.label_smoothing_factor:
        raise DpclipError(f"TrainingArguments(label_smoothing_factor={training.label_smoothing_factor:g}) is not "
                          "applied: DPTrainer computes each example's loss with per_sample_loss",
                          "set label_smoothing_factor=0 and smooth in per_sample_loss: fn(model, inputs) -> "
                          "F.cross_entropy(logits, labels, reduction='none', label_smoothing=0.1)")
    if training.include_num_input_tokens_seen not in ("no", False, None):
        raise DpclipError("TrainingArguments(include_num_input_tokens_seen) would log the tokens of each Poisson "
                          "batch without noise: its realised size, which ε does not cover",
                          "leave include_num_input_tokens_seen off (the expected batch is B = per-device batch × "
                          "gradient accumulation steps × processes)")
    if training.neftune_noise_alpha:
        raise DpclipError(f"TrainingArguments(neftune_noise_alpha={training.neftune_noise_alpha:g}) scales each "
                          "example's embedding noise by the batch's padded length: one example would move the "
                          "others' clipped gradients, past the sensitivity the noise is calibrated for",
                          "leave neftune_noise_alpha unset (or add noise of a fixed scale inside per_sample_loss)")
    if training.train_sampling_strategy != "random":
        raise DpclipError(f"TrainingArguments(train_sampling_strategy={training.train_sampling_strategy!r}) is not "
                          "applied: DPTrainer's batches are Poisson draws, the sampling the accountant assumes",
                          "leave train_sampling_strategy='random' (padding to one length is the way to even out "
                          "batch shapes)")
    if training.auto_find_batch_size:
        raise DpclipError("TrainingArguments(auto_find_batch_size) would rerun training with a smaller batch after "
                          "an out-of-memory error: the plan's B and q are fixed, and the steps taken stay charged",
                          "set per_device_train_batch_size and gradient_accumulation_steps yourself; B is their "
                          "product (× processes)")



def warn_slow_arguments(training: Any) -> None:
    """``torch_compile=True`` compiles the model's forward alone, which the engine's per-sample hooks and the Poisson
    draws' varying sizes make recompile again and again: many times slower than eager."""
    if training.torch_compile:
        warnings.warn("TrainingArguments(torch_compile=True) compiles the model's forward alone, and the engine's "
                      "per-sample backward and the Poisson batches' changing sizes make it recompile step after "
                      "step: training runs many times slower than without it. Leave torch_compile off and set "
                      "PrivacyArguments(compile=True): the private step as one graph, checked against the engine "
                      "(docs/compiled.md)", UserWarning, stacklevel=3)

def refuse_dataset(dataset: Any) -> None:
    """Poisson sampling draws examples by index: a map-style dataset with a length (an ``IterableDataset``,
    even with a ``__len__``, takes no batch sampler)."""
    if dataset is None or not hasattr(dataset, "__len__") or isinstance(dataset, IterableDataset):
        raise DpclipError("DPTrainer needs a map-style train_dataset with a length (examples drawn by index)",
                          "Poisson sampling draws examples by index: use a map-style dataset (an IterableDataset "
                          "streams examples in its own order; load it into a list or a datasets.Dataset)")


def refuse_model_init(model_init: Any) -> None:
    """``Trainer(model_init=...)``: ``train()`` builds a new model from it, which the engine (built on the model
    of ``__init__``) does not clip, and ``hyperparameter_search()`` (which needs it) trains many runs on the data."""
    if model_init is not None:
        raise DpclipError("DPTrainer(model_init=...) is not supported: train() would build a new model that the "
                          "engine does not clip (and hyperparameter_search, which needs model_init, would train "
                          "several runs on the private data, its choice among them not covered by ε)",
                          "build the model yourself and pass DPTrainer(model=model, ...); to tune, see dpclip "
                          "tune-cost (docs/tuning.md), which charges the search")


def missing_rng_state(folder: str) -> str | None:
    """Why a checkpoint's redone steps may not replay: it holds none of the Trainer's random-number state
    (``rng_state*.pth``; ``save_only_model=True`` saves none), so dropout draws other numbers after the resume."""
    if any(Path(folder).glob("rng_state*.pth")):
        return None
    return (f"{folder} holds no random-number state (TrainingArguments(save_only_model=True) saves none), so "
            "dropout draws other numbers in the redone steps: resume from a checkpoint saved with "
            "save_only_model=False, or with dropout off")


BEST_KEPT = ("the weights the Trainer keeps at the end (load_best_model_at_end): the checkpoint it chose by "
             "metric_for_best_model, compared without noise on evaluate()'s data, private if it is (trainer_state.json "
             "names it, with its best_metric)")


METRIC_SCHEDULED = ("the learning rate after each evaluation (a ReduceLROnPlateau or GreedyLR scheduler: "
                    "lr_scheduler_type, or optimizers=): set from evaluate()'s metric (metric_for_best_model), "
                    "computed without noise on its data, private if it is; the weights of every later step carry it")


MEMORY = ("the Trainer's memory metrics (skip_memory_metrics=False: train_mem_cpu_alloc_delta, train_mem_gpu_peaked_delta "
          "and the others in train()'s metrics, the logs and trainer_state.json): measured on the private steps, they "
          "grow with the drawn batches' sizes")


def metric_scheduled(scheduler: Any) -> bool:
    """Whether the Trainer steps ``scheduler`` with evaluate()'s metric (``_evaluate``): ReduceLROnPlateau,
    and transformers' GreedyLR where it has one."""
    greedy = getattr(optimization, "GreedyLR", None)
    kinds = (ReduceLROnPlateau,) if greedy is None else (ReduceLROnPlateau, greedy)
    return isinstance(scheduler, kinds)


def stated_arguments(training: Any, scheduler: Any = None) -> tuple[str, ...]:
    """The not-covered lines of TrainingArguments that release more than the noisy steps: with
    ``load_best_model_at_end`` the weights saved are not the last step's but the checkpoint an exact
    metric chose, a choice ε does not cover (stated from the start: the choice is the Trainer's, at the end);
    with a learning rate set from that metric (``scheduler``: the one passed in ``optimizers=``), every
    step after an evaluation; with ``skip_memory_metrics=False``, the memory the private steps took."""
    kind = getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type)
    metric_lr = kind in ("reduce_lr_on_plateau", "greedy") or metric_scheduled(scheduler)
    lines = [BEST_KEPT] if training.load_best_model_at_end else []
    if metric_lr:
        lines.append(METRIC_SCHEDULED)
    if not training.skip_memory_metrics:
        lines.append(MEMORY)
    return tuple(lines)
