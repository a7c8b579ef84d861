"""An adversary who picks the other rows cannot make the float32 rounding of a step's running sum
move the release by more than C (docs/formulas.md, "Rounding of the sums"; Casacuberta et al.,
CCS 2022): the sums are kept in float64 across micro-batches and rounded once."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from dpclip.engine import DPEngine

F32 = np.float32


def _rows_that_round_apart(k: int, crafted: int, target: float) -> tuple[list[float], int]:
    """Rows whose float32 running sum, with and without ``target`` (row ``index``), lies on the two
    sides of 2^k, then rows of about one ulp each, picked greedily to round the two sums apart."""
    with_, without, rows = F32(0), F32(0), []

    def add(value) -> None:
        nonlocal with_, without
        value = F32(value)
        with_, without = F32(with_ + value), F32(without + value)
        rows.append(float(value))

    while with_ + F32(0.5) <= F32(2 ** k - 1):
        add(0.5)
    index = len(rows)
    rows.append(target)
    with_ = F32(with_ + F32(target))
    add(0.5)
    ulp = np.spacing(F32(2 ** k - 1))
    steps = [F32(sign * m * ulp) for sign in (1, -1) for m in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3)]
    for _ in range(crafted):
        add(max(steps, key=lambda c: abs(float(F32(with_ + c)) - float(F32(without + c)))))
        if with_ > 2 ** k + 4 * np.spacing(F32(2 ** k)):
            add(-min(0.5, float(with_) - 2 ** k))
        if with_ < 2 ** k:
            add(min(0.5, 2 ** k - float(with_)))
    return rows, index


def _released(rows: list[float]) -> float:
    """The engine's clipped sum (no noise) of one-row micro-batches, C = 1."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=1)
    for row in rows:
        engine.backward(model(torch.tensor([[row]], dtype=torch.float32)).sum(1))
    total = float(engine.debug_clipped().sums["weight"].double().sum())
    engine.detach()
    return total


def test_one_row_moves_a_sum_of_one_row_micro_batches_by_at_most_c():
    target = 1.0 - 2.0 ** -20        # below C = 1: its clip factor is 1
    rows, index = _rows_that_round_apart(6, 120, target)
    with_, without = F32(0), F32(0)  # a float32 running sum, as the engine kept it before
    for j, row in enumerate(rows):
        with_ = F32(with_ + F32(row))
        without = without if j == index else F32(without + F32(row))
    assert float(with_) - float(without) > 1 + 1e-4   # the attack is real in float32
    moved = _released(rows) - _released(rows[:index] + rows[index + 1:])
    assert abs(moved) <= 1 + 1e-5, moved
