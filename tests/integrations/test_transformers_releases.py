"""DPTrainer: what leaves besides the noisy steps, and what it refuses to leave unchecked
(docs/python-api.md, "Hugging Face Trainer")."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

from dpclip import layout
from dpclip.errors import DpclipError
from dpclip.integrations.trainer_arguments import BEST_KEPT, MEMORY, METRIC_SCHEDULED
from dpclip.integrations.transformers import EVALUATED, TIMED, DPTrainer, PrivacyArguments
from tests.integrations.test_transformers import _args, _bert, _collate, _CrashAfter, _rows, _trainer

STATE = layout.TRAINER_STATE.format(rank=0)


def test_the_saved_trainer_state_counts_no_operations_of_the_private_batches(tmp_path):
    """total_flos summed 6·P·|B_t|·T_t over the Poisson draws: their realised sizes, without noise."""
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=2)
    trainer.train()
    trainer.save_state()
    assert trainer.state.total_flos == 0
    for path in (tmp_path / "out" / "trainer_state.json", tmp_path / "out" / "checkpoint-2" / "trainer_state.json"):
        assert json.loads(path.read_text())["total_flos"] == 0


@pytest.mark.parametrize("change, message", [
    ({"include_num_input_tokens_seen": True}, "include_num_input_tokens_seen"),
    ({"include_num_input_tokens_seen": "non_padding"}, "include_num_input_tokens_seen"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5"),   # its noise scales with the batch's padded length
    ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
    ({"train_sampling_strategy": "sequential"}, "train_sampling_strategy='sequential'"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
])
def test_training_arguments_that_would_leak_or_be_ignored_are_refused_with_a_hint(tmp_path, change, message):
    with pytest.raises(DpclipError, match=re.escape(message)) as info:
        _trainer(tmp_path, **change)
    assert info.value.hint


def test_evaluate_and_predict_metrics_and_the_timings_are_stated_not_covered_by_epsilon(tmp_path):
    """train_runtime grows with the drawn batches; eval_loss, predictions: computed without noise from whatever data they are given (the training
    set's, here), they leave through the logs and trainer_state.json outside the ledger."""
    trainer = _trainer(tmp_path)
    trainer.train()
    assert TIMED in json.loads((tmp_path / "out" / "privacy.json").read_text())["not_covered_by_epsilon"]
    assert EVALUATED not in json.loads((tmp_path / "out" / "privacy.json").read_text())["not_covered_by_epsilon"]
    trainer.evaluate(trainer.train_dataset)
    assert EVALUATED in json.loads((tmp_path / "out" / "privacy.json").read_text())["not_covered_by_epsilon"]
    predicting = _trainer(tmp_path / "predicting")
    predicting.predict(predicting.train_dataset)
    predicting.train()
    assert EVALUATED in json.loads((tmp_path / "predicting" / "out" / "privacy.json").read_text())[
        "not_covered_by_epsilon"]


def test_a_learning_rate_set_from_evaluate_s_metric_is_stated_outside_epsilon(tmp_path):
    """ReduceLROnPlateau (GreedyLR) steps on an exact eval metric: with private eval data every later
    step's weights carry it, so the statement beside them says so, whether the TrainingArguments or
    optimizers= asked for the scheduler."""
    args = _args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, lr_scheduler_type="reduce_lr_on_plateau")
    trainer = DPTrainer(model=_bert(), args=args, train_dataset=_rows(), eval_dataset=_rows(10),
                        data_collator=_collate, privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0,
                                                                         max_grad_norm=1.0))
    assert METRIC_SCHEDULED in trainer.account.not_covered()   # stated from the start
    model = _bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    trainer = DPTrainer(model=model, args=_args(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1,
                                                metric_for_best_model="eval_loss"),
                        train_dataset=_rows(), eval_dataset=_rows(10), data_collator=_collate,
                        optimizers=(optimizer, scheduler),
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    assert METRIC_SCHEDULED in trainer.account.not_covered()
    trainer.train()
    assert scheduler.last_epoch == 1   # stepped on eval_loss after the step
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert METRIC_SCHEDULED in privacy["not_covered_by_epsilon"]
    assert f"not covered by ε: {METRIC_SCHEDULED}" in privacy["statement"]


@pytest.mark.slow  # end to end, as load_best_model_at_end's own test: the slow set (README)
def test_weights_chosen_by_a_metric_asked_for_after_the_trainer_is_built_are_stated_too(tmp_path):
    """load_best_model_at_end set on trainer.args after __init__: the Trainer still keeps the checkpoint
    eval_loss chose, and the statement beside the weights says so."""
    args = _args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1)
    trainer = DPTrainer(model=_bert(), args=args, train_dataset=_rows(), eval_dataset=_rows(10), data_collator=_collate,
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.args.load_best_model_at_end, trainer.args.metric_for_best_model = True, "eval_loss"
    trainer.train()
    trainer.save_model()
    assert trainer.state.best_model_checkpoint is not None
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert privacy["not_covered_by_epsilon"].count(BEST_KEPT) == 1 and f"not covered by ε: {BEST_KEPT}" in privacy["statement"]


def test_the_trainer_s_memory_metrics_are_stated_outside_epsilon(tmp_path):
    """skip_memory_metrics=False logs train()'s memory deltas (train_mem_cpu_alloc_delta, the GPU's peak),
    which grow with the drawn batches' sizes, beside the timings."""
    trainer = _trainer(tmp_path, max_steps=1, skip_memory_metrics=False)
    assert "train_mem_cpu_alloc_delta" in trainer.train().metrics
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert MEMORY in privacy["not_covered_by_epsilon"] and f"not covered by ε: {MEMORY}" in privacy["statement"]
    assert MEMORY not in _trainer(tmp_path / "skipped").account.not_covered()   # the default: none measured


def test_evaluations_during_training_are_stated_in_the_checkpoints_too(tmp_path):
    args = _args(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, max_steps=1)
    trainer = DPTrainer(model=_bert(), args=args, train_dataset=_rows(), eval_dataset=_rows(), data_collator=_collate,
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    for folder in (tmp_path / "out", tmp_path / "out" / "checkpoint-1"):
        assert EVALUATED in json.loads((folder / "privacy.json").read_text())["not_covered_by_epsilon"]


def test_an_evaluation_after_a_save_elsewhere_is_stated_in_that_folder_too_with_its_epsilon_kept(tmp_path):
    """save_model(other) wrote other/privacy.json; a later evaluate() releases more of the data the
    model in it was trained on: its labels gain the line, its ε and ledger stay those of its save."""
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=1, max_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "elsewhere"))
    before = {folder: json.loads((folder / "privacy.json").read_text())
              for folder in (tmp_path / "elsewhere", tmp_path / "out" / "checkpoint-1")}
    trainer.evaluate(trainer.train_dataset)
    for folder, saved in before.items():
        now = json.loads((folder / "privacy.json").read_text())
        assert EVALUATED not in saved["not_covered_by_epsilon"] and EVALUATED in now["not_covered_by_epsilon"]
        assert f"not covered by ε: {EVALUATED}" in now["statement"]
        assert (now["epsilon"], now["steps"]) == (saved["epsilon"], saved["steps"])
    assert before[tmp_path / "out" / "checkpoint-1"]["steps"] == 1


