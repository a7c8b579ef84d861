"""An export releases only released quantities (docs/accounting.md, "Threat model";
docs/export.md): none of the run's secret files, and the ε that `dpclip account` states."""

import json
import shutil

import pytest
import yaml

from dpclip.accounting import Ledger
from dpclip.export import export_run
from dpclip.recipe import load_recipe
from dpclip.recipe.load import validate_recipe
from dpclip.train.workflow import train
from tests.conftest import REPO


def _secret_files(run_dir):
    secrets = [run_dir / "meta.json", run_dir / "audit" / "canaries.json"]
    secrets += [p for p in (run_dir / "checkpoints").rglob("state.*")]
    return [p for p in secrets if p.is_file()]


def test_an_export_holds_no_secret_file_and_the_epsilon_account_states(tiny_recipe, tmp_path, cli):
    run_dir = train(tiny_recipe("audit.canaries.count=20", "audit.canaries.kind=ood")).run_dir
    secrets = _secret_files(run_dir)
    assert {p.name for p in secrets} >= {"meta.json", "canaries.json", "state.json", "state.safetensors"}
    out = tmp_path / "exported"
    export_run(run_dir, out)
    exported = [p for p in out.rglob("*") if p.is_file()]
    assert exported
    secret_names = {"meta.json", "canaries.json", "state.json", "state.safetensors"}
    assert not [p for p in exported if p.name in secret_names]
    secret_bytes = {p.read_bytes() for p in secrets}
    assert not [p for p in exported if p.read_bytes() in secret_bytes]
    # the member indices and canary answers appear in no exported text either
    members = json.loads((run_dir / "meta.json").read_text())["members"]
    assert '"members"' not in "".join(p.read_text(errors="replace") for p in exported if p.suffix != ".safetensors")
    assert members

    account = cli("account", run_dir, "--json")
    assert account.code == 0, account.err
    stated = json.loads(account.out)["statement"]["epsilon"]
    card = json.loads((out / "privacy.json").read_text())
    assert card["epsilon"] == stated and card["delta"] == json.loads(account.out)["statement"]["delta"]


def test_a_seeded_run_carries_the_seeded_warning_into_the_card(tiny_recipe, tmp_path):
    run_dir = train(tiny_recipe("privacy.unsafe_seeded_randomness=true")).run_dir
    export_run(run_dir, tmp_path / "out")
    card = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert card["seeded_randomness"] and "does NOT hold" in card["warning"]
    assert card["warning"] in (tmp_path / "out" / "README.md").read_text()


def _exported_text(out):
    return {p: p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix != ".safetensors"}


@pytest.mark.parametrize("canary_seed", [None, 987654321])
def test_an_export_of_an_audited_run_names_nothing_of_the_canaries(tiny_recipe, tmp_path, canary_seed):
    """The attacker holds the export: nothing in it identifies the canaries (issue 26, leak 4)."""
    overrides = ["audit.canaries.count=20", "audit.canaries.kind=ood"]
    if canary_seed is not None:
        overrides.append(f"audit.canaries.seed={canary_seed}")
    recipe = tiny_recipe(*overrides)
    run_dir = train(recipe).run_dir
    secret = json.loads((run_dir / "audit" / "canaries.json").read_text())
    out = tmp_path / "exported"
    export_run(run_dir, out)

    assert not [p for p in out.rglob("*") if "canar" in p.name.lower() or "audit" in p.name.lower()]
    texts = _exported_text(out)
    for path, text in texts.items():
        assert "canar" not in text.lower(), path
        assert secret["fingerprint"] not in text and str(secret["seed"]) not in text, path
    exported = yaml.safe_load((out / "recipe.yaml").read_text())
    assert "audit" not in exported
    # the canary seed is derived from the recipe's seed unless set: no export carries that seed
    assert "seed" not in exported
    # and the exported recipe still describes the model a user rebuilds
    assert exported["model"] == recipe.model.model_dump(mode="json")
    assert validate_recipe({**exported, "seed": 0}).audit.canaries is None


