"""The certificate: the engine's attribution checked against each sample's own gradient
(dpclip/engine/certificate.py; docs/certificate.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpclip.engine.microbatch as microbatch
from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.mixing_models import Center, CopyRow, FunctionalBatchNorm


def _engine(model, batch, **kw):
    clipping = {"grouping": kw.pop("grouping", "all-layer"), "threshold": {"kind": "fixed", "value": 1.0}}
    clipping.update(kw.pop("clipping", {}))
    return DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=batch, **kw)


def _step(engine, model, x, y, loss=None):
    out = model(x)
    losses = F.cross_entropy(out, y, reduction="none") if loss is None else loss(out, y)
    engine.backward(losses)
    return engine.privatize()


def _mlp(dropout: float = 0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Dropout(dropout), nn.ReLU(), nn.Linear(8, 3))


def _data(b=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, generator=g), torch.randint(0, 3, (b,), generator=g)


@pytest.mark.parametrize("dropout, mode", [(0.0, "alone"), (0.3, "alone")])
@pytest.mark.parametrize("grouping", ["all-layer", "layer", "param"])
def test_exact_model_passes_the_check_at_the_first_step(dropout, mode, grouping):
    model = _mlp(dropout)
    x, y = _data()
    engine = _engine(model, 6, grouping=grouping)
    _step(engine, model, x, y)
    assert engine.certificate.checks == 1
    assert engine.certificate.last.mode == mode
    assert engine.certificate.last.rows == 4


def test_check_runs_on_a_new_shape_family_every_n_steps_and_after_a_resume():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    engine = _engine(model, 6, verify_every=4)
    x, y = _data()
    for _ in range(2):
        _step(engine, model, x, y)
    assert engine.certificate.checks == 1            # the same family: once
    _step(engine, model, x[:4], y[:4])               # another batch size, same family: one row
    assert engine.certificate.checks == 2 and engine.certificate.last.rows == 1
    _step(engine, model, x[:4], y[:4])               # that size again: not checked
    assert engine.certificate.checks == 2
    _step(engine, model, x, y)                       # step 4: every 4 steps, all rows
    assert engine.certificate.checks == 3 and engine.certificate.last.rows == 4
    _step(engine, model, x[:1], y[:1])               # B = 1 is a family of its own
    assert engine.certificate.checks == 4
    engine.load_state_dict(engine.state_dict())      # a resume
    _step(engine, model, x, y)
    assert engine.certificate.checks == 5 and engine.certificate.last.rows == 4


class MixesAtOddBatchSizes(nn.Module):
    """Adds the batch mean at odd batch sizes only: code that branches on the batch size."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        if x.shape[0] % 2 and x.shape[0] > 1:
            x = x + x.mean(0)
        return self.net(x)


def test_a_model_mixing_samples_only_at_a_later_batch_size_is_refused_there():
    """(The full check also replays the batch's two halves: at 6 rows, halves of 3 would mix.)"""
    model = MixesAtOddBatchSizes()
    engine = _engine(model, 6)
    x, y = _data(8)
    _step(engine, model, x[:4], y[:4])               # an even size, even halves: the full check passes
    _step(engine, model, x[:8], y[:8])               # another even size: its one row passes
    with pytest.raises(EngineError, match="mixes samples"):
        _step(engine, model, x[:7], y[:7])           # the first odd size: refused before its noise
    assert engine.steps == 2


def test_new_sequence_length_is_checked_again():
    torch.manual_seed(0)
    emb, head = nn.Embedding(11, 4), nn.Linear(4, 3)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = emb, head

        def forward(self, ids):
            return self.head(self.emb(ids)).mean(1)
    model = Tokens()
    engine = _engine(model, 4)
    y = torch.tensor([0, 1, 2, 0])
    _step(engine, model, torch.randint(0, 11, (4, 5)), y)
    _step(engine, model, torch.randint(0, 11, (4, 5)), y)
    assert engine.certificate.checks == 1
    _step(engine, model, torch.randint(0, 11, (4, 7)), y)
    assert engine.certificate.checks == 2


def test_engine_giving_a_row_the_wrong_clip_factor_is_refused_at_the_first_step(monkeypatch):
    real = microbatch.clip_factors

    def rolled(*args, **kwargs):   # sabotage: row i gets row i+1's clip factor
        return real(*args, **kwargs).roll(1, dims=0)
    monkeypatch.setattr(microbatch, "clip_factors", rolled)
    model = _mlp()
    x, y = _data()
    x[0] *= 50   # one sample's norm far above the others', so a swapped factor shows
    engine = _engine(model, 6, grouping="layer")
    with pytest.raises(EngineError, match="certificate refused") as err:
        _step(engine, model, x, y)
    assert "0.weight" in err.value.message or "3.weight" in err.value.message


