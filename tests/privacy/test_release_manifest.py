"""Every file a run leaves is in the release manifest (dpclip/release/; issue 26).

Each test makes a real directory of one kind (train with every optional output, report,
audit, export; a search; LiRA shadows; transformers and LoRA exports), walks it, and fails
on any file the manifest does not class. A file dropped into a run directory without an
entry is reported, so a new output cannot ship without someone deciding what it releases.
"""

import fnmatch
import json
import re
from pathlib import Path

import pytest
import torch

from dpclip import release
from dpclip.accounting import tuning as accounting_tuning
from dpclip.export import export_run
from dpclip.recipe import apply_overrides, read_yaml, validate_recipe
from dpclip.train.workflow import train
from dpclip.tuning.cost import StepTimer, tune_cost
from dpclip.tuning.search import run_search
from tests.export.conftest import gpt2_run, lora_run  # noqa: F401  (fixtures: tiny transformers runs)

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# Every optional output of a one-process run: checkpoints, evaluation, canaries,
# TensorBoard, Hessian diagnostics on private data (labelled).
EVERYTHING = ["audit.canaries.count=20", "audit.canaries.kind=ood", "logging.tensorboard=true",
              "eval.every_steps=2", "diagnostics.every_steps=2", "diagnostics.probes=2",
              "diagnostics.per_sample=2", "diagnostics.data=private", "diagnostics.private_not_covered=true"]


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


@pytest.fixture
def full_run(tiny_recipe, cli, tmp_path):
    """A trained run with every optional output, then `report`, `audit-mia` and `export` on it."""
    run_dir = train(tiny_recipe(*EVERYTHING)).run_dir
    assert cli("report", run_dir).code == 0
    assert cli("audit-mia", run_dir, "--attack", "loss", "--attack", "one-run", "--bootstrap", "0").code == 0
    out = tmp_path / "exported"
    assert cli("export", run_dir, out).code == 0
    return run_dir, out


def test_no_file_of_a_run_its_audit_or_its_export_is_readable_by_others(full_run):
    """One rule for every file, whatever the manifest classes it as: owner only (0600). Before,
    metrics.jsonl, training.png and audit/roc.png (not covered by ε), the checkpoints' generator
    states and the tensorboard events were 0644."""
    import stat

    run_dir, out = full_run
    for root in (run_dir, out):
        opened = [f"{p.relative_to(root)} {stat.filemode(p.stat().st_mode)}" for p in root.rglob("*")
                  if p.is_file() and p.stat().st_mode & 0o077]
        assert opened == [], opened
    assert not run_dir.stat().st_mode & 0o077


def test_every_file_of_a_run_with_every_output_report_audit_and_export_is_in_the_manifest(full_run):
    run_dir, out = full_run
    files = _files(run_dir)
    # the run really wrote each kind of output the manifest must cover
    for expected in ("meta.json", "ledger.json", "metrics.jsonl", "summary.json", "training.png",
                     "thresholds.png", "diagnostics.jsonl", "hessian_over_training.png", "report.html",
                     "audit/canaries.json", "audit/report.json", "audit/roc.png", "checkpoints/LATEST",
                     "checkpoints/step_000004/state.json", "checkpoints/step_000004/model.safetensors"):
        assert expected in files
    assert any(f.startswith("tensorboard/") for f in files)
    assert release.directory_kind(run_dir) == release.RUN
    assert release.unlisted(run_dir) == []
    assert release.unlisted_fields(run_dir) == []
    assert release.directory_kind(out) == release.EXPORT
    assert "privacy.json" in _files(out)
    assert release.unlisted(out) == []
    assert release.unlisted_fields(out) == []


def test_the_secret_files_of_a_run_are_classed_secret_and_the_weights_released():
    assert release.classify("meta.json").release == release.SECRET
    assert release.classify("audit/canaries.json").release == release.SECRET
    assert release.classify("audit/exposure.json").release == release.SECRET
    assert release.classify("checkpoints/step_000004/state.json").release == release.SECRET
    assert release.classify("checkpoints/step_000004/state.safetensors").release == release.SECRET
    assert release.classify("audit/shadows/shadow_000/checkpoints/step_000002/model.safetensors").release \
        == release.SECRET
    assert release.classify("checkpoints/step_000004/model.safetensors").release == release.RELEASED
    # a search's trial is a run directory: its generator states stay secret
    assert release.classify("runs/q-trial-1/checkpoints/step_000002/state.json", release.SEARCH).release \
        == release.SECRET
    # an export has no secret entry at all, and a run's secrets are not export entries
    assert not [e for e in release.MANIFEST if e.directory == release.EXPORT and e.release == release.SECRET]
    assert release.classify("meta.json", release.EXPORT) is None
    assert release.classify("state.json", release.EXPORT) is None



