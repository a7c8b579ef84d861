"""make_private and DPTrainer on a CUDA device (skipped without one; docs/performance.md, "GPU").

The same checks as tests/integrations on the CPU, with the model and the batches on the GPU:
the step's gradient is the clipped per-example sum over the expected batch size (noise
removed), and the noise the step adds has the planned standard deviation.
"""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from tests.integrations.reference import clipped_per_example_sum, noiseless_step_gradient

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
N, FEATURES, CLASSES, B = 60, 5, 3, 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def _private(model: nn.Module, **kwargs):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, FEATURES, generator=generator),
                         torch.randint(0, CLASSES, (N,), generator=generator))
    options = {"criterion": nn.CrossEntropyLoss(), "delta": 1e-5, "noise_multiplier": 1.0, "steps": 4,
               "max_grad_norm": 0.05, **kwargs}
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=B),
                               **options)


def test_make_private_on_cuda_writes_the_clipped_per_example_sum_over_b(monkeypatch):
    private = _private(_model().cuda(), unsafe_seed=3)
    x, y = next(iter(private.data_loader))
    x, y = x.cuda(), y.cuda()
    expected = clipped_per_example_sum(_model().cuda(), x, y, 0.05)
    for got, want in zip(noiseless_step_gradient(private, x, y, monkeypatch), expected):
        assert got.is_cuda
        torch.testing.assert_close(got, want / B, rtol=1e-4, atol=1e-7)


def test_make_private_on_cuda_adds_noise_of_the_planned_std(monkeypatch):
    """A drawn batch at loss weight 0: p.grad is pure noise, std σ_g·C/B per coordinate. Over the
    123 coordinates of the MLP, the sample std is within 5 standard errors of it
    (std of a sample std ≈ σ/sqrt(2n))."""
    model = _model().cuda()
    private = _private(model)
    model, optimizer, criterion, loader = private
    optimizer.zero_grad()
    x, y = next(iter(loader))
    (criterion(model(x.cuda()), y.cuda()) * 0.0).backward()   # the step's clipped sum is zero
    monkeypatch.setattr(optimizer.original, "step", lambda: None)   # p.grad as released: the noise alone
    optimizer.step()
    noise = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    expected = private.plan.split.gradient_noise_multiplier * 0.05 / B
    assert abs(float(noise.std()) - expected) < 5 * expected / math.sqrt(2 * noise.numel())


def test_dp_trainer_on_cuda_trains_and_charges_every_step(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dpclip.integrations.transformers import DPTrainer, PrivacyArguments

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=8, num_labels=3))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 30, (40, 8), generator=generator)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.int64),
             "labels": torch.tensor(i % 3)} for i in range(40)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=5, max_steps=3,
                                          report_to=[], save_strategy="no", max_grad_norm=0, bf16=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=rows,
                        data_collator=lambda batch: {k: torch.stack([r[k] for r in batch]) for k in batch[0]},
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    assert next(model.parameters()).is_cuda
    assert trainer.account.ledger.steps == 3
