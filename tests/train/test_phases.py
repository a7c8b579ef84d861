"""Continual runs: the public phase, the switch, mixing schedules and resume (docs/continual.md)."""

from __future__ import annotations

import json
import math
import shutil

import dp_accounting
import pytest
import torch
from torch import nn

from dpclip.accounting import Ledger, steps_for_epochs
from dpclip.engine import DPEngine
from dpclip.errors import DpclipError
from dpclip.recipe import load_recipe
from dpclip.train import parts, phases, trainer
from dpclip.train.phases import dpmd_alpha, mix_gradients, reset_states, sample_alpha
from dpclip.train.workflow import train

CONTINUAL = ("data.public_fraction=0.1", "public={source: builtin, name: digits}",
             "privacy.unsafe_seeded_randomness=true")


@pytest.fixture
def continual_recipe(quickstart, one_thread):
    """Quickstart (digits MLP) with 10% of digits carved out as public data; a few steps."""

    def make(*overrides):
        return quickstart("training.epochs=null", "training.steps=6", "checkpoint.every_steps=3",
                          "checkpoint.keep=10", *CONTINUAL, *overrides)

    return make


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _direct_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """dp_accounting's PLD on a fine grid (the ledger picks its own grid: relative error ~1e-3)."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(event, steps)
    return accountant.get_epsilon(delta)


def test_switch_run_charges_only_the_private_steps_as_dp_accounting_does(continual_recipe):
    recipe = continual_recipe("continual={switch: {rule: step, at_step: 7}}")
    result = train(recipe)
    records = _records(result.run_dir)
    public = [r for r in records if r.get("phase") == "public"]
    switch = [r for r in records if r.get("kind") == "switch"]
    private = [r for r in records if r.get("phase") == "private"]
    assert len(public) == 7 and len(private) == 6
    assert switch == [{**switch[0], "public_step": 7, "reason": "rule step: 7 public steps done"}]
    ledger = Ledger.from_dict(json.loads((result.run_dir / "ledger.json").read_text()))
    assert ledger.steps == 6
    entry = ledger.entries[0].event
    q, sigma = entry.sampling_probability, entry.event.noise_multiplier
    assert result.epsilon == pytest.approx(_direct_epsilon(q, sigma, 6, recipe.privacy.delta), rel=2e-3)
    assert any(line.startswith("not covered by ε: public data: builtin:digits") and "declared public by you" in line
               for line in result.statement)


def test_public_phase_draws_no_private_batch(continual_recipe, monkeypatch):
    """The private sampler is touched only by private steps: as many draws as private steps."""
    draws = []
    iterate = parts.PoissonSampler.__iter__

    def counted(self):
        for batch in iterate(self):
            draws.append(len(draws))
            yield batch

    monkeypatch.setattr(parts.PoissonSampler, "__iter__", counted)
    seen = []
    public_step = phases.Continual._public_train_step

    def spy(self):
        seen.append(len(draws))
        return public_step(self)

    monkeypatch.setattr(phases.Continual, "_public_train_step", spy)
    train(continual_recipe("continual={switch: {rule: step, at_step: 5}}"))
    assert seen == [0] * 5 and len(draws) == 6


def test_only_public_charges_nothing(continual_recipe):
    result = train(continual_recipe("continual={schedule: only-public, switch: {rule: step, at_step: 4}}"))
    assert result.steps_done == 0 and result.epsilon == 0.0
    assert json.loads((result.run_dir / "ledger.json").read_text())["steps"] == 0
    switch = [r for r in _records(result.run_dir) if r.get("kind") == "switch"]
    assert "only-public: no private step follows (ε = 0)" in switch[0]["reason"]


def test_only_public_states_no_planned_private_step_anywhere(continual_recipe, tmp_path):
    """The run never leaves the public phase: its summary, report, export card, dry run and
    `dpclip account` must not state the private steps (and ε) of a plan it never runs."""
    from dpclip.export.card import progress_line, run_progress
    from dpclip.planning.account import AccountFlags, account_report
    from dpclip.recipe import recipe_to_yaml
    from dpclip.train.report import run_summary

    recipe = continual_recipe("continual={schedule: only-public, switch: {rule: step, at_step: 2}}")
    result = train(recipe)
    assert result.steps_planned == 0
    assert json.loads((result.run_dir / "summary.json").read_text())["steps_planned"] == 0
    assert run_summary(result.run_dir)["steps_planned"] == 0
    planned, stopped = run_progress(result.run_dir, recipe, 0)
    assert progress_line(0, planned, stopped, 0) == "The run released 0 of its 0 planned steps (completed)."
    dry = train(recipe, dry_run=True)
    assert (dry.steps_planned, dry.epsilon, dry.epsilon_rdp) == (0, 0.0, 0.0)
    assert dry.statement == result.statement
    path = tmp_path / "only-public.yaml"
    path.write_text(recipe_to_yaml(recipe))
    with pytest.raises(DpclipError, match="no private step") as refused:
        account_report(AccountFlags(), path)
    assert "continual.schedule=switch" in refused.value.hint


def test_a_rule_that_never_fires_ends_at_the_cap_and_says_so(continual_recipe):
    # patience 50 evaluations can never run out within a cap of 8 public steps
    result = train(continual_recipe("continual={switch: {rule: early-stopping, every_steps: 2, patience: 50, "
                                    "max_public_steps: 8}}"))
    switch = [r for r in _records(result.run_dir) if r.get("kind") == "switch"]
    assert switch[0]["reason"] == "cap of 8 public steps reached: the early-stopping rule never fired"
    assert switch[0]["public_step"] == 8


def test_early_stopping_fires_after_patience_evaluations_without_improvement(continual_recipe, monkeypatch):
    losses = iter([1.0, 0.5, 0.6, 0.7, 0.4])
    monkeypatch.setattr(phases.Continual, "_public_metrics", lambda self: {"loss": next(losses), "accuracy": 0.0})
    result = train(continual_recipe("continual={switch: {every_steps: 1, patience: 2, max_public_steps: 50}}"))
    switch = [r for r in _records(result.run_dir) if r.get("kind") == "switch"][0]
    assert switch["public_step"] == 4
    assert switch["reason"] == "public validation loss did not improve for 2 evaluations (patience 2; best 0.5)"


def test_b_star_rule_switches_when_the_estimate_falls_below_the_multiple(continual_recipe, monkeypatch):
    estimates = iter([500.0, 300.0, 100.0])
    calls = []

    class Diagnostics:
        mean_sample_grad_norm_sq = 4.0

        def __init__(self):
            self.value = next(estimates)

        def b_star_dp(self, gradient_noise_multiplier, clip_factor):
            calls.append((gradient_noise_multiplier, clip_factor))
            return self.value

    monkeypatch.setattr("dpclip.train.phases.measure",
                        lambda model, loss_fn, rows, *, probes=20, per_sample=16, generator=None: Diagnostics())
    result = train(continual_recipe("continual={switch: {rule: b-star, every_steps: 2, b_star_multiple: 2}}"))
    switch = [r for r in _records(result.run_dir) if r.get("kind") == "switch"][0]
    assert switch["public_step"] == 6
    assert switch["reason"] == "B*_DP estimate 100 fell below 2 x batch size 64"
    # quickstart: abadi, layer groups of C = 1 each (total C = sqrt(K)); E|g|² = 4 gives 1/|g| = 0.5
    sigma, clip = calls[0]
    assert sigma == pytest.approx(result.noise["gradient_noise_multiplier"])
    assert clip == pytest.approx(min(0.5, 1 / math.sqrt(3)))


def test_dpmd_alpha_follows_one_minus_cosine():
    assert dpmd_alpha(0, 10) == 0.0
    assert dpmd_alpha(5, 10) == pytest.approx(1 - math.cos(math.pi / 4))
    assert all(dpmd_alpha(t, 10) < 1 for t in range(10))
    assert sample_alpha(100, 900) == pytest.approx(0.1)


def test_mixed_step_gradient_is_alpha_public_mean_plus_private_clipped_mean():
    """With σ = 0: p.grad = α·mean_pub g + (1−α)·Σ clip(g_i)/B, checked by hand on a linear model."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 0.5}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=4)
    x_pub, x_priv = torch.randn(5, 3), torch.randn(3, 3) * 4
    with engine.paused():
        model(x_pub).pow(2).mean().backward()
    public = {id(model.weight): model.weight.grad.clone()}
    model.weight.grad = None
    engine.backward(model(x_priv).pow(2).squeeze(1))
    engine.privatize()
    mix_gradients([model.weight], public, 0.3)
    w = model.weight.detach()
    g_pub = (2 * (x_pub @ w.T) * x_pub).mean(0)
    per = 2 * (x_priv @ w.T) * x_priv
    clipped = per * torch.clamp(0.5 / per.norm(dim=1, keepdim=True), max=1.0)
    expected = 0.3 * g_pub + 0.7 * clipped.sum(0) / 4
    assert torch.allclose(model.weight.grad.squeeze(0), expected, atol=1e-6)


