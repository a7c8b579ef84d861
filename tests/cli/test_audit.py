import hashlib
import json
from pathlib import Path

import pytest

from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[2]


def _train_tiny(output_dir: Path, *overrides) -> Path:
    """A 12-step quickstart run (plumbing only, not statistics)."""
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml",
                         [f"output_dir={output_dir}", "training.epochs=null", "training.steps=12",
                          "checkpoint.every_steps=6", "checkpoint.keep=3", "eval.every_steps=null",
                          "data.test_fraction=0.5", "privacy.accountant=rdp", *overrides])
    return train(recipe).run_dir


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """One run without canaries, shared by the tests that only read it (audits write under audit/)."""
    return _train_tiny(tmp_path_factory.mktemp("runs"))


@pytest.fixture
def tiny_run(tmp_path):
    return lambda *overrides: _train_tiny(tmp_path / "runs", *overrides)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_loss_and_logistic_report_as_json_and_leave_the_ledger_alone(cli, plain_run):
    run = plain_run
    before = digest(run / "ledger.json")
    result = cli("audit-mia", run, "--attack", "loss", "--attack", "logistic", "--bootstrap", "20", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert set(report["attacks"]) == {"loss", "logistic"}
    for metrics in report["attacks"].values():
        assert 0 <= metrics["auc"] <= 1 and len(metrics["auc_ci95"]) == 2
        assert {"tpr_at_0.1%_fpr", "tpr_at_1%_fpr", "balanced_accuracy", "advantage"} <= set(metrics)
    assert json.loads((run / "audit" / "report.json").read_text())["attacks"].keys() == report["attacks"].keys()
    assert (run / "audit" / "roc.png").exists()
    assert digest(run / "ledger.json") == before


def test_one_run_without_canaries_explains_how_to_add_them(cli, plain_run):
    result = cli("audit-mia", plain_run, "--attack", "one-run")
    assert result.code == 2
    assert "without canaries" in result.err and "hint:" in result.err and "audit.canaries" in result.err
    assert "Traceback" not in result.err


def test_exposure_without_planted_secrets_and_lira_with_one_shadow_are_refused_with_a_hint(cli, plain_run):
    result = cli("audit-mia", plain_run, "--attack", "exposure")
    assert result.code == 2 and "without planted secrets" in result.err and "audit: {exposure" in result.err
    result = cli("audit-mia", plain_run, "--attack", "lira", "--shadows", "1")
    assert result.code == 2 and "at least two shadow models" in result.err and "hint:" in result.err
    assert "Traceback" not in result.err


def test_rmia_with_one_shadow_is_refused_before_any_shadow_trains(cli, plain_run):
    # RMIA's reference models are LiRA's shadows, each example in ⌊M/2⌋ of them: one shadow trained
    # on nothing and the audit died with "unexpected ZeroDivisionError"
    result = cli("audit-mia", plain_run, "--attack", "rmia", "--shadows", "1")
    assert result.code == 2 and "at least two" in result.err and "hint:" in result.err
    assert "unexpected" not in result.err and "Traceback" not in result.err
    assert not (plain_run / "audit" / "shadows").exists()


@pytest.mark.slow
def test_a_run_whose_held_out_rows_all_became_mislabel_canaries_is_refused_with_a_hint(cli, tiny_run):
    # 18 held-out rows, all 18 taken by mislabel canaries: no non-member was left to score, and the
    # loss attack died with "unexpected ZeroDivisionError" (the logistic attack in sklearn)
    run = tiny_run("data.test_fraction=0.01", "audit.canaries.count=18", "audit.canaries.kind=mislabel",
                   "training.steps=2", "checkpoint.every_steps=null")
    for attack in ("loss", "logistic"):
        result = cli("audit-mia", run, "--attack", attack, "--bootstrap", "0")
        assert result.code == 2 and "0 non-member rows" in result.err and "data.test_fraction" in result.err
        assert "unexpected" not in result.err and "Traceback" not in result.err
    assert not (run / "audit" / "report.json").exists()
    assert cli("audit-mia", run, "--attack", "one-run", "--json").code == 0   # needs no non-members


def test_auditing_a_shadow_model_points_at_the_run_it_imitates(cli, plain_run, tmp_path):
    # A shadow is a run directory trained on a subset handed to it, so its split never matches its
    # recipe's: the hint said "the data files changed since the run", sending the user after their data.
    import shutil

    shadow = tmp_path / "run" / "audit" / "shadows" / "shadow_000"
    shutil.copytree(plain_run, shadow, ignore=shutil.ignore_patterns("audit"))
    meta = json.loads((shadow / "meta.json").read_text())
    meta["data"]["split_fingerprint"] = "0" * 16          # as a shadow's own subset has
    (shadow / "meta.json").write_text(json.dumps(meta))
    result = cli("audit-mia", shadow, "--attack", "loss", "--bootstrap", "0")
    assert result.code == 2 and "shadow models" in result.err and str(tmp_path / "run") in result.err
    assert "data files changed" not in result.err and "Traceback" not in result.err


def test_a_negative_seed_is_refused_with_a_hint_not_a_crash(cli, plain_run):
    # numpy's SeedSequence refused it deep in the attack: "unexpected ValueError", exit 1
    result = cli("audit-mia", plain_run, "--attack", "loss", "--seed", "-5")
    assert result.code == 2 and "--seed" in result.err and "hint:" in result.err
    assert "unexpected" not in result.err and "Traceback" not in result.err


def test_a_checkpoint_directory_is_audited_with_its_own_ledger(cli, plain_run):
    run = plain_run
    final = json.loads(cli("audit-mia", run, "--attack", "loss", "--bootstrap", "0", "--json").out)
    early = cli("audit-mia", run / "checkpoints" / "step_000006", "--attack", "loss", "--bootstrap", "0", "--json")
    assert early.code == 0, early.err
    report = json.loads(early.out)
    assert report["checkpoint"] == "step_000006" and report["step"] == 6
    assert report["ledger"]["epsilon"] < final["ledger"]["epsilon"]


@pytest.mark.slow   # 4-7 s: the default run keeps under 10 minutes
def test_all_attacks_show_a_table_and_shadows_are_reused(cli, tiny_run):
    run = tiny_run("audit.canaries.count=40", "audit.canaries.kind=mislabel")
    result = cli("audit-mia", run, "--shadows", "2", "--bootstrap", "20")
    assert result.code == 0, result.err
    for text in ("loss", "logistic", "lira-online", "lira-offline", "rmia-online", "rmia-offline", "DP bound",
                 "one-run audit"):
        assert text in result.out
    shadows = run / "audit" / "shadows"
    assert (shadows / "keep.json").exists()
    done = shadows / "shadow_000" / "summary.json"
    stamp = done.stat().st_mtime_ns
    # An interrupted audit: shadow 1 lost its summary; a rerun finishes it and reuses shadow 0.
    (shadows / "shadow_001" / "summary.json").unlink()
    again = cli("audit-mia", run, "--attack", "lira", "--shadows", "2", "--bootstrap", "0", "--json")
    assert again.code == 0, again.err
    assert done.stat().st_mtime_ns == stamp
    assert (shadows / "shadow_001" / "summary.json").exists()
    other = cli("audit-mia", run, "--attack", "lira", "--shadows", "3")
    assert other.code == 2 and "--shadows 2" in other.err


def test_a_folder_that_is_not_a_run_is_an_error(cli, tmp_path):
    result = cli("audit-mia", tmp_path, "--attack", "loss")
    assert result.code == 2 and "neither a run directory" in result.err


def test_the_audit_table_says_its_figures_are_not_covered_by_epsilon(cli, plain_run):
    result = cli("audit-mia", plain_run, "--attack", "loss", "--bootstrap", "0")
    assert result.code == 0 and "(not covered by ε)" in " ".join(result.out.split())
    # report.json keeps the TPR the ledger allows at 1% FPR: min(e^ε·FPR + δ, 1 − e^−ε·(1 − δ − FPR))
    import math
    ledger = json.loads((plain_run / "audit" / "report.json").read_text())["ledger"]
    eps, delta = ledger["epsilon"], ledger["delta"]
    allowed = min(math.exp(eps) * 0.01 + delta, 1 - math.exp(-eps) * (1 - delta - 0.01), 1.0)
    assert ledger["tpr_bound"]["fpr_1%"] == pytest.approx(allowed)


def test_the_report_file_carries_its_label_and_no_earlier_audits_curves(cli, tiny_run):
    run = tiny_run("audit.canaries.count=40")
    assert cli("audit-mia", run, "--attack", "loss", "--bootstrap", "0").code == 0
    assert (run / "audit" / "roc.png").exists()
    result = cli("audit-mia", run, "--attack", "one-run", "--json")
    assert result.code == 0, result.err
    for report in (json.loads(result.out), json.loads((run / "audit" / "report.json").read_text())):
        assert "private data" in report["not_covered_by_epsilon"] and not report["attacks"]
    assert not (run / "audit" / "roc.png").exists()   # the loss attack's curves, not this report's


@pytest.mark.parametrize("damage", ["answer key not JSON", "answer key empty", "meta.json gone"])
def test_a_damaged_run_file_is_named_with_a_hint(cli, tiny_run, damage):
    run = tiny_run("audit.canaries.count=40")
    if damage == "meta.json gone":
        (run / "meta.json").unlink()
    else:
        (run / "audit" / "canaries.json").write_text("{" if damage == "answer key not JSON" else "{}")
    result = cli("audit-mia", run, "--attack", "loss", "--bootstrap", "0")
    assert result.code == 2, (result.code, result.err)
    assert "damaged" in result.err and "hint:" in result.err and "unexpected" not in result.err


@pytest.fixture(scope="module")
def canary_runs(tmp_path_factory):
    """One run of each canary kind, shared: each test damages a copy (:func:`copied`)."""
    output = tmp_path_factory.mktemp("canary-runs")
    return {kind: _train_tiny(output, "audit.canaries.count=40", f"audit.canaries.kind={kind}")
            for kind in ("mislabel", "ood")}


def copied(run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp_path / run.name))