def test_training_arguments_changed_after_the_trainer_is_built_are_refused_before_the_step(tmp_path):
    """Set on trainer.args after __init__ (or by a callback mid-run), the count of the Poisson draws'
    tokens would reach the logs and trainer_state.json, stated nowhere."""
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.args.include_num_input_tokens_seen = True
    with pytest.raises(DpclipError, match="include_num_input_tokens_seen") as refused:
        trainer.train()
    assert refused.value.hint and trainer.account.ledger.steps == 0

    class CountTokens(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            args.include_num_input_tokens_seen = True

    trainer = _trainer(tmp_path / "again", max_steps=2)
    trainer.add_callback(CountTokens())
    with pytest.raises(DpclipError, match="include_num_input_tokens_seen"):
        trainer.train()
    assert trainer.account.ledger.steps == 1 and trainer.state.num_input_tokens_seen == 0
    trainer = _trainer(tmp_path / "parts", max_steps=2, gradient_accumulation_steps=2)
    trainer.args.gradient_accumulation_steps = 1   # the plan's B and the loader's parts stay 2's
    with pytest.raises(DpclipError, match=r"gradient_accumulation_steps\) is 1 now, 2 when"):
        trainer.train()


def test_a_callbacks_extra_optimizer_step_is_refused_before_anything_is_released(tmp_path):
    """It would release noise alone and charge a step past the plan (3 of 2)."""
    class StepAgain(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            optimizer.step()

    trainer = _trainer(tmp_path, max_steps=2)
    trainer.add_callback(StepAgain())
    with pytest.raises(DpclipError, match="outside the Trainer's own step") as refused:
        trainer.train()
    assert "callback" in refused.value.hint
    assert trainer.account.ledger.steps == 1


def test_a_resume_from_a_checkpoint_moved_away_from_its_release_log_is_refused(tmp_path):
    _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=3).train()
    shutil.copytree(tmp_path / "out" / "checkpoint-2", tmp_path / "moved" / "checkpoint-2")
    resumed = _trainer(tmp_path / "again", save_strategy="steps", save_steps=2, max_steps=3)
    with pytest.raises(DpclipError, match="no dpclip_releases.jsonl") as info:
        resumed.train(resume_from_checkpoint=str(tmp_path / "moved" / "checkpoint-2"))
    assert "dpclip_releases.jsonl" in info.value.hint
    assert all(p.grad is None for p in resumed.model.parameters())
    shutil.copy(tmp_path / "out" / "dpclip_releases.jsonl", tmp_path / "moved")   # the hint's way out
    again = _trainer(tmp_path / "again", save_strategy="steps", save_steps=2, max_steps=3)
    again.train(resume_from_checkpoint=str(tmp_path / "moved" / "checkpoint-2"))
    assert again.account.ledger.steps == 3


def test_the_clipping_block_parses_as_json_beside_the_training_arguments(tmp_path):
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    block = {"grouping": "layer", "threshold": {"kind": "fixed", "value": 1.0}}
    _, privacy = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--delta", "1e-5",
                                                     "--noise_multiplier", "1", "--clipping", json.dumps(block)])
    assert privacy.clipping == block
    assert PrivacyArguments(delta=1e-5).clipping == {}
    with pytest.raises(DpclipError, match="clipping is not JSON") as info:
        PrivacyArguments(delta=1e-5, clipping="{grouping: layer}")
    assert "--clipping" in info.value.hint


