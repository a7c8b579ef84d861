"""The one-run audit's answer key (audit/canaries.json) and the canaries a recipe may ask for:
a damaged key is named with a hint, never misread; mislabel canaries stay at the record level."""

import json
from pathlib import Path

import numpy as np
import pytest

from dpclip.audit.one_run import one_run_audit
from dpclip.data import load_data, make_canaries
from dpclip.data.canaries import read_canary_secret, write_canary_secret
from dpclip.errors import DpclipError
from dpclip.recipe import load_recipe
from dpclip.recipe.schema import Canaries

REPO = Path(__file__).resolve().parents[2]
USER_LEVEL = ["data={source: builtin, name: synthetic-users, max_examples_per_user: 3}", "privacy.unit=user"]


def test_mislabel_canaries_are_refused_at_the_user_level_when_the_recipe_is_validated(cli, tmp_path):
    """A mislabel canary is a real held-out record: canary people made of them would put one
    real person into several privacy units (group privacy only), so the recipe is refused."""
    with pytest.raises(DpclipError) as info:
        load_recipe(REPO / "recipes" / "quickstart.yaml", [*USER_LEVEL, "audit.canaries.count=20"])
    assert "mislabel" in str(info.value) and "kind: ood" in str(info.value) and info.value.hint
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "quickstart.yaml").read_text())
    result = cli("validate", recipe, *USER_LEVEL, "audit.canaries.count=20", "audit.canaries.kind=mislabel")
    assert result.code == 2 and "error:" in result.err and "hint:" in result.err and "kind: ood" in result.err
    # ood canaries are nobody's records: still allowed at the user level
    load_recipe(REPO / "recipes" / "quickstart.yaml", [*USER_LEVEL, "audit.canaries.count=20", "audit.canaries.kind=ood"])


def test_canary_people_are_never_made_of_held_out_records(tiny_recipe):
    data = load_data(tiny_recipe().data, seed=0)
    with pytest.raises(DpclipError) as info:
        make_canaries(data, Canaries(count=10, kind="mislabel"), 0, records=3)
    assert "kind: ood" in info.value.hint


@pytest.fixture
def answer_key(tiny_recipe, tmp_path):
    """A run folder holding only a real answer key of 20 mislabel canaries; returns (folder, key)."""
    data = load_data(tiny_recipe().data, seed=0)
    write_canary_secret(tmp_path, make_canaries(data, Canaries(count=20, kind="mislabel"), 7))
    return tmp_path, json.loads((tmp_path / "audit" / "canaries.json").read_text())


