"""A buffer the training forward writes alike whatever the batch (a counter ``+= 1``, spectral_norm's
power iteration) passes the certificate, but it advances once per forward, and the number of
forwards depends on the realised Poisson batch sizes (ceil(B_t/m) micro-batches in step t, none
for an empty draw), which ε does not cover. It is saved with the weights, so every privacy
statement of the run names it "not covered by ε"; a non-persistent buffer is not saved and not
named (docs/certificate.md, docs/accounting.md "Threat model").
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.engine import DPEngine

LINE = "model state written by each training forward"


class Counting(nn.Module):
    """A Linear with a buffer counting its training forwards."""

    def __init__(self, persistent: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=persistent)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.calls += 1
        return self.lin(x)


class Spectral(nn.Module):
    def __init__(self, converged: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 3))
        if not converged:   # a weight whose power iteration has not converged (as after an update)
            with torch.no_grad():
                self.lin.parametrizations.weight.original.add_(torch.randn(3, 5))

    def forward(self, x):
        return self.lin(x)


class CountsLater(Counting):
    """Counts only from its third training forward on: after the certificate's first-step check."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def forward(self, x):
        self.seen += self.training
        if self.training and self.seen > 2:
            with torch.no_grad():
                self.calls += 1
        return self.lin(x)


def _engine_step(model, micro: int = 4) -> set[str]:
    x, y = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)), torch.randint(0, 3, (8,))
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=8, seed=0)
    try:
        for rows in torch.arange(8).split(micro):
            engine.backward(F.cross_entropy(model(x[rows]), y[rows], reduction="none"))
        engine.privatize()
        assert engine.certificate.checks == 1
        restored = DPEngine(Counting(), {"threshold": {"kind": "fixed", "value": 1.0}},
                            gradient_noise_multiplier=1.0, expected_batch_size=8, seed=0)
        restored.load_state_dict(engine.state_dict())   # a resume keeps what the run saw
        assert restored.forward_written_state == engine.forward_written_state
        restored.detach()
        return engine.forward_written_state
    finally:
        engine.detach()


def test_the_engine_names_the_persistent_buffers_a_checked_forward_wrote():
    assert _engine_step(Counting()) == {"calls"}
    assert _engine_step(Spectral()) == {"lin.parametrizations.weight.0._u", "lin.parametrizations.weight.0._v"}


def test_a_write_no_check_sees_is_named_too():
    """Every training forward is watched (each saved buffer's object and in-place write count), not only
    the checked ones: spectral_norm converged at init leaves _u, _v as they were on the first step's
    check, yet writes them in place each forward; a counter may start after the check."""
    assert _engine_step(Spectral(converged=True)) == {"lin.parametrizations.weight.0._u",
                                                      "lin.parametrizations.weight.0._v"}
    assert _engine_step(CountsLater(), micro=2) == {"calls"}   # forwards 3 and 4 of one step: unchecked


class CopiesAnOutlier(Counting):
    """Writes its buffer every training forward, the batch's first row only when some entry is above
    100: alike whatever the (ordinary) batch on a checked forward, a raw row on an unchecked one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("stat", torch.zeros(5))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.stat.copy_(torch.where(x.abs().amax() > 100, x[0], self.stat))
        return self.lin(x)


def test_a_buffer_written_alike_on_checked_forwards_is_named_with_what_the_check_covers():
    """The certificate checks a write's independence of the batch on the forwards it checks; an
    unchecked forward's outlier lands raw in the saved buffer. The statement says both."""
    from dpclip.planning.plan import forward_state_line

    model = CopiesAnOutlier()
    written = _engine_step(model)   # the certificate's check passes: ordinary rows leave stat as it was
    assert written == {"stat"}
    outlier = torch.randn(4, 5)
    outlier[0] = 1e3
    model.train()
    model(outlier)   # an unchecked forward (no engine): the row is now in the weights file
    assert torch.equal(model.stat, outlier[0])
    line, = forward_state_line(written)
    assert "stat" in line and "checked forwards only" in line and "not between them" in line


def test_a_non_persistent_counter_is_not_named():
    assert _engine_step(Counting(persistent=False)) == set()


def _make_private_run(persistent: bool, tmp_path):
    x = torch.randn(64, 5, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(3))
    model = Counting(persistent)
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  DataLoader(TensorDataset(x, y), batch_size=32), criterion=nn.CrossEntropyLoss(),
                                  noise_multiplier=1.0, delta=1e-5, steps=3, max_grad_norm=1.0,
                                  max_physical_batch_size=8)
    model, opt, crit, loader = private
    for xb, yb in loader:
        opt.zero_grad()
        crit(model(xb), yb).backward()
        opt.step()
    privacy = json.loads((private.save(tmp_path) / "privacy.json").read_text())
    return private.statement(), privacy


