"""DPTrainer: a Hugging Face Trainer made private (docs/python-api.md, "Hugging Face Trainer")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, TrainerCallback,
                          TrainingArguments)

from dpclip.data.sampler import PoissonSampler
from dpclip.errors import DpclipError
from dpclip.integrations.trainer_arguments import BEST_KEPT
from dpclip.integrations.transformers import LOGGED_LOSS, DPTrainer, PrivacyArguments
from tests.integrations.reference import run_example

REPO = Path(__file__).resolve().parents[2]
N, LENGTH, VOCAB, CLASSES = 40, 8, 30, 3


def _rows(n: int = N, lm: bool = False) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=generator)
    labels = ids.clone() if lm else torch.randint(0, CLASSES, (n,), generator=generator)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.int64), "labels": labels[i]}
            for i in range(n)]


def _collate(rows: list[dict]) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def _bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=LENGTH, num_labels=CLASSES,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=LENGTH,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _args(tmp_path, **kwargs) -> TrainingArguments:
    options = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 5, "max_steps": 3,
               "learning_rate": 0.01, "report_to": [], "save_strategy": "no", "use_cpu": True, "max_grad_norm": 0,
               "disable_tqdm": True, **kwargs}
    return TrainingArguments(**options)


def _trainer(tmp_path, model=None, privacy=None, **kwargs) -> DPTrainer:
    privacy = privacy or PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0)
    return DPTrainer(model=model or _bert(), args=_args(tmp_path, **kwargs), train_dataset=_rows(),
                     data_collator=_collate, privacy=privacy)


def test_training_writes_a_ledger_whose_epsilon_is_dpclip_accounts(tmp_path, cli, capsys):
    trainer = _trainer(tmp_path, gradient_accumulation_steps=2)
    trainer.train()
    capsys.readouterr()   # the Trainer's own log lines
    ledger = json.loads((tmp_path / "out" / "ledger.json").read_text())
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert ledger["steps"] == privacy["steps"] == 3   # optimizer steps, not micro-batches
    q = 10 / N   # B = 5 per device × 2 accumulation steps
    assert privacy["sample_rate"] == q
    result = cli("account", "--sigma", 1.0, "-q", repr(q), "--steps", 3, "--delta", 1e-5, "--json")
    assert ledger["epsilon"] == json.loads(result.out)["epsilon"]
    assert LOGGED_LOSS in privacy["not_covered_by_epsilon"]


@pytest.mark.slow
def test_a_bf16_trainer_leaves_autocast_off_after_training(tmp_path):
    """accelerate wraps the forward in one autocast instance; the engine's first-step probes
    re-enter it, which used to leave autocast on after train() (tests/engine/test_batch_axis.py)."""
    trainer = _trainer(tmp_path, bf16=True)
    trainer.train()
    assert trainer.account.ledger.steps == 3
    assert not torch.is_autocast_enabled("cpu")


def _clipped_reference(model, rows: list[dict], threshold: float, loss_of) -> list[torch.Tensor]:
    """Σ_i min(1, C/‖g_i‖)·g_i over the rows, g_i by autograd on each row alone (float64 norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for row in rows:
        model.zero_grad()
        loss_of(model, _collate([row])).sum().backward()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        for acc, grad in zip(total, grads):
            acc += min(1.0, threshold / norm) * grad
    return total


@pytest.mark.parametrize("lm, compiled", [(False, False), (True, False),
                                          pytest.param(False, True, marks=pytest.mark.slow)],   # a trace: 8 s
                         ids=["bert-classification", "gpt2-causal-lm", "bert-compiled"])
def test_one_step_in_two_accumulated_parts_is_the_clipped_per_example_sum_over_b(tmp_path, monkeypatch, lm,
                                                                                  compiled):
    """Noise removed: the update's gradient is Σ clip(g_i) / B over the Poisson draw, B the
    expected batch (5 × 2), the draw cut in two parts that the Trainer accumulates; the same with
    PrivacyArguments(compile=True), each part then padded to 5 rows for the one graph (traced with
    aot_eager here, which generates no code)."""
    from dpclip.integrations.transformers import default_per_sample_loss

    model = _gpt2() if lm else _bert()
    model.config.attn_implementation = "eager"
    trainer = DPTrainer(model=model, args=_args(tmp_path, max_steps=1, gradient_accumulation_steps=2,
                                                learning_rate=0.0),
                        train_dataset=_rows(lm=lm), data_collator=_collate,
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=0.05,
                                                 unsafe_seed=11, compile=compiled, compile_backend="aot_eager"))
    if compiled:
        graph, calls = trainer.compiled.compiled, []
        trainer.compiled.compiled = lambda *args: calls.append(args[1].shape) or graph(*args)
    monkeypatch.setattr(trainer.engine.noise, "add_gaussians", lambda grads, stds: None)
    privatize, captured = trainer.engine.privatize, {}

    def privatize_and_keep():
        report = privatize()
        captured["grads"] = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        return report
    monkeypatch.setattr(trainer.engine, "privatize", privatize_and_keep)
    trainer.train()
    # the seeded draw, regenerated: the same generator the trainer's sampler used
    first = next(iter(PoissonSampler(N, 10 / N, 1, seed=11)))
    rows = [_rows(lm=lm)[i] for i in first.tolist()]
    assert 0 < len(rows) != 10
    reference_model = _gpt2() if lm else _bert()
    reference_model.config.attn_implementation = "eager"
    reference_model.train()
    expected = _clipped_reference(reference_model, rows, 0.05, default_per_sample_loss)
    for got, want in zip(captured["grads"], expected):
        torch.testing.assert_close(got, want / 10, rtol=1e-4, atol=1e-7)
    if compiled:   # the first part through the engine and the graph (checked), the second through the graph
        assert calls and all(shape == (5,) for shape in calls)


