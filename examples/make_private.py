"""DP-SGD in a plain PyTorch loop with dpclip.make_private (docs/python-api.md).

    python examples/make_private.py [OUTPUT_DIR]

Trains a small MLP on scikit-learn's handwritten digits at ε = 8 (δ = 1e-5), prints the
held-out accuracy and ε, and writes ledger.json and privacy.json to OUTPUT_DIR
(default: make_private_out).
"""

import sys

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip

digits = load_digits()
features = torch.tensor(digits.data / 16.0, dtype=torch.float32)
labels = torch.tensor(digits.target)
train_set = TensorDataset(features[:1400], labels[:1400])
test_features, test_labels = features[1400:], labels[1400:]

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
train_loader = DataLoader(train_set, batch_size=64)

private = dpclip.make_private(model, optimizer, train_loader, criterion=nn.CrossEntropyLoss(),
                              target_epsilon=8.0, delta=1e-5, epochs=15, max_grad_norm=1.0)
model, optimizer, criterion, train_loader = private

for epoch in range(15):
    for x, y in train_loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()

with torch.no_grad():
    accuracy = (model(test_features).argmax(1) == test_labels).float().mean().item()
print(f"held-out accuracy {accuracy:.3f} (not covered by ε), ε = {private.epsilon():.3f}, δ = 1e-05")
print(f"wrote {private.save(sys.argv[1] if len(sys.argv) > 1 else 'make_private_out')}")
