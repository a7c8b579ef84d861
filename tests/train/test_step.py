"""The one private step (dpclip.train.step): what training, step timing and the benchmark run."""

from __future__ import annotations

import torch

from dpclip.bench import make_step
from dpclip.rundir.checkpoint import latest_checkpoint, load_checkpoint
from dpclip.train.step import PrivateStep
from dpclip.train.parts import assemble
from dpclip.train.run_parts import RunParts
from dpclip.train.workflow import train
from dpclip.tuning.timing import measure_step_seconds

SEEDED = ("privacy.unsafe_seeded_randomness=true", "model.hidden=[16]", "training.micro_batch_size=null")


def _set_up(recipe) -> RunParts:
    """A run's parts, up to its first step (no run directory), its generators seeded by the recipe."""
    parts = assemble(recipe)
    parts.learner.schedule.apply(0)
    return parts


def _by_hand(trainer: RunParts, indices: torch.Tensor) -> None:
    """The private step written out as docs/training.md describes it, one backward per batch."""
    rows = {name: tensor[indices] for name, tensor in trainer.feed.data.train.items()}
    if len(indices):
        trainer.learner.engine.backward(trainer.learner.loss_fn(trainer.learner.model, rows))
    trainer.learner.engine.privatize()
    trainer.learner.optimizer.step()
    trainer.learner.optimizer.zero_grad(set_to_none=True)


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_the_step_does_what_a_hand_written_private_step_does(small_recipe):
    recipe = small_recipe(*SEEDED)
    ours, reference = _set_up(recipe), _set_up(recipe)
    indices = next(iter(ours.feed.sampler))
    assert torch.equal(indices, next(iter(reference.feed.sampler)))  # same seeded batch on both sides
    outcome = ours.learner.private_step(indices)
    _by_hand(reference, indices)
    for a, b in zip(_weights(ours.learner.model), _weights(reference.learner.model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert outcome.batch_size == len(indices) and outcome.seconds > 0
    assert outcome.loss_sum > 0  # cross-entropy of an untrained model


def test_micro_batches_release_the_same_step_as_one_backward(small_recipe):
    recipe = small_recipe(*SEEDED)
    whole, split = _set_up(recipe), _set_up(recipe)
    indices = next(iter(whole.feed.sampler))
    assert len(indices) > 5  # several micro-batches below
    whole_out = PrivateStep(whole.learner.model, whole.learner.loss_fn, whole.learner.engine, whole.learner.optimizer, whole.feed.data.train,
                            micro_batch_size=None)(indices)
    split_out = PrivateStep(split.learner.model, split.learner.loss_fn, split.learner.engine, split.learner.optimizer, split.feed.data.train,
                            micro_batch_size=5)(indices)
    for a, b in zip(_weights(whole.learner.model), _weights(split.learner.model)):
        torch.testing.assert_close(a, b)
    assert abs(whole_out.loss_sum - split_out.loss_sum) < 1e-3 * abs(whole_out.loss_sum)


def test_an_empty_poisson_draw_still_takes_a_noisy_step(small_recipe):
    trainer = _set_up(small_recipe(*SEEDED))
    before = _weights(trainer.learner.model)
    outcome = trainer.learner.private_step(torch.tensor([], dtype=torch.long))
    assert outcome.batch_size == 0 and outcome.loss_sum == 0.0
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(trainer.learner.model)))


def test_a_refused_release_moves_no_weight(small_recipe):
    trainer = _set_up(small_recipe(*SEEDED))
    before = _weights(trainer.learner.model)

    def refuse(report):
        raise RuntimeError("refused")

    try:
        trainer.learner.private_step(next(iter(trainer.feed.sampler)), before_update=refuse)
    except RuntimeError:
        pass
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(trainer.learner.model)))


