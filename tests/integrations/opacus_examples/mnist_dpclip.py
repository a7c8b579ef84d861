"""Opacus's examples/mnist.py, shortened, switched to dpclip."""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import dpclip
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

SIGMA, MAX_GRAD_NORM, DELTA, EPOCHS, BATCH_SIZE, LR = 1.1, 1.0, 1e-5, 1, 64, 0.1


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, 2)
        self.fc1 = nn.Linear(32 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 1)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 1)
        x = x.view(-1, 32 * 2 * 2)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def train(model, train_loader, optimizer, criterion, private, epoch):
    model.train()
    losses = []
    for data, target in train_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    epsilon = private.get_epsilon(delta=DELTA)
    return sum(losses) / max(len(losses), 1), epsilon


def main():
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    train_set = TensorDataset(images[:1400], torch.tensor(digits.target[:1400]))
    train_loader = DataLoader(train_set, batch_size=BATCH_SIZE)
    torch.manual_seed(0)
    model = SampleConvNet()
    optimizer = optim.SGD(model.parameters(), lr=LR, momentum=0)
    private = dpclip.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=SIGMA,
        max_grad_norm=MAX_GRAD_NORM,
        poisson_sampling=True,
        criterion=nn.CrossEntropyLoss(),
        target_delta=DELTA,
        epochs=EPOCHS,
    )
    model, optimizer, criterion, train_loader = private
    for epoch in range(1, EPOCHS + 1):
        loss, epsilon = train(model, train_loader, optimizer, criterion, private, epoch)
    return epsilon