def test_inclusion_bits_written_as_text_are_refused_not_read_as_true(cli, canary_runs, tmp_path):
    run = copied(canary_runs["ood"], tmp_path)
    key = json.loads((run / "audit" / "canaries.json").read_text())
    key["included"] = ["no"] * len(key["included"])
    (run / "audit" / "canaries.json").write_text(json.dumps(key))
    result = cli("audit-mia", run, "--attack", "one-run")
    assert result.code == 2, (result.code, result.err)
    assert "canaries.json is damaged" in result.err and "hint:" in result.err and "unexpected" not in result.err


def test_a_file_in_place_of_the_audit_folder_is_named_with_a_hint(cli, canary_runs, tmp_path):
    import shutil

    run = copied(canary_runs["ood"], tmp_path)
    shutil.rmtree(run / "audit")
    (run / "audit").write_text("x")
    result = cli("audit-mia", run, "--attack", "loss", "--bootstrap", "0")
    assert result.code == 2, (result.code, result.err)
    assert "is a file" in result.err and "hint:" in result.err and "unexpected" not in result.err


def test_a_deleted_answer_key_is_named_deleted_not_a_run_without_canaries(cli, canary_runs, tmp_path):
    run = copied(canary_runs["ood"], tmp_path)
    (run / "audit" / "canaries.json").unlink()
    result = cli("audit-mia", run, "--attack", "one-run")
    assert result.code == 2 and "deleted" in result.err and "restore it" in result.err
    assert "without canaries" not in result.err and "add canaries" not in result.err
    # ood canaries are no held-out rows: the other attacks still run
    assert cli("audit-mia", run, "--attack", "loss", "--bootstrap", "0").code == 0