def test_a_run_steps_like_the_step_on_the_same_seeds(small_recipe):
    """One training step of a seeded run ends with the weights one PrivateStep gives."""
    recipe = small_recipe(*SEEDED, "training.steps=1", "eval.every_steps=null")
    run = train(recipe).run_dir
    trained = _set_up(recipe)
    load_checkpoint(latest_checkpoint(run), trained.learner.model)
    stepped = _set_up(recipe)
    stepped.learner.private_step(next(iter(stepped.feed.sampler)))
    for a, b in zip(_weights(trained.learner.model), _weights(stepped.learner.model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_training_timing_and_bench_all_go_through_the_one_step(small_recipe, monkeypatch):
    calls = []
    original = PrivateStep.__call__

    def spy(self, indices, before_update=None):
        calls.append(len(indices))
        return original(self, indices, before_update)

    monkeypatch.setattr(PrivateStep, "__call__", spy)
    recipe = small_recipe("training.steps=3", "eval.every_steps=null", "model.hidden=[16]")
    train(recipe)
    assert len(calls) == 3
    measure_step_seconds(recipe, steps=2, warmup_steps=1)
    assert len(calls) == 3 + 3
    trainer = _set_up(recipe)
    trainer.learner.engine.detach()  # bench builds its own engine on its own copy of the model
    batch = {name: tensor[:8] for name, tensor in trainer.feed.data.train.items()}
    make_step("dp layer", trainer.learner.model, trainer.learner.loss_fn, batch, 8)()
    assert calls[-1] == 8 and len(calls) == 7
    make_step("non-private", trainer.learner.model, trainer.learner.loss_fn, batch, 8)()
    assert len(calls) == 7  # the baseline is not private


def test_a_policy_that_ranks_the_batch_gets_it_in_one_backward(quickstart):
    from dpclip.train.step import step_micro_batch_size

    ranked = quickstart("training.micro_batch_size=null",
                        "clipping.threshold={kind: discriminative, small: 0.5, tail_rule: top_fraction}")
    per_sample = quickstart("training.micro_batch_size=8",
                            "clipping.threshold={kind: discriminative, small: 0.5, tail_threshold: 2.0}")
    fixed = quickstart("training.micro_batch_size=8")
    assert step_micro_batch_size(ranked) is None
    assert step_micro_batch_size(per_sample) == 8
    assert step_micro_batch_size(fixed) == 8


def _step_of(parts, *, micro_batch_size, fixed_rows, users=None):
    learner = parts.learner
    return PrivateStep(learner.model, learner.loss_fn, learner.engine, learner.optimizer, parts.feed.data.train,
                       micro_batch_size=micro_batch_size, fixed_rows=fixed_rows, users=users)


def test_fixed_shapes_pad_every_micro_batch_and_release_the_same_step(small_recipe, monkeypatch):
    """training.fixed_shapes: 13 rows in micro-batches of 5 run as three backwards of 5 rows
    (the last with 2 padding rows of loss weight 0), and the released step is the unpadded one's."""
    recipe = small_recipe(*SEEDED)
    plain, padded = _set_up(recipe), _set_up(recipe)
    indices = torch.arange(3, 16)
    shapes = []
    backward = type(padded.learner.engine).backward

    def recorded(engine, losses, **kwargs):
        shapes.append((losses.shape[0], kwargs.get("samples")))
        return backward(engine, losses, **kwargs)

    plain_out = _step_of(plain, micro_batch_size=5, fixed_rows=False)(indices)
    monkeypatch.setattr(type(padded.learner.engine), "backward", recorded)
    padded_out = _step_of(padded, micro_batch_size=5, fixed_rows=True)(indices)
    assert shapes == [(5, None), (5, None), (5, 3)]
    for a, b in zip(_weights(plain.learner.model), _weights(padded.learner.model)):
        torch.testing.assert_close(a, b)
    assert padded_out.batch_size == 13 and abs(padded_out.loss_sum - plain_out.loss_sum) < 1e-5 * plain_out.loss_sum
    torch.testing.assert_close(padded_out.report.thresholds, plain_out.report.thresholds)
    torch.testing.assert_close(padded_out.report.clip_fraction, plain_out.report.clip_fraction)


def test_fixed_shapes_give_padding_rows_no_user_weight(small_recipe):
    """At the user level each row carries 1/(its person's rows in the batch); a padding row carries 0,
    so the padded step equals the unpadded one with the same people."""
    recipe = small_recipe(*SEEDED)
    plain, padded = _set_up(recipe), _set_up(recipe)
    users = torch.arange(len(plain.feed.data.train["labels"])) // 2   # two rows a person
    indices = torch.arange(0, 7)
    _step_of(plain, micro_batch_size=4, fixed_rows=False, users=users)(indices)
    _step_of(padded, micro_batch_size=4, fixed_rows=True, users=users)(indices)
    for a, b in zip(_weights(plain.learner.model), _weights(padded.learner.model)):
        torch.testing.assert_close(a, b)


def test_fixed_shapes_refuse_a_policy_that_ranks_the_whole_batch(quickstart):
    import pytest

    from dpclip.errors import DpclipError
    with pytest.raises(DpclipError) as info:
        quickstart("training.fixed_shapes=true", "training.micro_batch_size=null",
                   "clipping.threshold={kind: discriminative, small: 0.5, large: 2.0, tail_rule: top_fraction}")
    assert "fixed_shapes" in str(info.value)


def test_a_compiled_step_releases_what_the_eager_step_releases(small_recipe):
    """training.compile: the same rows, the same seeded noise, the same released weights as the eager
    padded step; the first micro-batch runs through the engine (checked), the others through the graph."""
    from dpclip.engine.compiled import CompiledMicroBatch

    recipe = small_recipe(*SEEDED)
    eager, compiled = _set_up(recipe), _set_up(recipe)
    learner = compiled.learner
    # uncompiled: what the step does around the graph (tests/engine/test_compiled.py compiles it)
    graph = CompiledMicroBatch(learner.engine, learner.model, learner.loss_fn, backend=None)
    step = PrivateStep(learner.model, learner.loss_fn, learner.engine, learner.optimizer, compiled.feed.data.train,
                       micro_batch_size=5, fixed_rows=True, compiled=graph)
    through_graph = []
    clip = graph.compiled
    graph.compiled = lambda *args: through_graph.append(1) or clip(*args)
    for indices in (torch.arange(3, 16), torch.arange(20, 29)):
        eager_out = _step_of(eager, micro_batch_size=5, fixed_rows=True)(indices)
        compiled_out = step(indices)
        for a, b in zip(_weights(eager.learner.model), _weights(learner.model)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert abs(compiled_out.loss_sum - eager_out.loss_sum) <= 1e-5 * eager_out.loss_sum
        torch.testing.assert_close(compiled_out.report.clip_fraction, eager_out.report.clip_fraction)
    # step 1 (13 rows): the first micro-batch through the engine and compared (one graph call), then two;
    # step 2 (9 rows): two micro-batches through the graph
    assert len(through_graph) == 5 and len(graph.verified) == 1


def test_a_compiled_step_needs_fixed_rows(small_recipe):
    import pytest

    from dpclip.engine.compiled import CompiledMicroBatch

    parts = _set_up(small_recipe(*SEEDED))
    learner = parts.learner
    with pytest.raises(ValueError, match="fixed_rows"):
        PrivateStep(learner.model, learner.loss_fn, learner.engine, learner.optimizer, parts.feed.data.train,
                    micro_batch_size=5, compiled=CompiledMicroBatch(learner.engine, learner.model, learner.loss_fn,
                                                                    backend=None))


def test_a_compiled_step_weighs_each_row_as_the_eager_step_at_the_user_level(small_recipe):
    """User-level privacy: each row's clipped gradient weighs 1/(its person's rows); the compiled
    micro-batches carry the same weights (0 on padding rows) and release the eager step's weights."""
    from dpclip.engine.compiled import CompiledMicroBatch

    recipe = small_recipe(*SEEDED)
    eager, compiled = _set_up(recipe), _set_up(recipe)
    users = torch.arange(len(eager.feed.data.train["labels"])) // 3   # three rows a person
    learner = compiled.learner
    graph = CompiledMicroBatch(learner.engine, learner.model, learner.loss_fn, backend=None)   # the weights' path
    step = PrivateStep(learner.model, learner.loss_fn, learner.engine, learner.optimizer, compiled.feed.data.train,
                       micro_batch_size=4, fixed_rows=True, compiled=graph, users=users)
    for indices in (torch.arange(0, 11), torch.arange(30, 40)):
        _step_of(eager, micro_batch_size=4, fixed_rows=True, users=users)(indices)
        step(indices)
        for a, b in zip(_weights(eager.learner.model), _weights(learner.model)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
