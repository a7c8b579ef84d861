"""An export releases only released quantities (docs/accounting.md, "Threat model";
docs/export.md): none of the run's secret files, and the ε that `dpclip account` states."""

import json

import pytest
import yaml

from dpclip.export import export_run
from dpclip.recipe.load import validate_recipe
from dpclip.train.workflow import train


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