def test_a_mislabel_run_whose_answer_key_was_deleted_is_not_audited(cli, canary_runs, tmp_path):
    """Its trained-on held-out rows are unknown: scoring them as non-members would be silent and wrong."""
    run = copied(canary_runs["mislabel"], tmp_path)
    (run / "audit" / "canaries.json").unlink()
    result = cli("audit-mia", run, "--attack", "loss", "--bootstrap", "0")
    assert result.code == 2, (result.code, result.err)
    assert "deleted" in result.err and "non-members" in result.err and "hint:" in result.err


def test_the_one_run_table_states_the_condition_of_the_fdp_bound(cli, canary_runs, tmp_path):
    result = cli("audit-mia", copied(canary_runs["ood"], tmp_path), "--attack", "one-run")
    assert result.code == 0, result.err
    assert "a lower bound only if the trade-off curve is Gaussian" in " ".join(result.out.split())


def test_an_audit_of_a_shuffled_run_sets_the_poisson_caveat_beside_the_ledgers_epsilon(cli, tiny_run):
    from dpclip.accounting.statement import SHUFFLE_CAVEAT

    run = tiny_run("training.sampling=shuffle")
    result = cli("audit-mia", run, "--attack", "loss", "--bootstrap", "20", "--json")
    assert result.code == 0, result.err
    assert any(SHUFFLE_CAVEAT in note for note in json.loads(result.out)["notes"])
    shown = cli("audit-mia", run, "--attack", "loss", "--bootstrap", "20")
    assert SHUFFLE_CAVEAT in " ".join(shown.out.split())


