"""The q the accountant is told is the q the sampler draws at (docs/accounting.md): N counts the
training rows left after the held-out split, without the canaries, and every row, a canary too,
is in a step with that probability; `dpclip account RECIPE` plans the same q and steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dpclip.accounting import steps_for_epochs
from dpclip.accounting.statement import SHUFFLE_CAVEAT
from dpclip.data.size import training_set_size
from dpclip.planning.plan import plan_for_recipe
from dpclip.train.parts import assemble
from dpclip.train.workflow import train

CANARIES = 40


@pytest.mark.slow
def test_every_row_a_canary_too_is_drawn_at_the_planned_rate_which_excludes_the_canaries(small_recipe):
    recipe = small_recipe("privacy.unsafe_seeded_randomness=true", "model.hidden=[8]", "training.batch_size=32",
                          "data.test_fraction=0.3", "training.epochs=2", "training.steps=null",
                          f"audit={{canaries: {{count: {CANARIES}, kind: mislabel, seed: 3}}}}")
    parts = assemble(recipe)
    parts.learner.engine.detach()
    ordinary, data, plan = parts.feed.ordinary, parts.feed.data, parts.setting.plan
    n = ordinary.num_train
    assert n == training_set_size(recipe.data) < 1797 and data.num_train > n   # split off, canaries in (about half)
    q = 32 / n
    assert plan.sample_rate == q and plan.steps == steps_for_epochs(2, q) == math.ceil(2 * n / 32)
    assert parts.setting.solved.step_event.sampling_probability == q
    assert plan_for_recipe(recipe).sample_rate == q and plan_for_recipe(recipe).steps == plan.steps
    sampler = parts.feed.sampler
    assert sampler.sample_rate == q and sampler.num_examples == data.num_train
    # the realised rate, over the plan's steps and more (fixed seed): within 4 binomial standard errors
    sampler.steps = 2000
    counts = torch.zeros(data.num_train)
    for batch in sampler:
        counts[batch] += 1
    draws = sampler.steps * data.num_train
    tolerance = 4 * math.sqrt(q * (1 - q) / draws)
    assert abs(counts.sum() / draws - q) < tolerance
    canary_rows = counts[n:]   # the canaries join after the ordinary rows
    assert abs(canary_rows.sum() / (sampler.steps * len(canary_rows)) - q) < 4 * math.sqrt(
        q * (1 - q) / (sampler.steps * len(canary_rows)))


@pytest.mark.slow
def test_a_shuffled_runs_ledger_names_its_caveat_on_every_charged_entry(small_recipe):
    """ledger.json is released: its PoissonSampled events, read alone (dp_accounting recomputes ε from
    them), said nothing of the fixed-size shuffled batches the statement's caveat is about."""
    result = train(small_recipe("training.sampling=shuffle", "model.hidden=[8]", "training.steps=2",
                                "eval.every_steps=null", "checkpoint.every_steps=null"))
    ledger = json.loads((Path(result.run_dir) / "ledger.json").read_text())
    assert ledger["entries"] and all(entry["metadata"]["caveats"] == [SHUFFLE_CAVEAT] for entry in ledger["entries"])
    poisson = train(small_recipe("model.hidden=[8]", "training.steps=2", "eval.every_steps=null",
                                 "checkpoint.every_steps=null"))
    entries = json.loads((Path(poisson.run_dir) / "ledger.json").read_text())["entries"]
    assert entries and all("caveats" not in entry["metadata"] for entry in entries)