def test_a_peft_lora_model_trains_its_adapters_only(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_bert(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"],
                                                         task_type="SEQ_CLS"))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    trainer = _trainer(tmp_path, model=model)
    trainer.train()
    assert trainer.account.ledger.steps == 3
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


@pytest.mark.parametrize("change, message", [
    ({"max_grad_norm": 1.0}, "would clip the noisy gradient again"),
    ({"privacy": PrivacyArguments(delta=1e-5, noise_multiplier=1.0)}, "no clipping threshold"),
    ({"privacy": PrivacyArguments(delta=1e-5, max_grad_norm=1.0)}, "exactly one of target_epsilon"),
    ({"privacy": PrivacyArguments(delta=1e-5, noise_multiplier=1.0, per_sample_max_grad_norm=-1.0)},
     "per_sample_max_grad_norm must be a finite number > 0, got -1.0"),   # was pydantic's location text
    ({"privacy": PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0, unsafe_seed=False)},
     "unsafe_seed must be a whole number, got False"),   # was: seeded with 0, as if asked for
    ({"privacy": PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0, unsafe_seed="3")},
     "unsafe_seed must be a whole number, got '3'"),
    ({"privacy": PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0, compile=True,
                                  compile_backend="nope")}, "compile_backend must be a torch.compile backend's name"),
])
def test_bad_arguments_are_refused_with_a_hint_before_any_step(tmp_path, change, message):
    change = dict(change)
    privacy = change.pop("privacy", None)
    with pytest.raises(DpclipError, match=re.escape(message)) as info:
        _trainer(tmp_path, privacy=privacy, **change)
    assert info.value.hint


def test_resuming_from_a_folder_without_dpclip_state_is_refused(tmp_path):
    with pytest.raises(DpclipError, match="has no dpclip state") as info:
        _trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path))
    assert info.value.hint