DAMAGE = {
    "seed missing": lambda d: d.pop("seed"), "seed not a number": lambda d: d.update(seed="abc"),
    "seed a boolean": lambda d: d.update(seed=True), "kind missing": lambda d: d.pop("kind"),
    "kind unknown": lambda d: d.update(kind="noise"), "fingerprint missing": lambda d: d.pop("fingerprint"),
    "included strings": lambda d: d.update(included=["no"] * len(d["included"])),
    "included numbers": lambda d: d.update(included=[1] * len(d["included"])),
    "included not a list": lambda d: d.update(included=5), "included short": lambda d: d.update(included=d["included"][:5]),
    "sources not numbers": lambda d: d.update(sources=["x"] * len(d["sources"])),
    "sources short": lambda d: d.update(sources=d["sources"][:3]), "sources negative": lambda d: d["sources"].__setitem__(0, -1),
    "records zero": lambda d: d.update(records=0), "labels text": lambda d: d.update(labels="abc"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_answer_key_is_named_damaged_with_a_hint_not_misread(answer_key, damage):
    folder, key = answer_key
    DAMAGE[damage](key)
    (folder / "audit" / "canaries.json").write_text(json.dumps(key))
    with pytest.raises(DpclipError) as info:
        read_canary_secret(folder)
    assert "canaries.json is damaged" in str(info.value) and "restore it" in info.value.hint


def test_an_answer_key_of_an_older_run_without_count_labels_or_records_still_reads(answer_key):
    folder, key = answer_key
    for field in ("count", "labels", "records"):
        key.pop(field)
    (folder / "audit" / "canaries.json").write_text(json.dumps(key))
    assert read_canary_secret(folder)["seed"] == 7


def test_a_file_in_place_of_the_audit_folder_is_an_error_with_a_hint(tmp_path):
    (tmp_path / "audit").write_text("x")
    with pytest.raises(DpclipError) as info:
        read_canary_secret(tmp_path)
    assert "is a file" in str(info.value) and "restore" in info.value.hint
    assert read_canary_secret(tmp_path / "elsewhere") is None   # no audit folder: a run without canaries


def test_the_fdp_bound_carries_the_condition_it_holds_under():
    included = np.random.default_rng(0).random(200) < 0.5
    result = one_run_audit(included.astype(float), included, 1e-5)
    assert "Gaussian" in result["fdp"]["condition"] and "Steinke" in result["fdp"]["condition"]


@pytest.mark.parametrize("went_in, cap", [(100, 3.80), (99, 3.42), (98, 3.17), (90, 3.09), (120, 3.09)])
def test_perfect_guesses_on_200_canaries_cap_the_bound_by_how_many_went_in(went_in, cap):
    """docs/auditing.md: all 2k = 200 guesses can be right only when exactly 100 canaries went in."""
    included = np.arange(200) < went_in
    assert one_run_audit(included.astype(float), included, 1e-5)["epsilon_lower_bound"] == pytest.approx(cap, abs=0.01)


def test_inclusion_bits_other_than_the_seeds_are_refused(answer_key, tiny_recipe):
    """The inclusion bits are drawn from the canary seed with the canaries: well-formed bits that
    differ from the seed's (an edit, a bad copy) would turn right guesses into wrong ones, and the
    bound, or the flag, would be about bits the run never trained with."""
    from dpclip.audit.report import check_rebuilt_canaries

    folder, key = answer_key
    rebuilt = make_canaries(load_data(tiny_recipe().data, seed=0), Canaries(count=20, kind="mislabel"), key["seed"])
    check_rebuilt_canaries(folder, rebuilt, key)          # the key as written passes
    key["included"][3] = not key["included"][3]
    with pytest.raises(DpclipError) as info:
        check_rebuilt_canaries(folder, rebuilt, key)
    assert "inclusion bits" in str(info.value) and "restore" in info.value.hint


@pytest.mark.slow  # trains a 2-step run (5 s)
def test_an_answer_key_whose_bits_are_not_its_seeds_is_refused_not_audited(tiny_recipe):
    """The inclusion bits are drawn from the canary seed with the canaries: bits that differ from
    the seed's (flipped by an edit or a bad copy, well-formed) would turn right guesses into wrong
    ones, and the bound, or the flag, would be about bits the run never trained with."""
    from dpclip.audit import audit
    from dpclip.train.workflow import train

    run = train(tiny_recipe("audit.canaries.count=20", "audit.canaries.kind=ood", "training.steps=2",
                            "checkpoint.every_steps=null")).run_dir
    path = run / "audit" / "canaries.json"
    key = json.loads(path.read_text())
    assert audit(run, ["one-run"], write=False)["one_run"]["included"] == sum(key["included"])
    key["included"] = [not bit for bit in key["included"]]
    path.write_text(json.dumps(key))
    with pytest.raises(DpclipError) as info:
        audit(run, ["one-run"], write=False)
    assert "canaries.json" in str(info.value) and "inclusion bits" in str(info.value) and "restore" in info.value.hint


def test_a_recipe_with_fewer_than_two_canaries_is_refused_before_training(cli, tmp_path):
    """One canary trained a whole run whose one-run audit was then refused ("too few")."""
    with pytest.raises(DpclipError) as info:
        load_recipe(REPO / "recipes" / "quickstart.yaml", ["audit.canaries.count=1"])
    assert "audit.canaries.count" in str(info.value) and info.value.hint
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "quickstart.yaml").read_text())
    result = cli("validate", recipe, "audit.canaries.count=1")
    assert result.code == 2 and "error:" in result.err and "hint:" in result.err
    load_recipe(REPO / "recipes" / "quickstart.yaml", ["audit.canaries.count=2"])