@pytest.mark.slow   # 4-7 s: the default run keeps under 10 minutes
@pytest.mark.parametrize("schedule", ["dpmd", "sample"])
def test_mixing_schedules_charge_every_step_like_a_plain_run(continual_recipe, schedule):
    mixed = train(continual_recipe(f"continual={{schedule: {schedule}}}"))
    records = [r for r in _records(mixed.run_dir) if "thresholds" in r]
    assert [r["phase"] for r in records] == ["mixed"] * 6
    if schedule == "dpmd":
        assert [r["alpha"] for r in records] == pytest.approx([dpmd_alpha(t, 6) for t in range(6)])
    # the same recipe without the mixing (same N, q, σ): the ledgers hold the same events
    plain = train(continual_recipe("continual={schedule: only-private}"))
    assert [r.get("phase") for r in _records(plain.run_dir) if "thresholds" in r] == ["private"] * 6
    ledger = json.loads((mixed.run_dir / "ledger.json").read_text())
    assert ledger["entries"] == json.loads((plain.run_dir / "ledger.json").read_text())["entries"]
    assert mixed.epsilon == pytest.approx(_direct_epsilon(*_q_sigma(mixed), 6, 1e-5), rel=2e-3)


def _q_sigma(result):
    ledger = Ledger.from_dict(json.loads((result.run_dir / "ledger.json").read_text()))
    event = ledger.entries[0].event
    return event.sampling_probability, event.event.noise_multiplier