def test_make_privates_statement_and_privacy_json_name_a_persistent_counter_not_covered(tmp_path):
    statement, privacy = _make_private_run(True, tmp_path)
    named = [line for line in statement if LINE in line]
    assert len(named) == 1 and "buffers calls" in named[0] and "realised batch sizes" in named[0]
    assert any(LINE in item and "calls" in item for item in privacy["not_covered_by_epsilon"])
    assert any(LINE in line for line in privacy["statement"])


def test_make_private_names_no_non_persistent_counter(tmp_path):
    statement, privacy = _make_private_run(False, tmp_path)
    assert not any(LINE in line for line in statement + privacy["not_covered_by_epsilon"])


def test_a_dptrainers_privacy_json_names_a_buffer_a_submodules_forward_counts(tmp_path):
    """DPTrainer states what make_private states (the same Account): a counter in the forward of one
    of the model's layers, saved with the weights, is named not covered by ε in privacy.json."""
    from tests.integrations.test_transformers import _bert, _trainer

    model = _bert()
    embeddings = model.bert.embeddings
    embeddings.register_buffer("calls", torch.zeros((), dtype=torch.long))

    class CountingEmbeddings(type(embeddings)):
        def forward(self, *args, **kwargs):
            if self.training:
                with torch.no_grad():
                    self.calls += 1
            return super().forward(*args, **kwargs)
    embeddings.__class__ = CountingEmbeddings
    trainer = _trainer(tmp_path, model=model, max_steps=2)
    trainer.train()
    assert int(embeddings.calls) >= 2
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    named = [item for item in privacy["not_covered_by_epsilon"] if LINE in item]
    assert len(named) == 1 and "bert.embeddings.calls" in named[0]


COUNTING_MODEL = """
    import torch
    from torch import nn

    class Count(nn.Module):
        def __init__(self, persistent):
            super().__init__()
            self.fc = nn.Linear(64, 10)
            self.register_buffer("calls", torch.zeros(()), persistent=persistent)

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.calls += 1
            return self.fc(x.flatten(1))

    def build(input_shape, num_classes, persistent=True):
        return Count(persistent)
"""


def _cli_run(small_recipe, tmp_path, monkeypatch, persistent: bool):
    from dpclip.rundir.run import spent
    from dpclip.train.workflow import train

    (tmp_path / "countmodel.py").write_text(textwrap.dedent(COUNTING_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = train(small_recipe(f"model={{kind: custom, target: 'countmodel:build', kwargs: {{persistent: "
                                f"{str(persistent).lower()}}}}}", "training.micro_batch_size=8",
                                "eval.every_steps=null"))
    summary = json.loads((result.run_dir / "summary.json").read_text())
    return result.run_dir, summary, spent(result.run_dir)[1]


@pytest.mark.slow
def test_a_cli_runs_counter_counts_its_micro_batches_and_every_statement_names_it(small_recipe, tmp_path,
                                                                                  monkeypatch):
    from safetensors.torch import load_file

    run_dir, summary, statement = _cli_run(small_recipe, tmp_path, monkeypatch, True)
    # what an attacker holding the weights reads: Σ_t ceil(B_t/8) of the realised Poisson batch sizes
    sizes = [json.loads(line)["diagnostics"]["batch_size"] for line in (run_dir / "metrics.jsonl").open()
             if '"step"' in line and '"eval"' not in line]
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    calls = load_file(run_dir / "checkpoints" / latest / "model.safetensors")["calls"]
    assert len(sizes) == 12 and int(calls) == sum(math.ceil(b / 8) for b in sizes)
    assert json.loads((run_dir / "plan.json").read_text())["forward_written_state"] == ["calls"]
    for lines in (summary["statement"], statement.lines()):
        assert sum(LINE in line and "buffers calls" in line for line in lines) == 1


@pytest.mark.slow
def test_a_cli_run_with_a_non_persistent_counter_states_no_written_state(small_recipe, tmp_path, monkeypatch):
    run_dir, summary, statement = _cli_run(small_recipe, tmp_path, monkeypatch, False)
    assert "forward_written_state" not in json.loads((run_dir / "plan.json").read_text())
    assert not any(LINE in line for line in summary["statement"] + statement.lines())