class _CrashAfter(TrainerCallback):
    """Stops the run with an exception after optimizer step ``step`` (its checkpoint saved)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step + 1:  # the checkpoint of `step` is on disk; this step is lost
            raise KeyboardInterrupt


def _seeded(tmp_path, callbacks=(), **kwargs) -> DPTrainer:
    privacy = PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0, unsafe_seed=3)
    trainer = _trainer(tmp_path, privacy=privacy, max_steps=6, save_strategy="steps", save_steps=2,
                       optim="adamw_torch", **kwargs)
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer


@pytest.mark.slow  # an end-to-end run: the slow set (README)
def test_a_trainer_resumed_from_its_checkpoint_ends_as_the_run_that_never_stopped(tmp_path):
    whole = _seeded(tmp_path / "whole")
    whole.train()
    crashed = _seeded(tmp_path / "split", callbacks=[_CrashAfter(4)])
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    resumed = _seeded(tmp_path / "split")
    resumed.train(resume_from_checkpoint=True)
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    ledger = json.loads((tmp_path / "split" / "out" / "ledger.json").read_text())
    assert ledger == json.loads((tmp_path / "whole" / "out" / "ledger.json").read_text())
    assert ledger["steps"] == 6   # the steps redone after checkpoint 4 replay the same draws: charged once
    checkpoint = json.loads((tmp_path / "split" / "out" / "checkpoint-4" / "ledger.json").read_text())
    assert checkpoint["steps"] == 4


def test_a_resume_under_another_privacy_plan_is_refused(tmp_path):
    _seeded(tmp_path).train()
    other = _trainer(tmp_path, privacy=PrivacyArguments(delta=1e-5, noise_multiplier=2.0, max_grad_norm=1.0),
                     max_steps=6, save_strategy="steps", save_steps=2)
    with pytest.raises(DpclipError, match="another privacy plan") as info:
        other.train(resume_from_checkpoint=True)
    assert "noise_multiplier" in info.value.message and info.value.hint


def test_a_resume_under_another_privacy_unit_is_refused(tmp_path):
    """q, σ, steps and δ alike (5 of 40 records, 1 of 8 people): steps that protected a record were
    resumed by a user-level run and stated per person."""
    rows = _rows()
    for i, row in enumerate(rows):
        row["user_id"] = i % 8
    collate = lambda batch: _collate([{k: v for k, v in r.items() if k != "user_id"} for r in batch])  # noqa: E731
    first = DPTrainer(model=_bert(), args=_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
                      train_dataset=rows, data_collator=collate,
                      privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    first.train()
    other = DPTrainer(model=_bert(), args=_args(tmp_path, per_device_train_batch_size=1, max_steps=2,
                                                save_strategy="steps", save_steps=2),
                      train_dataset=rows, data_collator=collate,
                      privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0,
                                               users_column="user_id", max_records_per_user=5))
    with pytest.raises(DpclipError, match="another privacy plan") as info:
        other.train(resume_from_checkpoint=True)
    assert "unit" in info.value.message and info.value.hint


def test_the_docs_show_the_trainer_example_that_runs_as_a_test():
    doc = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    example = (REPO / "examples" / "hf_trainer.py").read_text(encoding="utf-8")
    assert example in re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)


@pytest.mark.slow
def test_the_hf_trainer_example_runs_and_writes_its_ledger(tmp_path, monkeypatch, capsys):
    accuracy, privacy = run_example("hf_trainer.py", tmp_path / "out", monkeypatch, capsys)
    assert accuracy > 0.3   # seven classes: chance is 0.14
    assert privacy["steps"] == privacy["steps_planned"] and 7.5 < privacy["epsilon"] <= 8.0 * 1.01
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_dataset_keeping_its_text_column_trains_as_with_the_trainer(tmp_path):
    """The documented change on a `datasets.Dataset` that keeps its raw text: the Trainer's own
    removal of the columns the model does not take applies (it crashed collating strings)."""
    datasets = pytest.importorskip("datasets")
    from transformers import DataCollatorWithPadding  # noqa: F401  (the default collator pads token ids)

    rows = _rows()
    table = datasets.Dataset.from_dict({"text": [f"sentence {i}" for i in range(N)],
                                        "input_ids": [r["input_ids"].tolist() for r in rows],
                                        "attention_mask": [r["attention_mask"].tolist() for r in rows],
                                        "labels": [int(r["labels"]) for r in rows]})
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path), train_dataset=table,
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, per_sample_max_grad_norm=1.0))
    trainer.train()
    assert trainer.account.ledger.steps == 3


def test_the_logged_grad_norm_is_the_noisy_gradients_not_zero(tmp_path):
    logged = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                logged.append(logs["grad_norm"])
    trainer = _trainer(tmp_path, logging_steps=1)
    trainer.add_callback(Logs())
    trainer.train()
    assert len(logged) == 3 and all(value > 0 for value in logged)


@pytest.mark.slow  # end to end: the slow set (README)
def test_weights_kept_by_load_best_model_at_end_are_stated_outside_epsilon(tmp_path):
    """load_best_model_at_end saves the checkpoint an exact eval metric chose, not the last step's
    weights: that choice is not covered by ε, and the privacy.json beside the weights says so."""
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1,
                                                  save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                                                  metric_for_best_model="eval_loss"),
                        train_dataset=_rows(), eval_dataset=_rows(10), data_collator=_collate,
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    trainer.save_model()
    assert trainer.state.best_model_checkpoint is not None   # the weights kept were chosen by eval_loss
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert BEST_KEPT in privacy["not_covered_by_epsilon"]
    assert f"not covered by ε: {BEST_KEPT}" in privacy["statement"]


def test_privacy_arguments_compose_with_training_arguments_in_one_parser(tmp_path):
    from transformers import HfArgumentParser

    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    training, privacy = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--max_grad_norm", "0", "--delta", "1e-5", "--noise_multiplier", "1.0",
        "--per_sample_max_grad_norm", "0.5"])
    assert training.max_grad_norm == 0 and privacy.per_sample_max_grad_norm == 0.5
    assert PrivacyArguments(delta=1e-5, max_grad_norm=0.5).per_sample_max_grad_norm == 0.5


def test_user_level_privacy_samples_people_and_weighs_each_row_one_over_k(tmp_path, monkeypatch):
    rows = _rows()
    for i, row in enumerate(rows):
        row["user_id"] = i % 8                      # 8 people, 5 records each
    seen = []
    # 4 of 8 people expected: all 3 draws empty (no backward to spy on) with probability 2**-24 (at 2 of 8,
    # 0.75**24 = 1e-3)
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path, per_device_train_batch_size=4), train_dataset=rows,
                        data_collator=lambda batch: _collate([{k: v for k, v in r.items() if k != "user_id"}
                                                              for r in batch]),
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                                 users_column="user_id", max_records_per_user=2))
    real = trainer.engine.backward

    def spy(losses, **kwargs):
        seen.append(kwargs["row_weights"])
        return real(losses, **kwargs)
    monkeypatch.setattr(trainer.engine, "backward", spy)
    trainer.train()
    plan = trainer.account.plan.plan
    assert plan.unit == "user" and plan.users == 8 and plan.sample_rate == 4 / 8
    assert seen and all(bool((w == 0.5).all()) for w in seen)
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert any(line.startswith("privacy unit: user-level (8 people, at most 2 records") for line in privacy["statement"])
    sampler = trainer._sampler().draws
    assert sampler.max_per_user == 2


def test_user_ids_differing_only_in_case_or_spaces_are_refused_naming_both(tmp_path):
    rows = _rows()
    for i, row in enumerate(rows):
        row["user_id"] = f"user-{i % 8}"
    rows[-1]["user_id"] = "USER-0"
    with pytest.raises(DpclipError, match="case or surrounding spaces") as caught:
        DPTrainer(model=_bert(), args=_args(tmp_path), train_dataset=rows, data_collator=_collate,
                  privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                           users_column="user_id", max_records_per_user=2))
    assert "'user-0'" in caught.value.message and "'USER-0'" in caught.value.message and caught.value.hint


def test_user_level_privacy_needs_both_arguments(tmp_path):
    with pytest.raises(DpclipError, match="users_column= and max_records_per_user="):
        DPTrainer(model=_bert(), args=_args(tmp_path), train_dataset=_rows(), data_collator=_collate,
                  privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                           users_column="user_id"))


@pytest.mark.slow  # two end-to-end runs: the slow set (README)
def test_gradient_checkpointing_in_the_training_arguments_trains_the_weights_of_the_run_without_it(tmp_path):
    """TrainingArguments(gradient_checkpointing=True): transformers checkpoints non-reentrantly by
    default, which the engine follows (docs/supported-models.md, "Gradient checkpointing")."""
    weights = []
    for checkpointing in (False, True):
        trainer = _seeded(tmp_path / str(checkpointing), gradient_checkpointing=checkpointing)
        trainer.train()
        assert trainer.model.is_gradient_checkpointing == checkpointing
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


class _WeightedTrainer(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 2


def test_a_compute_loss_override_is_refused_since_per_sample_loss_computes_the_loss(tmp_path):
    with pytest.raises(DpclipError, match="compute_loss override") as caught:
        _WeightedTrainer(model=_bert(), args=_args(tmp_path), train_dataset=_rows(), data_collator=_collate,
                         privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    assert "per_sample_loss=" in caught.value.hint


def _with_dropout() -> BertForSequenceClassification:
    model = _bert()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    return model


class _DrawsBeforeEachStep(TrainerCallback):
    """A callback drawing from torch's global generator: the dropout stream moves."""

    def on_step_begin(self, args, state, control, **kwargs):
        torch.rand(1)


