"""A run directory whose files were damaged or edited by hand (bytes that are not UTF-8, a JSON line
that is not a record, an event whose fields are not numbers, sizes that are not sizes) is refused
with `error:` and `hint:`, or read past, by every command that reads it: never "unexpected" (the
catch-all that asks for a bug report). Found by fuzzing the commands over edited copies of a run."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
TINY = ("training.epochs=null", "training.steps=2", "eval.every_steps=null", "checkpoint.every_steps=1",
        "model.hidden=[8]", "privacy.epsilon=null", "privacy.noise_multiplier=1.0")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    recipe = load_recipe(QUICKSTART, [f"output_dir={tmp_path_factory.mktemp('runs')}", *TINY])
    return train(recipe).run_dir


@pytest.fixture
def run_copy(trained_run, tmp_path):
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


def _edit_json(path: Path, field: str, value) -> None:
    """Set one top-level field of a run's JSON file, as a hand edit would."""
    record = json.loads(path.read_text())
    record[field] = value
    path.write_text(json.dumps(record))


def _refused(result) -> bool:
    return result.code == 2 and "error: " in result.err and "hint: " in result.err and \
        "unexpected" not in result.err and "Traceback" not in result.err


def _killed_after_step_2(run: Path) -> None:
    """As a kill after step 2's ledger entry and metrics record, before its checkpoint."""
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step_000002")
    (run / "checkpoints" / "LATEST").write_text("step_000001\n")


def test_metrics_bytes_that_are_not_utf8_do_not_crash_account_report_or_export(cli, run_copy, tmp_path):
    # account, report and export crashed: "unexpected UnicodeDecodeError"
    with (run_copy / "metrics.jsonl").open("ab") as stream:
        stream.write(b"\xff\xfe garbage\n")
    assert cli("account", run_copy).code == 0
    assert cli("report", run_copy, "--out", tmp_path / "r.html").code == 0
    assert cli("export", run_copy, tmp_path / "out").code == 0


@pytest.mark.parametrize("thresholds", ["3", '["a"]', "[null]", '{"a": 1}', "[]", "[1.0, 2.0, 3.0]"])
def test_report_refuses_thresholds_in_metrics_that_are_not_one_number_per_group(cli, run_copy, tmp_path, thresholds):
    # report crashed drawing thresholds.png ("unexpected TypeError: 'int' object is not iterable", "could not
    # convert string to float", "list index out of range"); a row of another length drew a wrong plot
    (run_copy / "thresholds.png").unlink()   # drawn from metrics.jsonl when the run has none
    with (run_copy / "metrics.jsonl").open("a") as stream:
        stream.write(f'{{"step": 2, "thresholds": {thresholds}}}\n')
    result = cli("report", run_copy, "--out", tmp_path / "r.html")
    assert _refused(result), result.err
    assert "metrics.jsonl" in result.err and "step 2" in result.err


@pytest.mark.parametrize("record", ['{"trace_h": 1.0}', '{"step": "a", "trace_h": 1.0}', '{"step": true}'])
def test_diagnose_refuses_a_diagnostics_line_without_a_step_number(cli, run_copy, tmp_path, record):
    # diagnose crashed drawing the run's history beside its measurement: "unexpected KeyError: 'step'",
    # "'<' not supported between instances of 'int' and 'str'"
    (run_copy / "diagnostics.jsonl").write_text(record + "\n")
    result = cli("diagnose", run_copy, "--data", "private", "--allow-private-not-covered-by-epsilon",
                 "--probes", "2", "--per-sample", "2", "--out", tmp_path / "plots")
    assert _refused(result), result.err
    assert "diagnostics.jsonl" in result.err and "line 1" in result.err


