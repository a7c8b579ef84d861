"""The rows fingerprint the ranks of make_private and DPTrainer compare (dpclip/integrations/rows_fingerprint.py):
same rows in the same order read alike, another order or another row does not."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from dpclip.integrations.rows_fingerprint import rows_fingerprint, sampled_positions


class Augmented(Dataset):
    """Rows with a random augmentation from the global generators (as torchvision's transforms draw)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        noise = torch.rand(()) + random.random() + float(np.random.rand())
        return {"x": self.rows[i] + noise, "label": int(i % 3), "text": f"row {i}", "array": np.arange(3) * i}


def table(n: int = 40) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator))


def test_the_same_rows_in_the_same_order_read_alike_and_another_order_does_not():
    rows = table()
    assert rows_fingerprint(rows) == rows_fingerprint(table())
    shuffled = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
    assert rows_fingerprint(TensorDataset(*(t[shuffled] for t in rows.tensors))) != rows_fingerprint(rows)
    changed = rows.tensors[0].clone()
    changed[17, 2] += 1e-6
    assert rows_fingerprint(TensorDataset(changed, rows.tensors[1])) != rows_fingerprint(rows)
    assert rows_fingerprint(TensorDataset(*(t[:-1] for t in rows.tensors))) != rows_fingerprint(rows)


def test_a_random_augmentation_reads_alike_and_the_global_generators_are_put_back():
    data = Augmented(torch.arange(12.0).reshape(6, 2))
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    first = rows_fingerprint(data)
    after = (torch.rand(()).item(), random.random(), float(np.random.rand()))
    torch.manual_seed(4), random.seed(4), np.random.seed(4)
    assert rows_fingerprint(data) == first   # other global states before: the same reads
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    assert (torch.rand(()).item(), random.random(), float(np.random.rand())) == after


def test_a_large_dataset_is_read_at_evenly_spaced_positions_first_and_last_included():
    assert sampled_positions(5, rows=8) == [0, 1, 2, 3, 4]
    positions = sampled_positions(10_000, rows=8)
    assert positions[0] == 0 and positions[-1] == 9_999 and len(positions) == 8
