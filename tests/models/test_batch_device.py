"""Every forward of a run goes through PerSampleLoss, which brings the rows to the model's device."""

import torch
from torch import nn

from dpclip.models.losses import PerSampleLoss, batch_on_model_device


def test_a_batch_on_the_models_device_is_passed_through_untouched():
    model = nn.Linear(3, 2)
    batch = {"features": torch.randn(4, 3), "labels": torch.zeros(4, dtype=torch.long)}
    assert batch_on_model_device(model, batch) is batch


def test_a_batch_moves_to_the_device_of_the_models_parameters():
    model = nn.Linear(3, 2, device="meta")  # a second device on any machine: shapes only, no data
    batch = {"features": torch.randn(4, 3), "labels": torch.zeros(4, dtype=torch.long)}
    moved = batch_on_model_device(model, batch)
    assert {t.device.type for t in moved.values()} == {"meta"}
    assert moved["labels"].dtype == torch.long and batch["features"].device.type == "cpu"
    seen = []
    loss = PerSampleLoss(lambda m, b: (seen.append(b["features"].device.type), m(b["features"]))[1],
                         lambda out, b: out.sum(1))
    assert loss(model, batch).device.type == "meta" and seen == ["meta"]