def test_reset_m_only_leaves_v_and_t():
    state = {"step": torch.tensor(7.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.full((3,), 2.0)}
    out = reset_states(state, ["m"])
    assert torch.equal(out["exp_avg"], torch.zeros(3))
    assert torch.equal(out["exp_avg_sq"], state["exp_avg_sq"]) and float(out["step"]) == 7.0
    assert float(reset_states(state, ["t"])["step"]) == 0.0


def test_switch_carries_adam_state_with_m_reset_and_reinitialises_the_head(continual_recipe, monkeypatch):
    seen = {}
    switch = phases.Continual._switch

    def spy(self, reason):
        head = self.head[2]
        seen["head_before"] = head.weight.detach().clone()
        seen["public_state"] = {id(p): {k: v.clone() for k, v in s.items()} for p, s in self.public_optimizer.state.items()}
        record = switch(self, reason)
        seen["head_after"] = head.weight.detach().clone()
        seen["private_state"] = {id(p): {k: v.clone() for k, v in s.items()}
                                 for p, s in self.optimizer.state.items()}
        seen["head_ids"] = {id(p) for p in head.parameters()}
        return record

    monkeypatch.setattr(phases.Continual, "_switch", spy)
    train(continual_recipe("training.optimizer={kind: adam, lr: 0.003}",
                           "continual={switch: {rule: step, at_step: 3}, at_switch: {reinit_head: true}}"))
    assert not torch.equal(seen["head_before"], seen["head_after"])
    body = [key for key in seen["public_state"] if key not in seen["head_ids"]]
    assert body and all(key not in seen["private_state"] for key in seen["head_ids"])
    for key in body:
        before, after = seen["public_state"][key], seen["private_state"][key]
        assert torch.equal(after["exp_avg"], torch.zeros_like(before["exp_avg"]))
        assert torch.equal(after["exp_avg_sq"], before["exp_avg_sq"]) and float(after["step"]) == 3.0


def test_different_class_counts_need_a_head_reinit(quickstart, tmp_path, one_thread):
    public = tmp_path / "public.csv"
    torch.manual_seed(0)
    rows = ["label," + ",".join(f"f{i}" for i in range(64))]
    rows += [f"{k % 3}," + ",".join(f"{v:.3f}" for v in torch.rand(64).tolist()) for k in range(60)]
    public.write_text("\n".join(rows) + "\n")
    block = f"public={{source: files, format: csv, train: {public}, label_field: label}}"
    with pytest.raises(DpclipError, match="3 classes and the private data 10") as refused:
        train(quickstart("training.epochs=null", "training.steps=2", block))
    assert "reinit_head: true" in refused.value.hint
    result = train(quickstart("training.epochs=null", "training.steps=2", block,
                              "continual={switch: {rule: step, at_step: 2}, at_switch: {reinit_head: true}}"))
    assert result.steps_done == 2


def test_public_classes_named_otherwise_than_the_private_ones_need_a_head_reinit(quickstart, tmp_path):
    """Two classes each, but the public "fox" would train the private "dog" output: the same count
    of classes is not the same label set."""
    from dpclip.data import load_data
    from dpclip.data.public import load_public

    def table(path, names, offset):
        path.write_text("a,b,label\n" + "".join(f"{offset + i / 7},{-i},{names[i % 2]}\n" for i in range(40)))
        return path

    private, public = table(tmp_path / "d.csv", "cat dog".split(), 0), table(tmp_path / "p.csv", "cat fox".split(), 100)
    blocks = (f"data={{source: files, format: csv, train: {private}, label_field: label}}",
              f"public={{source: files, format: csv, train: {public}, label_field: label}}")

    def heads(continual):
        recipe = quickstart(*blocks, f"continual={continual}")
        private_data = load_data(recipe.data, seed=0)
        return phases.public_heads(recipe, nn.Sequential(nn.Linear(2, 2)), load_public(recipe, private_data),
                                   private_data)

    for schedule in ("switch", "sample"):
        with pytest.raises(DpclipError, match=r"classes \['cat', 'fox'\] and the private data \['cat', 'dog'\]") \
                as refused:
            heads(f"{{schedule: {schedule}}}")
        assert ("reinit_head: true" if schedule == "switch" else "schedule: switch") in refused.value.hint
    head, public_head = heads("{at_switch: {reinit_head: true}}")   # the private head starts afresh at the switch
    assert head[2].out_features == 2 and public_head is None


def test_linear_probing_refuses_an_output_layer_whose_weights_the_body_shares(quickstart):
    """Tied weights (a language model's output layer is its input embedding): "update only the output
    layer" would move the body's use of them too."""
    from dpclip.data import load_data
    from dpclip.data.public import load_public

    recipe = quickstart(*CONTINUAL, "continual={at_switch: {linear_probe_epochs: 1}}")
    private = load_data(recipe.data, seed=0)
    public = load_public(recipe, private)
    tied = nn.Sequential(nn.Linear(64, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    tied[1].weight = tied[2].weight
    with pytest.raises(DpclipError, match=r"tied to module 1") as refused:
        phases.public_heads(recipe, tied, public, private)
    assert "linear_probe_epochs: 0" in refused.value.hint
    untied = nn.Sequential(nn.Linear(64, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    assert phases.public_heads(recipe, untied, public, private)[0][2] is untied[2]


def _text_csv(path, labels, count, offset=0):
    rows = ["text,label"] + [f"note {offset + i} says {'word ' * (i % 4)}{labels[i % len(labels)]},"
                             f"{labels[i % len(labels)]}" for i in range(count)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.slow   # ~20 s: the engine's own test is tests/engine/test_batch_axis.py (mid-forward probe)
def test_a_transformer_classifier_trains_privately_after_a_public_phase_with_more_classes(tmp_path, one_thread):
    """The public head of its own size runs the public phase; the private step then meets the
    model's own head for the first time (probed mid-forward) and must still train (BERT)."""
    _text_csv(tmp_path / "private.csv", ["b", "c"], 40)
    _text_csv(tmp_path / "public.csv", ["a", "b", "c"], 30, offset=1000)
    fields = "format: csv, text_field: text, label_field: label, tokenizer: byte, max_length: 16, test_fraction: 0.2"
    (tmp_path / "recipe.yaml").write_text(f"""name: bert-heads
seed: 0
output_dir: runs
data: {{source: files, train: private.csv, {fields}}}
public: {{source: files, train: public.csv, {fields}}}
model: {{kind: hf, task: sequence-classification, config: {{model_type: bert, num_hidden_layers: 1, hidden_size: 16,
        num_attention_heads: 2, intermediate_size: 32, max_position_embeddings: 32}}}}
training: {{steps: 2, batch_size: 8, sampling: poisson, optimizer: {{kind: sgd, lr: 0.1}}}}
privacy: {{epsilon: 8.0, delta: 1.0e-5}}
continual: {{switch: {{rule: step, at_step: 2}}, at_switch: {{reinit_head: true}}}}
""")
    recipe = load_recipe(tmp_path / "recipe.yaml")
    result = train(recipe)
    assert result.steps_done == 2
    assert [r["phase"] for r in _records(result.run_dir) if r.get("phase")] == ["public"] * 2 + ["private"] * 2


def test_linear_probe_steps_are_planned_charged_and_move_only_the_head(continual_recipe, monkeypatch):
    recipe = continual_recipe("continual={switch: {rule: step, at_step: 2}, at_switch: {reinit_head: true, "
                              "linear_probe_epochs: 0.1}}")
    moved = []
    step = trainer.train_step

    def spy(run, state, indices, output):
        before = {name: p.detach().clone() for name, p in run.learner.model.named_parameters()}
        step(run, state, indices, output)
        moved.append({name for name, p in run.learner.model.named_parameters() if not torch.equal(before[name], p)})

    monkeypatch.setattr(trainer, "train_step", spy)
    result = train(recipe)
    probe = steps_for_epochs(0.1, 64 / 1294)
    assert result.steps_planned == 6 + probe and result.steps_done == 6 + probe
    records = [r for r in _records(result.run_dir) if "thresholds" in r]
    assert [bool(r.get("probe")) for r in records] == [True] * probe + [False] * 6
    assert all(names <= {"5.weight", "5.bias"} for names in moved[:probe]), moved[:probe]
    assert len(moved[-1]) > 2


def _crashed_copy(run_dir, dest, checkpoint_step_dir: str):
    shutil.copytree(run_dir, dest)
    (dest / "checkpoints" / "LATEST").write_text(checkpoint_step_dir + "\n")
    return dest


@pytest.mark.parametrize("where", [pytest.param("public", marks=pytest.mark.slow), "private"])
def test_resume_mid_phase_continues_it_with_the_same_ledger(continual_recipe, tmp_path, monkeypatch, where):
    """Interrupt (Ctrl-C) in the public or the private phase, resume: same records and ledger (seeded:
    past the redone steps an OS-entropy run draws fresh streams, tests/privacy/test_forked_resumes.py)."""
    recipe = continual_recipe("continual={switch: {rule: step, at_step: 6}}", "checkpoint.every_steps=2",
                              "privacy.unsafe_seeded_randomness=true")
    full = train(recipe).run_dir

    class Interrupt:
        count = 0

    public_step = phases.Continual._public_train_step
    private_step = trainer.train_step

    def stop_after(fn, n):
        def wrapped(*args):
            out = fn(*args)
            Interrupt.count += 1
            if Interrupt.count == n:
                signal_flag[0].requested = True
            return out
        return wrapped

    signal_flag = []
    deferred = trainer.DeferredInterrupt.__enter__

    def enter(self):
        signal_flag.append(self)
        return deferred(self)

    monkeypatch.setattr(trainer.DeferredInterrupt, "__enter__", enter)
    if where == "public":
        monkeypatch.setattr(phases.Continual, "_public_train_step", stop_after(public_step, 3))
    else:
        monkeypatch.setattr(trainer, "train_step", stop_after(private_step, 3))
    first = train(recipe.model_copy(update={"output_dir": str(tmp_path / "again")}))
    assert first.stopped == "interrupted"
    monkeypatch.undo()
    state = json.loads((first.run_dir / "checkpoints" /
                        (first.run_dir / "checkpoints" / "LATEST").read_text().strip() / "state.json").read_text())
    assert state["continual"]["switched"] is (where == "private")
    resumed = train(resume=first.run_dir)
    assert resumed.steps_done == 6

    def strip(records):
        return [{k: v for k, v in r.items() if k not in ("seconds", "epsilon", "public_eval", "public_loss",
                                                         "diagnostics", "lr")} for r in records]

    assert strip(_records(first.run_dir)) == strip(_records(full))
    assert json.loads((first.run_dir / "ledger.json").read_text())["entries"] == \
        json.loads((full / "ledger.json").read_text())["entries"]
