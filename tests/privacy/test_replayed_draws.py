"""A fallback module's random draw replayed in each sample's recomputation (peft LoHa's module
dropout, docs/supported-models.md "What is refused") rewinds the global generator only inside the
recomputation: the private noise is drawn from its own generator, which the replay never touches,
and the user's global stream continues exactly where the forward left it (an attacker who knows
the recipe seed learns nothing more about the noise than before)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine


class ModuleDropout(nn.Module):
    """Skips its own scaling with probability 1/2, one draw for the whole batch (LoHa's pattern)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 1.5))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = x * self.scale if torch.rand(1) > 0.5 else x
        return self.head(h)


def test_a_replayed_draw_leaves_the_noise_generator_and_the_global_stream_untouched():
    torch.manual_seed(0)
    model = ModuleDropout()
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                      gradient_noise_multiplier=1.0, expected_batch_size=6)
    noise = engine.noise.generator(torch.device("cpu"))
    noise_before = noise.get_state().clone()
    torch.manual_seed(11)
    losses = F.cross_entropy(model(x), y, reduction="none")
    after_forward = torch.random.get_rng_state().clone()
    engine.backward(losses)          # each of the 6 samples' recomputation replays the forward's draw
    assert torch.equal(torch.random.get_rng_state(), after_forward)
    assert torch.equal(noise.get_state(), noise_before)
    torch.manual_seed(11)
    torch.rand(1)                    # the forward's one draw
    assert torch.equal(torch.random.get_rng_state(), after_forward)
    engine.detach()