def test_a_tokenizers_config_in_an_export_is_labelled_as_the_tokenizer_not_as_a_model_config():
    # tokenizer_config.json also matches *config.json: the tokenizer's label must win
    assert release.classify("tokenizer_config.json", release.EXPORT).release == release.LABELLED
    assert release.classify("adapter_config.json", release.EXPORT).release == release.RELEASED


@pytest.mark.parametrize("name, label", [("spiece.model", "labelled"), ("sentencepiece.bpe.model", "labelled"),
                                         ("added_tokens.json", "labelled"),
                                         ("model-00001-of-00002.safetensors", "released"),
                                         ("model.safetensors.index.json", "released")])
def test_files_save_pretrained_can_add_to_an_export_are_in_the_manifest(name, label):
    # sentencepiece and slow tokenizers' files, and transformers' shards of a large model
    entry = release.classify(name, release.EXPORT)
    assert entry is not None and entry.release == {"labelled": release.LABELLED, "released": release.RELEASED}[label]

NEW_FILES = ["rng_state.pt", ".noise_state.json", "checkpoints/step_000002/sampler.json", "audit/answers.json",
             "tensorboard/extra.json", "runs/x/meta.json"]


def test_a_new_file_dropped_into_a_run_directory_is_reported_unlisted(tiny_recipe):
    run_dir = train(tiny_recipe()).run_dir
    assert release.unlisted(run_dir) == []
    for new_file in NEW_FILES:
        path = run_dir / new_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
        assert release.unlisted(run_dir, release.RUN) == [new_file]
        path.unlink()
    # an interrupted atomic write's dot-named temporary file is not an output
    (run_dir / ".summary.json.abc.tmp").write_text("{}")
    (run_dir / "checkpoints" / ".step_000006.staging").mkdir()
    (run_dir / "checkpoints" / ".step_000006.staging" / "state.json").write_text("{}")
    assert release.unlisted(run_dir) == []


def test_a_new_file_in_an_export_or_a_search_directory_is_reported_unlisted(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "privacy.json").write_text("{}")
    (export / "meta.json").write_text("{}")
    assert release.unlisted(export) == ["meta.json"]
    search = tmp_path / "search"
    (search / "runs" / "trial").mkdir(parents=True)
    for name in ("ledger.json", "summary.json", "runs/trial/meta.json", "trials.json"):
        (search / name).write_text("{}")
    assert release.unlisted(search) == ["trials.json"]


# ------------------------------------------------------------------ fields inside the released files