def _log(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "dpclip_releases.jsonl").read_text().splitlines()]


def _crashing(tmp_path, **kwargs):
    """Checkpoint 2 saved, step 3 released, then a crash."""
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=4, **kwargs)
    trainer.add_callback(_CrashAfter(2))
    return trainer


def test_a_new_run_in_an_output_dir_with_an_older_runs_log_resumes_against_its_own_steps_only(tmp_path):
    """A new run appends to the older run's log; resumed, it redoes its own steps (3 here), not the
    older run's step 4 (another gradient and noise: it used to be refused as a step not reproduced)."""
    _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=4).train()
    with pytest.raises(KeyboardInterrupt):
        _crashing(tmp_path).train()   # the same output_dir, a new run
    resumed = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.account.ledger.steps == 4
    older, newer = _log(tmp_path)[:4], _log(tmp_path)[4:]
    assert [r["step"] for r in older] == [1, 2, 3, 4] and [r["step"] for r in newer] == [1, 2, 3, 4]  # 3 checked
    assert len({r["run"] for r in older}) == len({r["run"] for r in newer}) == 1
    assert older[0]["run"] != newer[0]["run"] == torch.load(tmp_path / "out" / "checkpoint-2" / STATE)["run"]


def test_a_checkpoint_and_log_from_before_run_ids_resume_against_the_records_without_one(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _crashing(tmp_path).train()
    state = torch.load(tmp_path / "out" / "checkpoint-2" / STATE)
    state.pop("run", None)   # as DPTrainer wrote them before run ids
    torch.save(state, tmp_path / "out" / "checkpoint-2" / STATE)
    log = tmp_path / "out" / "dpclip_releases.jsonl"
    log.write_text("".join(json.dumps({"step": r["step"], "fingerprint": r["fingerprint"]}) + "\n"
                           for r in _log(tmp_path)))
    resumed = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert [r["step"] for r in _log(tmp_path)] == [1, 2, 3, 4]   # step 3 checked against the old record
    assert not any("run" in r for r in _log(tmp_path))


def test_a_new_runs_steps_after_an_older_runs_line_cut_by_its_crash_are_still_checked_when_redone(tmp_path):
    log = tmp_path / "out" / "dpclip_releases.jsonl"
    log.parent.mkdir()
    log.write_text(json.dumps({"step": 1, "fingerprint": [0.5, 0.25], "run": "older"}) + '\n{"step": 2, "fing')
    with pytest.raises(KeyboardInterrupt):
        _crashing(tmp_path).train()
    resumed = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert [r["step"] for r in _log(tmp_path)] == [1, 1, 2, 3, 4]   # the cut line dropped; 3 checked, not redone


def test_a_run_resumed_after_an_evaluation_keeps_stating_it(tmp_path):
    """evaluate() on the training set before the crash left its metrics in the logs and trainer_state.json;
    the resumed process's statement names them although it has not evaluated itself."""
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=1, max_steps=2)
    trainer.train()
    trainer.evaluate(trainer.train_dataset)
    resumed = _trainer(tmp_path, save_strategy="steps", save_steps=1, max_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert EVALUATED in json.loads((tmp_path / "out" / "privacy.json").read_text())["not_covered_by_epsilon"]
    assert EVALUATED in resumed.account.not_covered()


@pytest.mark.slow  # two end-to-end Trainer runs: the slow set (README)
def test_a_resume_stopped_before_redoing_every_lost_step_still_counts_them(tmp_path):
    """Steps 3 and 4 left the crashed process (checkpoint-2 on disk); a resume stopped after
    redoing step 3 had released 4 steps, not 3: its ε and statement count them (make_private's
    load_checkpoint alike: tests/privacy/test_make_private_lost_steps.py)."""
    from tests.integrations.test_transformers import _CrashAfter, _trainer

    crashed = _trainer(tmp_path, max_steps=6, save_strategy="steps", save_steps=2)
    crashed.add_callback(_CrashAfter(3))   # raises at step 4's end, before its checkpoint
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    released = crashed.account.epsilon()
    assert crashed.account.ledger.steps == 4 and (tmp_path / "out" / "checkpoint-2").is_dir()
    assert not (tmp_path / "out" / "checkpoint-4").exists()
    resumed = _trainer(tmp_path, max_steps=6, save_strategy="steps", save_steps=2)
    resumed.add_callback(_CrashAfter(2))   # stops at step 3's end: one of the two lost steps redone
    with pytest.raises(KeyboardInterrupt):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.account.ledger.steps == 3
    assert resumed.account.epsilon() == pytest.approx(released)
    assert "steps: 4" in resumed.account.statement()


@pytest.mark.slow  # two end-to-end Trainer runs: the slow set (README)
def test_a_resume_of_a_save_only_model_checkpoint_with_dropout_is_refused_naming_its_missing_rng_state(tmp_path):
    """save_only_model=True saves no rng_state.pth: the redone step's dropout differs, refused before it
    leaves (integrations/releases.py), and the hint says why rather than blaming callbacks or versions."""
    from tests.integrations.test_transformers import _seeded, _with_dropout

    crashed = _seeded(tmp_path, model=_with_dropout(), callbacks=[_CrashAfter(4)], save_only_model=True)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    resumed = _seeded(tmp_path, model=_with_dropout(), save_only_model=True)
    with pytest.raises(DpclipError, match="did not reproduce step 5") as caught:
        resumed.train(resume_from_checkpoint=True)
    assert "save_only_model" in caught.value.hint and "checkpoint-4" in caught.value.hint
    assert resumed.account.ledger.steps == 4
