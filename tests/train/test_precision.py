"""training.precision: a recipe's forward under autocast (docs/engine.md, "Mixed precision").

The trainer builds its models on the CPU (docs/distributed.md), so fp16 is refused there
whether or not a GPU is present."""

from __future__ import annotations

import pytest
import torch

from dpclip.errors import DpclipError
from dpclip.train.parts import assemble
from dpclip.train.workflow import train
from dpclip.planning.plan import plan_for_recipe, solve_plan


def test_bf16_runs_a_recipe_end_to_end_on_cpu_with_float32_weights_and_the_plans_epsilon(small_recipe):
    recipe = small_recipe("training.precision=bf16")
    result = train(recipe)
    assert result.stopped == "completed" and result.steps_done == 12
    assert result.epsilon == pytest.approx(solve_plan(plan_for_recipe(recipe)).epsilon, rel=1e-6)
    assert (result.run_dir / "summary.json").exists()


def test_bf16_steps_run_the_forward_in_bf16_and_write_float32_gradients(small_recipe):
    trainer = assemble(small_recipe("training.precision=bf16", "privacy.unsafe_seeded_randomness=true"))
    first = next(m for m in trainer.learner.model.modules() if isinstance(m, torch.nn.Linear))
    seen = []
    first.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    before = [p.detach().clone() for p in trainer.learner.model.parameters()]
    grads = []
    trainer.learner.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.extend(p.grad.dtype for p in trainer.learner.model.parameters()))
    trainer.learner.private_step(next(iter(trainer.feed.sampler)))
    trainer.learner.engine.detach()
    assert seen == [torch.bfloat16]
    assert grads and set(grads) == {torch.float32}
    after = list(trainer.learner.model.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_fp16_is_refused_on_cpu_before_a_run_directory_exists(small_recipe, tmp_path):
    with pytest.raises(DpclipError) as info:
        train(small_recipe("training.precision=fp16"))
    assert "fp16" in info.value.message and "bf16" in info.value.hint
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_command_prints_the_fp16_refusal_as_error_and_hint(cli, tmp_path):
    from tests.conftest import REPO
    result = cli("train", REPO / "recipes" / "quickstart.yaml", f"output_dir={tmp_path / 'runs'}",
                 "training.precision=fp16")
    assert result.code != 0
    assert "error:" in result.err and "hint:" in result.err and "Traceback" not in result.err
