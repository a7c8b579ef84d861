"""A Python caller sees the hint too: ``str(exception)`` is the message and the hint (issue 51, item 5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError


def test_the_string_of_an_error_carries_its_hint_on_a_line_of_its_own():
    assert str(DpclipError("the message", "the hint")) == "the message\nhint: the hint"
    assert str(DpclipError("no hint here")) == "no hint here"


def test_a_make_private_mistake_shows_the_hint_in_the_traceback():
    model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,))), batch_size=4)
    with pytest.raises(DpclipError) as caught:
        dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                            criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, epochs=1, steps=3)
    assert "give exactly one of epochs and steps" in str(caught.value)
    assert "hint: e.g. epochs=3" in str(caught.value)