@pytest.mark.slow  # end to end: the slow set (README)
def test_steps_redone_after_a_resume_release_what_they_did_with_dropout_on(tmp_path):
    """The redone steps get the checkpoint's batches and noise; with dropout they must get its dropout
    stream too (the loader's iter() drew from the global generator after the RNG state was restored),
    or two releases with the same noise give their gradients' difference away."""
    whole = _seeded(tmp_path / "whole", model=_with_dropout())
    whole.train()
    crashed = _seeded(tmp_path / "split", model=_with_dropout(), callbacks=[_CrashAfter(4)])
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    resumed = _seeded(tmp_path / "split", model=_with_dropout())
    resumed.train(resume_from_checkpoint=True)
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    log = (tmp_path / "split" / "out" / "dpclip_releases.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1, 2, 3, 4, 5, 6]   # step 5 checked, not written again


@pytest.mark.slow  # end to end: the slow set (README)
def test_a_redone_step_that_releases_another_gradient_is_refused_before_it_leaves(tmp_path):
    crashed = _seeded(tmp_path, model=_with_dropout(), callbacks=[_CrashAfter(4)])
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    resumed = _seeded(tmp_path, model=_with_dropout(), callbacks=[_DrawsBeforeEachStep()])
    with pytest.raises(DpclipError, match="did not reproduce step 5") as caught:
        resumed.train(resume_from_checkpoint=True)
    assert "random numbers" in caught.value.hint
    assert resumed.account.ledger.steps == 4
    assert all(p.grad is None for p in resumed.model.parameters())


@pytest.mark.slow  # end to end: the slow set (README)
def test_a_second_train_of_one_trainer_is_refused(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    with pytest.raises(DpclipError, match="already trained") as caught:
        trainer.train()
    assert "new DPTrainer" in caught.value.hint
    assert trainer.account.ledger.steps == 3


def test_a_model_init_is_refused_before_any_step_since_train_would_build_a_model_the_engine_does_not_clip(tmp_path):
    """Trainer(model_init=...) rebuilds the model in train() (and hyperparameter_search needs it): the
    engine clips the model of __init__ only, so the new one's gradients would be unclipped."""
    with pytest.raises(DpclipError, match="model_init") as refusal:
        DPTrainer(model=None, model_init=_bert, args=_args(tmp_path), train_dataset=_rows(), data_collator=_collate,
                  privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    assert "DPTrainer(model=model" in refusal.value.hint
    assert not (tmp_path / "out" / "ledger.json").exists()


class _StreamWithLength(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(_rows())

    def __len__(self):
        return N


def test_an_iterable_dataset_with_a_length_is_refused_with_a_hint_before_any_step(tmp_path):
    """It passed the length check, then torch's DataLoader refused the Poisson batch sampler with a traceback."""
    with pytest.raises(DpclipError, match="map-style") as refusal:
        DPTrainer(model=_bert(), args=_args(tmp_path), train_dataset=_StreamWithLength(), data_collator=_collate,
                  privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    assert "IterableDataset" in refusal.value.hint


def test_torch_compile_in_the_training_arguments_warns_toward_privacy_arguments_compile(tmp_path):
    with pytest.warns(UserWarning, match=r"PrivacyArguments\(compile=True\)"):
        _trainer(tmp_path, torch_compile=True)