@pytest.mark.slow  # a run and its resume (~7 s)
def test_a_resume_passes_over_a_damaged_diagnostics_line_without_stopping_as_on_a_private_batch(cli, tmp_path):
    # the resume crashed in the loop ("unexpected ValueError: invalid literal for int()"), after its first step was
    # charged: plan.json then said for good that the run stopped on a private batch
    recipe = load_recipe(QUICKSTART, [f"output_dir={tmp_path / 'runs'}", *TINY, "diagnostics.every_steps=1",
                                      "diagnostics.probes=2", "diagnostics.per_sample=2", "diagnostics.data=private",
                                      "diagnostics.private_not_covered=true"])
    run = Path(train(recipe).run_dir)
    _killed_after_step_2(run)
    with (run / "diagnostics.jsonl").open("a") as stream:
        stream.write('{"step": "a"}\n')
    resumed = cli("train", "--resume", run, "--threads", "1")
    assert resumed.code == 0, resumed.err
    assert "stopped_on_private_batch" not in json.loads((run / "plan.json").read_text())
    assert _refused(cli("diagnose", run, "--probes", "2", "--per-sample", "2", "--out", tmp_path / "plots"))


@pytest.mark.parametrize("groups", [[1, 2], ["fc", None]])
def test_report_refuses_a_plan_whose_group_names_are_not_names(cli, run_copy, tmp_path, groups):
    # report crashed naming the groups of thresholds.png: "unexpected TypeError: sequence item 0: expected str
    # instance, int found"
    (run_copy / "thresholds.png").unlink()
    _edit_json(run_copy / "plan.json", "groups", groups)
    result = cli("report", run_copy, "--out", tmp_path / "r.html")
    assert _refused(result), result.err
    assert "plan.json" in result.err


@pytest.mark.parametrize("line", ["[1, 2]", "null", "5", "{}", '{"step": "2", "noise_std": [1]}',
                                  '{"step": 2, "eval": "x"}'])
def test_a_metrics_line_that_is_not_a_step_record_ends_the_records_read(cli, run_copy, tmp_path, line):
    # report crashed ("'list' object has no attribute 'get'"); a resume crashed on each of these lines (the last
    # one after its steps, drawing training.png)
    with (run_copy / "metrics.jsonl").open("a") as stream:
        stream.write(line + "\n")
    assert cli("report", run_copy, "--out", tmp_path / "r.html").code == 0
    _killed_after_step_2(run_copy)
    resumed = cli("train", "--resume", run_copy, "--threads", "1")
    assert resumed.code == 0, resumed.err
    records = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(record, dict) for record in records)   # the damaged line dropped
    assert [r["step"] for r in records if "noise_std" in r] == [1, 2]   # step 2 replayed, not written twice


def test_a_ledger_event_whose_fields_are_not_numbers_is_not_this_runs_step_event(cli, run_copy, tmp_path):
    # account, report and export crashed: "unexpected ValueError: could not convert string to float: 'x'"
    ledger = json.loads((run_copy / "ledger.json").read_text())
    ledger["entries"][0]["event"]["sampling_probability"] = "x"
    (run_copy / "ledger.json").write_text(json.dumps(ledger))
    for command in (("account", run_copy), ("report", run_copy, "--out", tmp_path / "r.html"),
                    ("export", run_copy, tmp_path / "out")):
        result = cli(*command)
        assert _refused(result), result.err
        assert "not this run's step event" in result.err.replace("\n", "")


@pytest.mark.parametrize("field, value", [("data", "x"), ("split_key", "x")])
def test_a_resume_refuses_a_meta_json_whose_records_are_not_what_the_run_wrote(cli, run_copy, field, value):
    # "unexpected AttributeError: 'str' object has no attribute 'get'", "unexpected ValueError: invalid literal"
    _edit_json(run_copy / "meta.json", field, value)
    _killed_after_step_2(run_copy)
    result = cli("train", "--resume", run_copy, "--threads", "1")
    assert _refused(result), result.err
    assert "meta.json" in result.err


@pytest.mark.parametrize("path", [("optimizer",), ("sampler", "step"), ("engine",), ("engine", "policy", "thresholds"),
                                  ("torch_rng",)])
def test_a_resume_refuses_a_checkpoint_state_that_is_not_what_the_run_saved(cli, run_copy, path):
    # "unexpected AttributeError: 'str' object has no attribute 'copy'", "invalid literal for int()",
    # "expected a torch.ByteTensor, but got str", "too many dimensions 'str'"
    _killed_after_step_2(run_copy)
    state_file = run_copy / "checkpoints" / "step_000001" / "state.json"
    state = json.loads(state_file.read_text())
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = ["x", 1] if path[-1] == "thresholds" else "x"
    state_file.write_text(json.dumps(state))
    result = cli("train", "--resume", run_copy, "--threads", "1")
    assert _refused(result), result.err
    assert "does not hold a state this run can take back" in result.err