def _crashed_copy(run_dir, dest, checkpoint_step: int, crash_step: int):
    """``run_dir`` as a process killed right after releasing step ``crash_step`` would leave it:
    the ledger charged to there, metrics.jsonl's records up to there, the last checkpoint at
    ``checkpoint_step``, no summary.json."""
    shutil.copytree(run_dir, dest)
    for folder in (dest / "checkpoints").glob("step_*"):
        if int(folder.name.split("_")[1]) > checkpoint_step:
            shutil.rmtree(folder)
    (dest / "checkpoints" / "LATEST").write_text(f"step_{checkpoint_step:06d}\n")
    ledger = Ledger.from_dict(json.loads((dest / "ledger.json").read_text()))
    cut = Ledger(ledger.delta, ledger.accountant)
    cut.record(ledger.entries[0].event, count=crash_step, metadata=ledger.entries[0].metadata)
    (dest / "ledger.json").write_text(json.dumps(cut.to_dict()))
    metrics = (dest / "metrics.jsonl").read_text().splitlines()   # the records written up to the crash
    (dest / "metrics.jsonl").write_text("".join(f"{line}\n" for line in metrics
                                                if json.loads(line)["step"] <= crash_step))
    (dest / "summary.json").unlink()
    return dest


def test_the_card_of_a_crashed_run_says_it_is_unfinished_and_that_epsilon_counts_steps_after_the_checkpoint(
        tiny_recipe, tmp_path, cli):
    run_dir = train(tiny_recipe("training.steps=6")).run_dir
    crashed = _crashed_copy(run_dir, tmp_path / "crashed", checkpoint_step=4, crash_step=5)
    export_run(crashed, tmp_path / "out")
    card = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert (card["steps"], card["steps_planned"], card["stopped"], card["checkpoint_step"]) == (5, 6, "unfinished", 4)
    assert "5 of its 6 planned steps (unfinished" in card["progress"]
    assert "precedes its last released step" in card["progress"]
    assert "ε counts all 5 released steps" in card["progress"]
    assert card["progress"] in (tmp_path / "out" / "README.md").read_text()
    report = cli("report", crashed, "--json", "--out", tmp_path / "r.html")
    assert json.loads(report.out)["stopped"].startswith(card["stopped"])   # what `dpclip report` says

    export_run(run_dir, tmp_path / "done")
    done = json.loads((tmp_path / "done" / "privacy.json").read_text())
    assert (done["steps"], done["steps_planned"], done["stopped"]) == (6, 6, "completed")
    assert done["progress"] == "The run released 6 of its 6 planned steps (completed)."


def _private_tokenizer(folder, words):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>").save_pretrained(folder)
    return folder


def test_a_tokenizer_the_recipe_gives_is_exported_as_given_and_the_card_says_it_is_not_covered_by_epsilon(tmp_path):
    """The attacker reads the exported tokenizer: a word of the text it was built from is in its
    vocabulary, outside ε; the card must say dpclip took it as public (the byte tokenizer is fixed)."""
    from dpclip.planning.plan import TOKENIZER, not_covered

    tokenizer = _private_tokenizer(tmp_path / "tok", ["zxqvortambril", "the", "a", "restaurant"])
    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", [
        f"output_dir={tmp_path / 'runs'}", f"data.tokenizer={tokenizer}", "data.num_examples=60",
        "data.max_length=16", "training.epochs=null", "training.steps=1", "training.batch_size=16",
        "training.micro_batch_size=16", "checkpoint.every_steps=null", "eval.every_steps=null",
        "model.config.n_layer=1", "clipping.grouping=all-layer", "model.config.n_embd=16", "model.config.n_head=2",
        "model.config.n_positions=16"])
    export_run(train(recipe).run_dir, tmp_path / "out")
    assert "zxqvortambril" in (tmp_path / "out" / "tokenizer.json").read_text()   # released as given
    card = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert TOKENIZER in card["not_covered_by_epsilon"]
    assert f"- {TOKENIZER}" in (tmp_path / "out" / "README.md").read_text()
    assert TOKENIZER not in not_covered(recipe.model_copy(update={"data": recipe.data.model_copy(
        update={"tokenizer": "byte"})}))