PUBLIC = ["data.public_fraction=0.1", "public={source: builtin, name: digits}"]
KINDS = {
    # every threshold policy that releases statistics, with TensorBoard (its tags are fields too)
    "quantile": ["clipping.grouping=layer", "clipping.threshold={kind: quantile, initial: 1.0, sigma: 2.0}"],
    "dcsgd-p": ["clipping.threshold={kind: dcsgd-p, percentile: 0.5, bins: 8, sigma_hist: 5.0, initial: 1.0, "
                "range: 1.0}"],
    "discriminative": ["clipping.threshold={kind: discriminative, small: 0.5, large: 2.0, tail_rule: threshold, "
                       "tail_threshold: 4.0}"],
    # continual: early stopping on the public validation loss, a linear probe, public diagnostics
    "switch": [*PUBLIC, "continual={switch: {rule: early-stopping, every_steps: 1, patience: 1, "
               "max_public_steps: 3}, at_switch: {reinit_head: true, linear_probe_epochs: 1}}",
               "diagnostics.every_steps=2", "diagnostics.probes=2", "diagnostics.per_sample=2",
               "diagnostics.data=public"],
    "b-star": [*PUBLIC, "continual={switch: {rule: b-star, every_steps: 1, b_star_multiple: 2, max_public_steps: 2}}",
               "diagnostics.probes=2", "diagnostics.per_sample=2"],
    "dpmd": [*PUBLIC, "continual={schedule: dpmd}"],
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_field_of_each_policy_and_continual_run_is_in_the_manifest(tiny_recipe, kind):
    run_dir = train(tiny_recipe("logging.tensorboard=true", "eval.every_steps=2", *KINDS[kind])).run_dir
    assert release.unlisted(run_dir) == []
    assert release.unlisted_fields(run_dir) == []


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_new_field_or_an_unnamed_labelled_field_is_reported(tiny_recipe):
    """The checks can fail: a field with no entry, a labelled field its line does not name,
    a new policy statistic, a JSON file with no field table."""
    run_dir = Path(train(tiny_recipe("clipping.threshold={kind: quantile, initial: 1.0, sigma: 2.0}")).run_dir)
    assert release.unlisted_fields(run_dir) == []
    metrics = run_dir / "metrics.jsonl"
    original = _lines(metrics)
    step = next(i for i, record in enumerate(original) if "diagnostics" in record)

    def reported(change) -> list[str]:
        records = json.loads(json.dumps(original))
        change(records[step])
        _write_lines(metrics, records)
        try:
            return release.unlisted_fields(run_dir)
        finally:
            _write_lines(metrics, original)

    assert reported(lambda r: r.update(batch_sizes_per_rank=[3, 4])) == ["metrics.jsonl: batch_sizes_per_rank"]
    assert reported(lambda r: r["not_covered_by_epsilon"].remove("seconds")) == \
        ["metrics.jsonl: seconds (labelled, but the record does not say so)"]
    assert reported(lambda r: r["policy"].update(exact_unclipped_fraction=[0.5])) == \
        ["metrics.jsonl: policy/exact_unclipped_fraction"]
    assert reported(lambda r: r["diagnostics"].update(max_norm=3.0)) == []   # under a labelled key
    # a line that says it is computed from public data alone (phase: public) names nothing: the
    # check takes the writer's word for the phase (docs/accounting.md)
    assert reported(lambda r: r.update(phase="public", not_covered_by_epsilon=[])) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["final_eval"] = {"accuracy": 0.9}
    summary["not_covered_by_epsilon"] = []
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert release.unlisted_fields(run_dir) == ["summary.json: final_eval/accuracy (labelled, but the record does "
                                                 "not say so)"]
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoints" / "step_000002" / "model.json").write_text(json.dumps({"kind": "mlp", "rows": [1]}))
    assert release.unlisted_fields(run_dir) == ["checkpoints/step_*/model.json: rows"]


def test_every_released_json_file_of_the_manifest_has_a_field_table_or_a_reason():
    for entry in release.MANIFEST:
        name = entry.pattern.rsplit("/", 1)[-1]
        if entry.release == release.SECRET or not (name.endswith((".json", ".jsonl")) or "tfevents" in name):
            continue
        opaque = any(fnmatch.fnmatchcase(name, pattern) or name == pattern for pattern in release.OPAQUE)
        has_table = any(t.directory == entry.directory and t.pattern == entry.pattern for t in release.FIELDS)
        assert opaque or has_table, entry.pattern


def test_a_new_key_in_a_released_safetensors_metadata_is_reported(tmp_path):
    """A weight file's header ``__metadata__`` ships with the weights: a key there (a data hash, a
    count) is a field like any other, in a checkpoint, an export's weights, shards, adapters and base."""
    from safetensors.torch import save_file

    tensors = {"w": torch.zeros(2)}
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    checkpoint = run / "checkpoints" / "step_000002" / "model.safetensors"
    save_file(tensors, str(checkpoint), metadata={"format": "pt", "dpclip_tied": "{}"})
    save_file(tensors, str(checkpoint.with_name("state.safetensors")), metadata={"anything": "1"})   # SECRET
    assert release.unlisted_fields(run, release.RUN) == []
    save_file(tensors, str(checkpoint), metadata={"format": "pt", "dpclip_tied": "{}", "num_train": "1000"})
    assert release.unlisted_fields(run, release.RUN) == ["checkpoints/step_*/model.safetensors: num_train"]
    export = tmp_path / "export"
    (export / "base").mkdir(parents=True)
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "adapter_model.safetensors",
                 "base/model.safetensors"):
        save_file(tensors, str(export / name), metadata={"format": "pt"})
    assert release.unlisted_fields(export, release.EXPORT) == []
    save_file(tensors, str(export / "adapter_model.safetensors"), metadata={"format": "pt", "loss": "0.1"})
    assert release.unlisted_fields(export, release.EXPORT) == ["adapter_model.safetensors: loss"]