def test_audit_refuses_a_split_key_that_is_not_a_key(cli, run_copy):
    # "unexpected ValueError: invalid literal for int() with base 10: 'x'"
    _edit_json(run_copy / "meta.json", "split_key", "x")
    result = cli("audit-mia", run_copy, "--attack", "loss", "--bootstrap", "0")
    assert _refused(result), result.err
    assert "split_key" in result.err


@pytest.mark.parametrize("final_eval", ["x", {"loss": "x"}, [1]])
def test_report_refuses_final_metrics_that_are_not_named_numbers(cli, run_copy, tmp_path, final_eval):
    # report crashed: "'str' object has no attribute 'items'", "Unknown format code 'g' for object of type 'str'"
    _edit_json(run_copy / "summary.json", "final_eval", final_eval)
    result = cli("report", run_copy, "--out", tmp_path / "r.html")
    assert _refused(result), result.err
    assert "summary.json" in result.err


@pytest.mark.parametrize("field, value", [("input_shape", "x"), ("input_shape", [-1]), ("num_classes", "x")])
def test_export_refuses_a_model_json_whose_sizes_are_not_sizes(cli, run_copy, tmp_path, field, value):
    # export crashed inside torch: "unexpected TypeError: empty(): argument 'size' ...", "negative dimension -1"
    info_file = run_copy / "checkpoints" / "step_000002" / "model.json"
    _edit_json(info_file, field, value)
    result = cli("export", run_copy, tmp_path / "out")
    assert _refused(result), result.err
    assert "model.json is damaged" in result.err and "--checkpoint step_000001" in result.err


def test_weights_whose_tied_names_metadata_is_not_a_map_are_damaged(cli, run_copy, tmp_path):
    # export crashed: "unexpected AttributeError: 'list' object has no attribute 'items'"
    weights = run_copy / "checkpoints" / "step_000002" / "model.safetensors"
    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    header["__metadata__"]["dpclip_tied"] = "[1]"
    edited = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(edited)) + edited + data[8 + size:])
    result = cli("export", run_copy, tmp_path / "out")
    assert _refused(result), result.err
    assert "model.safetensors is damaged" in result.err


def test_account_of_a_run_directory_refuses_overrides_and_plan_options_it_would_ignore(cli, trained_run):
    # they were dropped silently: the ε printed was the ledger's, not the one asked for
    for extra in (["privacy.epsilon=1"], ["--eps", "1"], ["--accountant", "rdp"]):
        result = cli("account", trained_run, *extra)
        assert _refused(result), result.err
        assert "comes from its ledger" in result.err
    assert cli("account", trained_run, "--group-size", "2").code == 0


@pytest.mark.parametrize("override", ["output_dir=runs\x00x", "name=" + "a" * 300])
def test_an_output_path_no_file_system_takes_is_an_error_with_a_hint(cli, tmp_path, override):
    # "unexpected ValueError: embedded null byte"; "unexpected OSError: [Errno 36] File name too long"
    result = cli("train", QUICKSTART, f"output_dir={tmp_path}", *TINY, override)
    assert _refused(result), result.err


def test_an_output_dir_with_a_name_longer_than_the_file_system_allows_is_an_error_with_a_hint(cli, tmp_path):
    result = cli("train", QUICKSTART, *TINY, f"output_dir={tmp_path / ('b' * 300)}")
    assert _refused(result), result.err
    assert "longer than the file system allows" in result.err


def test_audit_refuses_a_model_whose_outputs_are_not_finite(cli, run_copy):
    # a diverged run (or damaged weights): "unexpected ValueError: Input contains NaN" from the attack's metrics
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = run_copy / "checkpoints" / "step_000002" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as stored:
        metadata = stored.metadata()
        tensors = {name: stored.get_tensor(name) * float("nan") for name in stored.keys()}
    save_file(tensors, str(weights), metadata=metadata)
    result = cli("audit-mia", run_copy, "--attack", "loss", "--bootstrap", "0")
    assert _refused(result), result.err
    assert "not finite" in result.err