def test_engine_giving_a_row_the_wrong_norm_is_refused_at_the_first_step(monkeypatch):
    real = microbatch.sqrt_or_zero

    def rolled(sq):   # sabotage: the norms of row i are row i+1's
        return real(sq).roll(1, dims=0)
    monkeypatch.setattr(microbatch, "sqrt_or_zero", rolled)
    model = _mlp()
    x, y = _data()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="norms and clipped gradients disagree"):
        _step(engine, model, x, y)


def test_without_the_certificate_the_sabotage_would_pass_silently(monkeypatch):
    """The sabotage above is a real fault: with the check off, the step completes."""
    real = microbatch.clip_factors
    monkeypatch.setattr(microbatch, "clip_factors", lambda *a, **k: real(*a, **k).roll(1, dims=0))
    model = _mlp()
    x, y = _data()
    engine = _engine(model, 6)
    engine.certificate._due = lambda *key: None   # the check switched off
    _step(engine, model, x, y)


@pytest.mark.parametrize("build, module, why", [
    (lambda: nn.Sequential(Center(), nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), "0 (Center)", "mixes samples"),
    (lambda: nn.Sequential(nn.Linear(5, 8), Center(), nn.ReLU(), nn.Linear(8, 3)), "1 (Center)", "mixes samples"),
    (lambda: nn.Sequential(nn.Linear(5, 8), FunctionalBatchNorm(8), nn.Linear(8, 3)), "1 (FunctionalBatchNorm)",
     "mixes samples"),
    (lambda: nn.Sequential(CopyRow(5), nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), "buffer 0.row", "from the data"),
])
def test_mixing_models_are_refused_naming_the_module(build, module, why):
    torch.manual_seed(0)
    model = build()
    x, y = _data()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match=why) as err:
        _step(engine, model, x, y)
    assert module in err.value.message


def test_a_forward_hook_that_changes_an_output_is_refused_naming_the_hooked_layer():
    """The replays run without the user's hooks (an observing hook would record them): a hook that
    scales an output makes the sample's replay differ, and the hint says where and what to do."""
    model = _mlp()
    model[2].register_forward_hook(lambda module, args, out: out * 3.0)
    x, y = _data()
    with pytest.raises(EngineError, match="mixes samples") as err:
        _step(_engine(model, 6), model, x, y)
    assert "module 2 has forward hooks" in err.value.hint and "part of the module's forward" in err.value.hint


def test_a_forward_hook_that_only_observes_passes_and_sees_the_training_forward_alone():
    model = _mlp()
    seen = []
    model[2].register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    x, y = _data()
    _step(_engine(model, 6), model, x, y)
    assert seen == [6]


def test_mixing_model_with_dropout_is_refused_in_batch_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), Center(), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 3))
    x, y = _data()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="mixes samples"):
        _step(engine, model, x, y)


def test_loss_normalised_over_the_batch_is_refused():
    model = _mlp()
    x, y = _data()
    engine = _engine(model, 6)

    def centred(out, y):
        ce = F.cross_entropy(out, y, reduction="none")
        return ce - ce.mean()
    with pytest.raises(EngineError, match="loss of sample .* depends on other samples"):
        _step(engine, model, x, y, loss=centred)


class SortedInside(nn.Module):
    """The batch sorted, processed and put back inside the forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        order = torch.argsort(x[:, 0])
        return self.b(torch.relu(self.a(x[order])))[torch.argsort(order)]


def test_batch_permuted_inside_the_forward_is_refused():
    torch.manual_seed(0)
    model = SortedInside()
    x, y = _data()
    x[:, 0] = torch.tensor([5.0, 4, 3, 2, 1, 0])   # a permutation that moves the first and last rows
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="certificate refused"):
        _step(engine, model, x, y)


class GatherTokens(nn.Module):
    """ModernBERT's sparse prediction: only some tokens of the whole batch reach the head."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h.flatten(0, 1)[(ids % 2 == 0).flatten()])


