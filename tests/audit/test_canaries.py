import json

import numpy as np
import pytest
import torch

from dpclip.accounting import Ledger
from dpclip.data import load_data, make_canaries, with_canaries
from dpclip.errors import DpclipError
from dpclip.recipe.schema import Canaries
from dpclip.planning.plan import plan_for_recipe, solve_plan
from dpclip.train.workflow import train


def test_canaries_are_deterministic_and_about_half_included(tiny_recipe):
    recipe = tiny_recipe()
    data = load_data(recipe.data, seed=0)
    config = Canaries(count=400, kind="ood")
    first, second = make_canaries(data, config, 0), make_canaries(data, config, 0)
    assert first.fingerprint() == second.fingerprint()
    assert np.array_equal(first.included, second.included)
    # Binomial(400, ½) has std 10: 200 ± 40 is a 4-sigma band.
    assert abs(int(first.included.sum()) - 200) < 40
    assert make_canaries(data, config, 1).fingerprint() != first.fingerprint()


def test_mislabel_canaries_are_held_out_rows_with_a_different_label(tiny_recipe):
    data = load_data(tiny_recipe().data, seed=0)
    canaries = make_canaries(data, Canaries(count=50, kind="mislabel"), 0)
    true = data.test["labels"][torch.as_tensor(canaries.sources)]
    assert (canaries.tensors["labels"] != true).all()
    assert torch.equal(canaries.tensors["features"], data.test["features"][torch.as_tensor(canaries.sources)])
    grown = with_canaries(data, canaries)
    assert grown.num_train == data.num_train + int(canaries.included.sum())


def test_too_many_mislabel_canaries_is_an_error_with_a_hint(tiny_recipe):
    data = load_data(tiny_recipe().data, seed=0)
    with pytest.raises(DpclipError) as info:
        make_canaries(data, Canaries(count=data.num_test + 1, kind="mislabel"), 0)
    assert "kind: ood" in info.value.hint


def test_a_canary_run_keeps_the_secret_and_accounts_with_the_recipes_n(tiny_recipe):
    recipe = tiny_recipe("audit.canaries.count=60", "audit.canaries.kind=ood")
    run = train(recipe).run_dir
    secret = json.loads((run / "audit" / "canaries.json").read_text())
    assert len(secret["included"]) == 60 and 0 < sum(secret["included"]) < 60
    # `dpclip account RECIPE` (plan_for_recipe: N without canaries) and the run agree.
    planned = solve_plan(plan_for_recipe(recipe), accountant=recipe.privacy.accountant)
    ledger = Ledger.from_dict(json.loads((run / "ledger.json").read_text()))
    assert all(entry.event == planned.step_event for entry in ledger.entries)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["plan"]["num_train"] == meta["data"]["num_train"] == len(meta["members"])
    assert meta["plan"]["canaries_included"] == sum(secret["included"])
