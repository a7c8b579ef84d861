"""The Hessian diagnostics in training: the recipe block, diagnostics.jsonl, labels, privacy."""

import json

import pytest
import torch

from dpclip.diagnose import HessianDiagnostics
from dpclip.errors import DpclipError, RecipeError
from dpclip.train import diagnostics as diagnostics_module
from dpclip.train.diagnostics import DIAGNOSTICS_FILE, MEASURED, choose_rows, make_record, read_records
from dpclip.train.diagnostics_plots import HESSIAN_PLOT
from dpclip.planning.plan import PRIVATE_HESSIAN_DIAGNOSTICS
from dpclip.train.parts import assemble
from dpclip.train.workflow import train

PRIVATE = ("diagnostics.data=private", "diagnostics.private_not_covered=true")


def test_private_diagnostics_are_refused_without_the_opt_in(small_recipe):
    with pytest.raises(RecipeError, match="private_not_covered: true") as refused:
        small_recipe("diagnostics.data=private")
    assert "not cover" in refused.value.message and refused.value.hint


def test_public_diagnostics_need_public_data(small_recipe):
    small_recipe()  # diagnostics off: the default data: public asks for nothing
    with pytest.raises(RecipeError, match="needs public data"):
        small_recipe("diagnostics.every_steps=4")


def test_choose_rows_refuses_private_rows_without_consent_and_missing_public_rows():
    private, public = {"x": torch.zeros(3)}, {"x": torch.ones(3)}
    assert choose_rows("public", private_rows=private, public_rows=public, allow_private=False) is public
    assert choose_rows("private", private_rows=private, public_rows=None, allow_private=True) is private
    with pytest.raises(DpclipError, match="not covered by ε") as refused:
        choose_rows("private", private_rows=private, public_rows=public, allow_private=False)
    assert "--allow-private-not-covered-by-epsilon" in refused.value.hint
    with pytest.raises(DpclipError, match="no public data") as missing:
        choose_rows("public", private_rows=private, public_rows=None, allow_private=True)
    assert "public:" in missing.value.hint


def test_records_on_private_data_are_labelled_and_public_ones_covered():
    diag = HessianDiagnostics(1.0, 0.1, 2.0, 3.0, 4.0, 5.0, 8, 4, 4)
    private = make_record(3, diag, {"b_star_dp": float("inf")}, "private")
    assert private["covered_by_epsilon"] is False and private["data"] == "private"
    assert set(private["not_covered_by_epsilon"]) == set(MEASURED)
    assert private["b_star_dp"] is None  # JSON has no inf
    json.dumps(private, allow_nan=False)
    public = make_record(3, diag, {}, "public")
    assert public["covered_by_epsilon"] is True and "not_covered_by_epsilon" not in public


@pytest.mark.slow  # an end-to-end run: the slow set (README)
def test_diagnostics_jsonl_gets_a_labelled_record_every_k_steps(small_recipe, one_thread):
    result = train(small_recipe("diagnostics.every_steps=4", "diagnostics.probes=4", "diagnostics.per_sample=4",
                                *PRIVATE))
    records = read_records(result.run_dir / DIAGNOSTICS_FILE)
    assert [r["step"] for r in records] == [4, 8, 12]
    for record in records:
        assert record["data"] == "private" and record["covered_by_epsilon"] is False
        assert set(record["not_covered_by_epsilon"]) == set(MEASURED)
        assert record["probes"] == 4 and record["per_sample"] == 4 and record["batch_size"] == 64
        assert record["gradient_noise_multiplier"] == pytest.approx(result.noise["gradient_noise_multiplier"])
        assert record["decelerator"] == pytest.approx(
            record["gradient_noise_multiplier"] ** 2 * record["trace_h"] / (64 * record["clip_factor"] ** 2))
        assert record["alpha_star"] is None  # no public data
    assert PRIVATE_HESSIAN_DIAGNOSTICS in result.statement[-1]
    assert (result.run_dir / HESSIAN_PLOT).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # an end-to-end run: the slow set (README)
def test_measuring_does_not_change_what_training_does(small_recipe, one_thread):
    """Same seeded noise and batches: the run with diagnostics every 2 steps trains exactly
    as the run without (eval mode, no gradients left, the engine's book-keeping intact)."""
    seeded = ("privacy.unsafe_seeded_randomness=true", "eval.every_steps=null")
    plain = train(small_recipe(*seeded))
    measured = train(small_recipe(*seeded, "diagnostics.every_steps=2", "diagnostics.probes=2",
                                  "diagnostics.per_sample=2", *PRIVATE))

    def losses(run):
        records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["diagnostics"]["train_loss"] for r in records if "diagnostics" in r]

    assert len(losses(plain)) == 12 and losses(measured) == losses(plain)
    assert len(read_records(measured.run_dir / DIAGNOSTICS_FILE)) == 6


def test_a_resumed_run_does_not_measure_a_step_twice(small_recipe, one_thread, tmp_path):
    trainer = assemble(small_recipe("diagnostics.every_steps=4", "diagnostics.probes=2", "diagnostics.per_sample=2",
                                    *PRIVATE))
    try:
        path = tmp_path / DIAGNOSTICS_FILE
        path.write_text(json.dumps({"step": 8, "data": "private"}) + "\n")
        trainer.diagnostics.maybe_record(4, tmp_path)   # before the last record: a replayed step
        trainer.diagnostics.maybe_record(8, tmp_path)
        trainer.diagnostics.maybe_record(10, tmp_path)  # not a multiple of every_steps
        assert [r["step"] for r in read_records(path)] == [8]
        trainer.diagnostics.maybe_record(12, tmp_path)
        assert [r["step"] for r in read_records(path)] == [8, 12]
    finally:
        trainer.learner.engine.detach()


def test_the_probes_and_rows_come_from_a_private_generator_not_the_seed(small_recipe, monkeypatch):
    asked = []
    real = diagnostics_module.private_generator
    monkeypatch.setattr(diagnostics_module, "private_generator",
                        lambda seed, purpose, *a: asked.append((seed, purpose)) or real(seed, purpose, *a))
    trainer = assemble(small_recipe("seed=7", "diagnostics.every_steps=4", *PRIVATE))
    trainer.learner.engine.detach()
    assert asked == [(None, "hessian-diagnostics")]  # OS entropy: the recipe's seed 7 is not used