def test_tokens_gathered_across_the_batch_are_refused():
    torch.manual_seed(0)
    model = GatherTokens()
    ids = torch.tensor([[0, 2, 1], [2, 4, 3], [6, 1, 8], [5, 7, 2], [2, 2, 2], [4, 1, 0]])
    mask = (ids % 2 == 0).flatten()
    sample = torch.arange(6).repeat_interleave(3)[mask]
    engine = _engine(model, 6)

    def per_sample(out, _):
        tok = F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long), reduction="none")
        return torch.zeros(6).index_add(0, sample, tok)
    with pytest.raises(EngineError, match="cannot be attributed to samples"):
        _step(engine, model, ids, None, loss=per_sample)


def test_losses_not_from_the_model_outputs_are_refused():
    model = _mlp()
    x, y = _data()
    engine = _engine(model, 6)
    captured = {}
    hook = model[0].register_forward_hook(lambda m, a, o: captured.update(h=o))
    model(x)
    hook.remove()
    with pytest.raises(EngineError, match="do not depend on any tensor"):
        engine.backward(captured["h"].square().sum(1))


def test_the_check_changes_nothing_the_step_releases():
    """With seeded noise, the step's gradient is the same with and without the check, the
    global RNG stream goes on as if no check had run, and the buffers are as the forward left them."""
    results = []
    for check in (True, False):
        model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))
        model.register_buffer("calls", torch.zeros(()))
        model.register_forward_pre_hook(lambda m, a: (m.calls.add_(1), None)[1])
        torch.manual_seed(0)
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()} | {"calls": torch.zeros(())})
        engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 0.5}}, gradient_noise_multiplier=1.0,
                          expected_batch_size=6, seed=7)
        if not check:
            engine.certificate._due = lambda *key: None   # the check switched off
            engine.certificate.checked_writes.add("calls")    # (an unchecked forward may write what a check saw)
        x, y = _data()
        torch.manual_seed(3)
        _step(engine, model, x, y)
        results.append(([p.grad.clone() for p in model.parameters()], torch.rand(3), model.calls.clone()))
        assert engine.certificate.checks == int(check)
    (g1, r1, c1), (g2, r2, c2) = results
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert torch.equal(r1, r2)
    assert torch.equal(c1, c2)


def test_transformers_models_pass(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config).train()
    tokens = torch.randint(0, 64, (4, 7))

    def lm(out, _):
        logits = out.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1), reduction="none").view(4, -1).mean(1)
    engine = _engine(model, 4, grouping="layer")
    _step(engine, model, tokens, None, loss=lm)
    assert engine.certificate.checks == 1


@pytest.mark.parametrize("input_noise, mode", [(False, "alone"), (True, "eval")])
def test_random_draws_are_cut_per_sample_or_checked_in_eval_mode(input_noise, mode):
    """nn.MultiheadAttention's rule draws its dropout otherwise than the module does, so the batch's
    replay from the same RNG state gives other outputs; the recorded draws, cut per sample, still
    reproduce each sample (alone). With a draw that computes with its input (torch.normal(mean, std))
    nothing can be cut, the batch replay does not reproduce either, and the engine certifies a dry
    micro-batch with dropout off. Either way the real step is unchanged."""
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.layer(x)
            if input_noise and self.training:   # (F.rrelu's CPU draws count the negative inputs: refused, test_certificate_draws.py)
                h = h * torch.normal(torch.ones_like(h), 0.1)
            return self.head(h.mean(1))
    x, y = torch.randn(5, 4, 8), torch.randint(0, 3, (5,))
    results = []
    for check in (True, False):
        torch.manual_seed(0)
        model = Encoder().train()
        engine = _engine(model, 5)
        if not check:
            engine.certificate._due = lambda *key: None   # the check switched off
            engine.certificate.checked_writes.add("calls")    # (an unchecked forward may write what a check saw)
        torch.manual_seed(5)
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        results.append(engine.debug_clipped())
        if check:
            assert engine.certificate.last.mode == mode
            assert model.training and model.layer.training and model.layer.dropout.training
    checked, plain = results
    assert all(torch.equal(checked.sums[k], plain.sums[k]) for k in plain.sums)
    assert torch.equal(checked.norms, plain.norms)


class BatchStatisticsWhenTraining(nn.Module):
    """Normalises by the batch's statistics in training mode only (keeping none): mixes samples
    exactly where an eval-mode check cannot see it."""

    def forward(self, x):
        return (x - x.mean(0)) / (x.std(0) + 1e-5) if self.training else x


