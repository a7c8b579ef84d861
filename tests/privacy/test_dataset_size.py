"""The number of privacy units N is released exactly: the ledger's (and privacy.json's) sample rate
is q = B/N and the recipe (or the loader) gives B, so an attacker holding both computes N = B/q (a
run's plan.json writes it too). Add/remove neighbours differ in N by one, and ε does not cover it
(DP-SGD's accounting treats N as public): every statement with a q, and privacy.json's list, say
so in those words (docs/accounting.md, "What ε covers"), for examples and, at the user level, for
people."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.accounting.statement import dataset_size_line
from dpclip.rundir.run import spent
from dpclip.train.workflow import train

NOT_COVERED = "not covered by ε: "


def test_an_attacker_computes_n_from_privacy_json_and_the_statement_says_n_is_not_covered(tiny_recipe):
    recipe = tiny_recipe()
    result = train(recipe)
    ledger = json.loads((result.run_dir / "ledger.json").read_text())
    plan = json.loads((result.run_dir / "plan.json").read_text())
    recovered = round(recipe.training.batch_size / ledger["entries"][0]["event"]["sampling_probability"])
    assert recovered == plan["num_train"]   # the attacker's N is the private data's (plan.json says it too)
    line = dataset_size_line("example")
    assert "number of examples N" in line and "public" in line
    assert NOT_COVERED + line in result.statement
    _, statement = spent(result.run_dir)
    assert line in statement.not_covered and NOT_COVERED + line in statement.lines()


def test_make_private_names_n_in_its_statement_and_privacy_json(tmp_path):
    data = TensorDataset(torch.randn(48, 5), torch.randint(0, 3, (48,)))
    model = nn.Linear(5, 3)
    private = dpclip.make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=12),
                                  steps=2, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    line = dataset_size_line("example")
    assert NOT_COVERED + line in private.statement()
    privacy = json.loads((private.save(tmp_path) / "privacy.json").read_text())
    assert privacy["not_covered_by_epsilon"][0] == line
    assert round(12 / privacy["sample_rate"]) == 48


def test_a_user_level_statement_names_the_number_of_people():
    people, records = 12, 3
    data = TensorDataset(torch.randn(people * records, 5), torch.randint(0, 3, (people * records,)))
    model = nn.Linear(5, 3)
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=6),
                                  criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=2,
                                  max_grad_norm=1.0, users=[f"p{i % people}" for i in range(people * records)],
                                  max_records_per_user=2)
    line = dataset_size_line("person")
    assert "number of people N" in line and "by one person" in line
    stated = [entry for entry in private.statement() if entry.startswith(NOT_COVERED)]
    assert NOT_COVERED + line in stated and NOT_COVERED + dataset_size_line("example") not in stated


def test_validate_and_tune_cost_label_the_n_they_print(cli):
    from dpclip.cli.render import N_LABEL

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    validated = cli("validate", recipes / "quickstart.yaml")
    assert validated.code == 0, validated.err
    assert f"1438 training examples, {N_LABEL}" in " ".join(validated.out.split())
    cost = cli("tune-cost", recipes / "tune-digits.yaml", "--no-measure", "--step-seconds", "0.1")
    assert cost.code == 0, cost.err
    assert f"N = 1438 ({N_LABEL})" in " ".join(cost.out.split())