def test_every_released_safetensors_file_of_the_manifest_has_a_field_table():
    for entry in release.MANIFEST:
        name = entry.pattern.rsplit("/", 1)[-1]
        if entry.release != release.SECRET and name.endswith((".safetensors", "*")):
            path = entry.pattern.replace("*", "x") + ("" if name.endswith(".safetensors") else ".safetensors")
            assert release.fields_of(path, entry.directory) is not None, entry.pattern


# ------------------------------------------------------------------ a search (tune-cost --run)

TINY_SEARCH = ["training.epochs=null", "training.steps=2", "model.hidden=[8]", "privacy.accountant=rdp",
               "tuning.score=private", "tuning.score_noise=20"]


def tiny_search(tmp_path, monkeypatch, trials: int) -> dict:
    """The summary of a search over two learning rates of the tiny quickstart, ``trials`` draws."""
    base = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"),
                           [f"output_dir={tmp_path / 'runs'}", *TINY_SEARCH])
    recipe = validate_recipe(base)
    grid = ["training.optimizer.lr=0.13,0.57"]
    report = tune_cost(base, recipe, grid=grid, timer=StepTimer(fixed_seconds=0.01))
    monkeypatch.setattr(accounting_tuning, "draw_trial_count", lambda mean, shape, rng: trials)
    return run_search(base, recipe, report, grid=grid)


def test_every_file_a_search_leaves_is_in_the_manifest(tmp_path, monkeypatch):
    summary = tiny_search(tmp_path, monkeypatch, trials=2)
    search_dir = Path(summary["search_dir"])
    files = _files(search_dir)
    assert "ledger.json" in files and any(f.endswith("/search.json") for f in files)
    assert release.directory_kind(search_dir) == release.SEARCH
    assert release.unlisted(search_dir) == []
    assert release.unlisted_fields(search_dir) == [], "\n".join(release.unlisted_fields(search_dir))
    # the selected run's export: its card names the search that selected it
    out = tmp_path / "export"
    export_run(search_dir / summary["selected_run_dir"], out)
    assert "selected_by_search" in json.loads((out / "privacy.json").read_text())
    assert release.unlisted_fields(out) == [], "\n".join(release.unlisted_fields(out))


# ------------------------------------------------------------------ slow: LiRA shadows, transformers exports

@pytest.mark.slow
def test_every_file_of_a_lira_audit_is_in_the_manifest(tiny_recipe, cli):
    run_dir = train(tiny_recipe("privacy.accountant=rdp", "data.test_fraction=0.5")).run_dir
    result = cli("audit-mia", run_dir, "--attack", "lira", "--shadows", "2", "--bootstrap", "0")
    assert result.code == 0, result.err
    assert (run_dir / "audit" / "shadows").is_dir()
    assert release.unlisted(run_dir) == []
    assert release.unlisted_fields(run_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["gpt2_run", "lora_run"])
def test_every_file_of_a_transformers_or_lora_export_is_in_the_manifest(fixture, request, tmp_path):
    run_dir = request.getfixturevalue(fixture)
    assert release.unlisted(run_dir) == []
    assert release.unlisted_fields(run_dir) == []
    out = tmp_path / "exported"
    export_run(run_dir, out)
    assert release.directory_kind(out) == release.EXPORT
    assert release.unlisted(out) == []
    assert release.unlisted_fields(out) == []


# ------------------------------------------------------------------ the docs

def _secret_paths_in_docs() -> list[str]:
    """The paths docs/accounting.md's threat model lists under **Secret** (outside the
    generated table) and those docs/training.md's run-directory layout marks SECRET."""
    accounting = (DOCS / "accounting.md").read_text(encoding="utf-8")
    start = accounting.index("**Secret**")
    secret_list = accounting[start:accounting.index("**Randomness.**", start)]
    paths = re.findall(r"^- `([^`]+)`", secret_list, flags=re.MULTILINE)
    training = (DOCS / "training.md").read_text(encoding="utf-8")
    paths += re.findall(r"^\s+(\S+)\s+SECRET", training, flags=re.MULTILINE)
    return paths


def test_every_secret_entry_is_one_the_threat_model_or_the_run_directory_docs_mark_secret():
    documented = _secret_paths_in_docs()
    assert "meta.json" in documented
    for entry in release.MANIFEST:
        if entry.release == release.SECRET:
            assert any(fnmatch.fnmatchcase(entry.pattern, doc) for doc in documented), \
                (entry.pattern, documented)