def test_mixing_in_training_mode_only_is_refused_where_the_step_is_checked_in_eval_mode():
    """The rule's draws cannot reproduce the step (input noise), so its sums are checked in eval mode; the
    batch statistics of training mode are caught first, on the plain forward replayed with one
    sample replaced."""
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
            self.norm, self.head = BatchStatisticsWhenTraining(), nn.Linear(8, 3)

        def forward(self, x):
            h = self.layer(x)
            return self.head(self.norm((h * torch.normal(torch.ones_like(h), 0.1)).mean(1)))
    torch.manual_seed(0)
    model = Encoder().train()
    engine = _engine(model, 5)
    x, y = torch.randn(5, 4, 8), torch.randint(0, 3, (5,))
    with pytest.raises(EngineError, match="changes sample .* gradient when sample .* is replaced"):
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))


@pytest.mark.parametrize("draw", ["own generator", "numpy"])
def test_a_forward_drawing_what_the_replay_cannot_restore_is_refused(draw):
    """Noise from a generator of its own (or numpy) cannot be drawn again by a replay: the step
    is refused rather than checked in eval mode, where training mode's mixing would not show."""
    np = pytest.importorskip("numpy")

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.norm, self.head = nn.Linear(5, 8), BatchStatisticsWhenTraining(), nn.Linear(8, 3)
            self.generator = torch.Generator().manual_seed(1)

        def forward(self, x):
            h = F.dropout(self.body(x), 0.2, self.training)
            noise = torch.randn(h.shape, generator=self.generator) if draw == "own generator" else \
                torch.from_numpy(np.random.randn(*h.shape)).float()
            return self.head(self.norm(h + 0.01 * noise))
    torch.manual_seed(0)
    model = Noisy().train()
    engine = _engine(model, 6)
    x, y = _data()
    with pytest.raises(EngineError, match="draws random numbers the engine cannot replay") as caught:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert "default generator" in caught.value.hint


class RowCounter(nn.Module):
    """The identity, counting the calls and their batch sizes (not a hook: replays silence hooks)."""

    def __init__(self):
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return x


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_each_checked_sample_costs_one_forward_of_that_sample_alone(dropout):
    """The check's cost is bounded by the checked samples, not the batch: with dropout as without,
    one forward of each checked sample alone (and its backward), no replay of the batch; without
    random draws, every row's outputs once more in the batch's two halves (no backward)."""
    torch.manual_seed(0)
    counter = RowCounter()
    model = nn.Sequential(counter, nn.Linear(5, 8), nn.Dropout(dropout), nn.ReLU(), nn.Linear(8, 3))
    x, y = _data(b=16)
    engine = _engine(model, 16)
    out = model(x)
    counter.calls.clear()              # the step's forward (and the first step's probes) done
    engine.backward(F.cross_entropy(out, y, reduction="none"))
    assert engine.certificate.last.mode == "alone" and engine.certificate.last.rows == 4
    assert counter.calls == [1, 1, 1, 1] + ([] if dropout else [8, 8])


def test_with_dropout_a_row_given_the_wrong_clip_factor_is_refused(monkeypatch):
    real = microbatch.clip_factors
    monkeypatch.setattr(microbatch, "clip_factors", lambda *a, **k: real(*a, **k).roll(1, dims=0))
    model = _mlp(0.3)
    x, y = _data()
    x[0] *= 50
    engine = _engine(model, 6, grouping="layer")
    with pytest.raises(EngineError, match="certificate refused"):
        _step(engine, model, x, y)
    assert engine.certificate.checks == 0