def _flagging_bound(monkeypatch):
    """The one-run audit's bound replaced by one far above any ledger ε: a flagged report without
    training an under-noised run (tests/audit/test_claims.py trains that one)."""
    from dpclip.audit import report as audit_report

    real = audit_report.one_run_audit

    def flagging(*args, **kwargs):
        return {**real(*args, **kwargs), "epsilon_lower_bound": 1e3}

    monkeypatch.setattr(audit_report, "one_run_audit", flagging)


def test_fail_if_flagged_exits_3_with_an_error_after_printing_the_report(cli, canary_runs, tmp_path, monkeypatch):
    run = copied(canary_runs["ood"], tmp_path)
    _flagging_bound(monkeypatch)
    plain = cli("audit-mia", run, "--attack", "one-run", "--json")
    assert plain.code == 0 and json.loads(plain.out)["flagged"] is True   # the default stays: a report, exit 0
    gated = cli("audit-mia", run, "--attack", "one-run", "--json", "--fail-if-flagged")
    assert gated.code == 3, (gated.code, gated.err)
    assert json.loads(gated.out)["flagged"] is True   # the report is printed (and written) first
    assert json.loads((run / "audit" / "report.json").read_text())["flagged"] is True
    err = " ".join(gated.err.split())
    assert "error: the one-run audit flagged the run" in err and "hint:" in err and "Traceback" not in err
    table = cli("audit-mia", run, "--attack", "one-run", "--fail-if-flagged")
    assert table.code == 3 and "exceeds the ledger's ε" in " ".join(table.out.split())


def test_fail_if_flagged_passes_an_unflagged_run(cli, canary_runs, tmp_path):
    result = cli("audit-mia", copied(canary_runs["ood"], tmp_path), "--attack", "one-run", "--json",
                 "--fail-if-flagged")
    assert result.code == 0, result.err
    assert json.loads(result.out)["flagged"] is False


def test_fail_if_flagged_without_the_one_run_audit_is_refused_before_attacking(cli, plain_run):
    """A gate that cannot fail would pass silently: no canaries, or no one-run attack asked."""
    for attacks in (["--attack", "loss"], ["--attack", "all"]):
        result = cli("audit-mia", plain_run, *attacks, "--fail-if-flagged")
        assert result.code == 2, (result.code, result.err)
        err = " ".join(result.err.split())
        assert "--fail-if-flagged needs the one-run audit" in err and "hint:" in err and "--attack one-run" in err
    assert "no canaries" in err   # `all` says why the one-run audit is out


def test_a_one_run_audit_of_another_checkpoint_than_the_last_notes_multiple_testing(cli, canary_runs, tmp_path):
    run = copied(canary_runs["ood"], tmp_path)

    def notes(target, *options):
        result = cli("audit-mia", target, "--attack", "one-run", "--json", *options)
        assert result.code == 0, result.err
        return " ".join(json.loads(result.out)["notes"])

    assert "multiple testing" not in notes(run / "checkpoints" / "step_000006")   # no earlier audit recorded
    assert "multiple testing" not in notes(run / "checkpoints" / "step_000006")   # the same checkpoint again
    # an audit without the one-run attack overwrites report.json: the earlier one-run audit is still counted
    assert cli("audit-mia", run, "--attack", "loss", "--bootstrap", "0", "--json").code == 0
    later = notes(run, "--confidence", "0.975")                                     # LATEST: step_000012
    assert "earlier one-run audits: step_000006" in later and "multiple testing" in later
    assert "(n = 2 so far)" in later
    assert "--confidence 1 − 0.025/n" in later
    assert json.loads((run / "audit" / "report.json").read_text())["one_run"]["confidence"] == 0.975


def test_a_confidence_outside_zero_one_is_refused_with_a_hint(cli, plain_run):
    result = cli("audit-mia", plain_run, "--attack", "loss", "--confidence", "1.5")
    assert result.code == 2 and "between 0 and 1" in result.err and "hint:" in result.err