def test_the_threat_models_table_is_the_rendering_of_the_manifest():
    text = (DOCS / "accounting.md").read_text(encoding="utf-8")
    assert release.BEGIN in text and release.END in text
    block = text[text.index(release.BEGIN):text.index(release.END) + len(release.END)]
    assert block == release.render_markdown(), "run: python scripts/render_manifest.py"


# ------------------------------------------------- export and report read released files only

_OPENED: list[str] | None = None


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, Path)):
        _OPENED.append(str(args[0]))


_HOOKED = False


def _opened_by(run) -> list[str]:
    """The files ``run()`` opens (Python's audit hook: every open through io and pathlib)."""
    global _OPENED, _HOOKED
    if not _HOOKED:   # an audit hook cannot be removed: one, idle unless _OPENED is a list
        import sys
        sys.addaudithook(_record_open)
        _HOOKED = True
    _OPENED = []
    try:
        run()
        return list(_OPENED)
    finally:
        _OPENED = None


@pytest.mark.parametrize("command", ["export", "report"])
def test_export_and_report_open_no_secret_file_of_the_run(tiny_recipe, cli, tmp_path, command):
    """`dpclip export` and `dpclip report` may read only what the manifest marks released:
    a secret file (meta.json's membership, the generators' states, the canary key) read on
    the way could end up in what they write."""
    run_dir = Path(train(tiny_recipe("audit.canaries.count=20", "audit.canaries.kind=ood")).run_dir)
    args = [command, run_dir] + ([tmp_path / "exported"] if command == "export" else [])
    opened = _opened_by(lambda: cli(*args))
    inside = [Path(p).resolve() for p in opened if Path(p).resolve().is_relative_to(run_dir.resolve())]
    assert inside, f"{command} read nothing of the run?"
    secret = [p.relative_to(run_dir.resolve()).as_posix() for p in inside
              if (entry := release.classify(p.relative_to(run_dir.resolve()))) is not None
              and entry.release == release.SECRET]
    assert secret == [], f"{command} read secret files: {sorted(set(secret))}"


def test_a_run_resumed_with_an_override_has_every_field_in_the_manifest(tiny_recipe):
    """summary.json's resume_changes (recipe values, old and new) shipped unlisted."""
    run_dir = train(tiny_recipe()).run_dir
    train(tiny_recipe("training.optimizer.lr=0.1"), resume=run_dir)
    assert "resume_changes" in json.loads((run_dir / "summary.json").read_text())
    assert json.loads((run_dir / "summary.json").read_text())["resume_changes"]
    assert release.unlisted_fields(run_dir) == []


def test_the_audit_reports_count_of_included_canaries_is_named_not_covered_by_epsilon():
    """report.json's `one_run/included` is an exact count of the secret answer key's inclusion bits
    (for `mislabel` canaries, private records trained on): the manifest names it, labelled, with what it is."""
    import numpy as np

    from dpclip.audit.one_run import one_run_audit
    from dpclip.release.fields import fields_of

    report = {"one_run": one_run_audit(np.arange(40.0), np.arange(40) % 2 == 0, 1e-5)}
    assert report["one_run"]["included"] == 20   # the field the manifest names is the one the audit writes
    table = fields_of("audit/report.json")
    assert "one_run/included" in table.labelled and "answer key" in table.what
    row = next(line for line in release.render_markdown().splitlines() if "| `audit/report.json` |" in line
               and "`**`" in line)
    assert "`one_run/included`" in row.split(" | ")[3]   # the "fields not covered by ε" column


def test_a_tensorboard_histogram_text_or_image_of_private_values_is_reported(tmp_path):
    """The events file's check read its scalar tags only: a histogram of the private norms, a text
    summary of the loss or an image written beside the scalars (one `add_histogram` away) passed
    as classed. Every kind of summary is a field now, and a graph one too."""
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tensorboard"))
    writer.add_scalar("privacy/epsilon", 1.0, 1)
    writer.add_histogram("norms", np.array([0.5, 1.5, 3.0]), 1)
    writer.add_text("train_loss", "2.31", 1)
    writer.add_image("per_sample_norms", np.zeros((1, 2, 2)), 1)
    writer.add_histogram("not_covered_by_epsilon/norms", np.array([0.5, 1.5]), 1)   # labelled: passes
    writer.close()
    reported = release.unlisted_fields(tmp_path, release.RUN)
    assert all(line.startswith("tensorboard/events.out.tfevents.") for line in reported), reported
    assert [line.split(": ", 1)[1] for line in reported] == ["norms", "per_sample_norms", "train_loss/text_summary"]