class NoisyInput(nn.Module):
    """Gaussian noise drawn by torch.normal(mean tensor, std): a seeded operation that computes with
    its input, so its draws are not cut per sample: the batch is replayed instead."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(torch.normal(h, 0.1) if self.training else h))


def test_draws_that_cannot_be_cut_are_checked_on_the_replayed_batch():
    torch.manual_seed(0)
    model = NoisyInput()
    x, y = _data()
    engine = _engine(model, 6)
    _step(engine, model, x, y)
    assert engine.certificate.last.mode == "batch"


def test_check_before_training_refuses_an_engine_giving_a_row_the_wrong_norm(monkeypatch):
    real = microbatch.sqrt_or_zero
    monkeypatch.setattr(microbatch, "sqrt_or_zero", lambda sq: real(sq).roll(1, dims=0))
    model = _mlp()
    x, y = _data()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="norms and clipped gradients disagree"):
        engine.certify(lambda: F.cross_entropy(model(x), y, reduction="none"), before="sharding")


def test_check_before_training_refuses_a_mixing_model_naming_the_module():
    model = nn.Sequential(nn.Linear(5, 8), Center(), nn.ReLU(), nn.Linear(8, 3))
    x, y = _data()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match=r"1 \(Center\)"):
        engine.certify(lambda: F.cross_entropy(model(x), y, reduction="none"))


def test_check_before_training_changes_no_step_and_is_reported_once():
    x, y = _data()
    grads = []
    for certify in (False, True):
        model = _mlp()
        engine = _engine(model, 6)
        if certify:
            record = engine.certify(lambda: F.cross_entropy(model(x[2:]), y[2:], reduction="none"), before="sharding")
            assert record.before == "sharding" and record.rows == 4
        first = _step(engine, model, x[:4], y[:4])
        grads.append([p.grad.clone() for p in model.parameters()])
        second = _step(engine, model, x[:4], y[:4])
        assert second.certificate is None
    # the first step's report carries the check before; x[2:] and x[:4] are one shape family and
    # batch size, so the step's own check is not due again
    assert first.to_dict()["certificate"] == {"rows": 4, "mode": "alone", "before": "sharding"}
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_check_before_training_needs_per_sample_losses_from_the_model():
    model = _mlp()
    x, y = _data()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="one loss per row"):
        engine.certify(lambda: F.cross_entropy(model(x), y))
    with pytest.raises(EngineError, match="saw no forward"):
        engine.certify(lambda: torch.ones(3, requires_grad=True))
    assert engine.certificate.forwards == [] and not any(engine._keeper.forward_counts)   # nothing left behind
    report = _step(engine, model, x, y)
    assert report.certificate is not None and report.certificate.rows == 4


class _OneStage:
    """A StageLink of a pipeline of one stage (the engine's protocol, in one process)."""
    flat, num_groups, offset = False, 1, 0

    def all_gather(self, tensor):
        return tensor

    def gather_releases(self, aux):
        return aux

    def sum_norm_sq(self, norm_sq):
        return norm_sq


def test_a_stage_engine_never_checked_whole_refuses_its_first_micro_batch():
    model = _mlp()
    x, y = _data()
    engine = _engine(model, 6, stage=_OneStage())
    generation = engine.start_forward()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with engine.capture(6, generation=generation):
        losses.sum().backward()
    with pytest.raises(EngineError, match="never checked whole") as err:
        engine.finish_micro_batch()
    assert "pipeline_engine" in err.value.hint
    with pytest.raises(EngineError, match="never checked whole"):   # caught and ignored: still nothing out
        engine.privatize()
    assert engine.steps == 0


def test_sharding_a_model_the_certificate_never_checked_is_refused():
    model = _mlp()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="never checked it whole") as err:
        engine.adopt_parameters("sharded")
    assert "engine.certify" in err.value.hint
    x, y = _data()
    engine.certify(lambda: F.cross_entropy(model(x), y, reduction="none"), before="sharding")
    engine.adopt_parameters("sharded")   # checked: the shards are adopted


def test_a_shared_table_as_long_as_the_batch_is_refused_with_how_to_pass_it():
    """A [K, d] table passed beside x is shared; when B == K the replays read it as one row per sample."""
    class Prototypes(nn.Module):
        def __init__(self):
            super().__init__()
            self.encode = nn.Linear(4, 3)

        def forward(self, x, table):
            return self.encode(x) @ table.t()
    torch.manual_seed(0)
    model, table = Prototypes(), torch.randn(5, 3)
    engine = _engine(model, 5)
    x, y = torch.randn(5, 4), torch.randint(0, 5, (5,))
    with pytest.raises(EngineError, match="mixes samples") as caught:
        engine.backward(F.cross_entropy(model(x, table), y, reduction="none"))
    assert "leading dimension 1" in caught.value.hint


class TopTwoOfTheBatch(nn.Module):
    """Adds the mean of the batch's two largest activations: runs on two samples or more only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.head = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.lin(x)
        return self.head(h + h.topk(2, dim=0).values.mean(0))


def test_a_forward_that_needs_other_samples_to_run_is_refused_with_a_hint_naming_such_operations():
    model = TopTwoOfTheBatch()
    x, y = _data()
    engine = _engine(model, 6)
    with pytest.raises(EngineError) as err:
        _step(engine, model, x, y)
    assert "topk" in err.value.hint and "mixes samples" in err.value.hint
