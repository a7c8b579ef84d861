"""What each spawned rank runs in tests/distributed/test_api_agreement.py (importable by name):
make_private called with arguments that differ on rank 1."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dpclip import make_private
from dpclip.errors import DpclipError
from dpclip.integrations import setup
from tests.distributed.api_case import CLASSES, FEATURES, data

#: what rank 1 changes, by case: make_private's keyword arguments, or the model's dtype
ON_RANK_ONE = {
    "max_grad_norm": {"max_grad_norm": 50.0},     # its examples clipped at 50, the noise sized for 0.5
    "noise_multiplier": {"noise_multiplier": 0.1},
    "delta": {"delta": 1e-3},
    "steps": {"steps": 400},
    "batch_size": {"per_rank_batch": 24},          # its draws at another rate q than the plan's
    "grouping": {"clipping": {"grouping": "all-layer"}},
    "dtype": {"dtype": torch.float64},
    # the same rows in another order (a per-rank shuffle): rank r owns positions r, r + W, ..., so some
    # examples would be owned by both ranks (in a batch with probability about 2q, or twice) and some by none
    "order": {"order": "reversed"},
    # another row at one of the sampled positions (another file; the last row is always read)
    "content": {"content": "last row"},
    # another dpclip install (another node): its sampling and clipping under rank 0's plan
    "code": {"code": "dpclip 0.0.9 (source 0123456789ab), torch 2.0.0"},
}


class Rows(Dataset):
    """A map-style dataset that is not a TensorDataset (its rows are read one by one), reversed if asked."""

    def __init__(self, rows: TensorDataset, reversed_rows: bool = False):
        self.rows, self.reversed_rows = rows, reversed_rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[len(self.rows) - 1 - i if self.reversed_rows else i]


REAL_CODE = setup.code_fingerprint


def private(rank: int, case: str | None):
    """make_private on rank ``rank``, rank 1 changed by ``case``; None where every rank agrees."""
    changed = ON_RANK_ONE[case] if case is not None and rank == 1 else {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)).to(
        changed.get("dtype", torch.float32))
    dataset = data()
    if "dtype" in changed:
        dataset = TensorDataset(dataset.tensors[0].double(), dataset.tensors[1])
    if "order" in changed:
        dataset = Rows(dataset, reversed_rows=True)
    if "content" in changed:
        features = dataset.tensors[0].clone()
        features[-1] += 1.0
        dataset = Rows(TensorDataset(features, dataset.tensors[1]))
    arguments = dict(delta=1e-5, noise_multiplier=1.0, steps=4, max_grad_norm=0.5, clipping={"grouping": "layer"})
    arguments.update({k: v for k, v in changed.items() if k in arguments})
    loader = DataLoader(dataset, batch_size=changed.get("per_rank_batch", 6))
    setup.code_fingerprint = (lambda: changed["code"]) if "code" in changed else REAL_CODE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.5), loader,
                                   criterion=nn.CrossEntropyLoss(), **arguments)


def each_case(world, out: str) -> None:
    """Every case in turn (one spawn): rank 0 writes what each rank raised, or "trained"."""
    found = {}
    for case in [*ON_RANK_ONE, None]:
        try:
            training = private(world.rank, case)
            model, optimizer, criterion, loader = training
            for x, y in loader:
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()
            found[case] = ("trained", training.account.ledger.steps)
        except DpclipError as exc:
            found[case] = (type(exc).__name__, exc.message, exc.hint)
    torch.save(found, Path(out) / f"rank{world.rank}.pt")
