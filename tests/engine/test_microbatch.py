"""How often a step reads values back from the device (dpclip/engine/microbatch.py).

On a GPU each read (``.tolist()``, ``float(t)``, ``bool(t)``, ``.item()``) makes the host wait
for the device, so a GPT-2 layer-wise step paid two per group: the cancellation check's flags
and the non-finite check. They are one read now; counted here on the CPU, where the same
calls happen."""

import torch
from torch import nn

from dpclip.engine import DPEngine


class _Net(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(depth))
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x).pow(2).mean((1, 2))


def _reads_per_step(monkeypatch, grouping, depth):
    model = _Net(depth)
    engine = DPEngine(model, {"grouping": grouping, "norm_method": "ghost"}, gradient_noise_multiplier=1.0,
                      expected_batch_size=4, seed=0)
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0))
    engine.backward(model(x))   # first step: batch-axis probes
    engine.privatize()
    model.zero_grad(set_to_none=True)
    count = [0]
    for name in ("tolist", "item", "__float__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            count[0] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    engine.backward(model(x))
    monkeypatch.undo()
    return count[0], len(engine.groups)


def test_layer_wise_backward_reads_the_device_once_per_group(monkeypatch):
    reads, groups = _reads_per_step(monkeypatch, "layer", depth=6)
    assert groups == 7
    assert reads <= groups + 2, reads


def test_reads_grow_by_one_per_added_layer(monkeypatch):
    shallow, _ = _reads_per_step(monkeypatch, "layer", depth=3)
    deep, _ = _reads_per_step(monkeypatch, "layer", depth=7)
    assert deep - shallow == 4, (shallow, deep)
