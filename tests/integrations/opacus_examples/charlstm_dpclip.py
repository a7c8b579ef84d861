"""Opacus's examples/char-lstm-classification.py, shortened, switched to dpclip."""

import random

import torch
import torch.nn as nn
import dpclip
from opacus.layers import DPLSTM
from torch.utils.data import DataLoader, TensorDataset

SIGMA, MAX_PER_SAMPLE_GRAD_NORM, DELTA, EPOCHS, BATCH_SIZE, LR = 1.0, 1.5, 1e-5, 1, 32, 2.0
VOCAB_SIZE, MAX_LENGTH = 128, 12
SYLLABLES = {"italian": ["ro", "ssi", "lli", "ni", "ca", "ta"], "german": ["berg", "mann", "sch", "ner", "hof"],
             "japanese": ["ka", "shi", "mo", "ta", "ya", "ki"], "irish": ["mac", "o'", "gh", "an", "ey"]}


def names_dataset(count, seed=0):
    rng = random.Random(seed)
    xs, ys = [], []
    for _ in range(count):
        label = rng.randrange(len(SYLLABLES))
        parts = list(SYLLABLES.values())[label]
        name = "".join(rng.choice(parts) for _ in range(rng.randint(2, 4)))[:MAX_LENGTH]
        xs.append([0] * (MAX_LENGTH - len(name)) + [ord(c) for c in name])
        ys.append(label)
    return TensorDataset(torch.tensor(xs), torch.tensor(ys))


class CharNNClassifier(nn.Module):
    def __init__(self, embedding_size, hidden_size, output_size, vocab_size=VOCAB_SIZE):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.lstm = DPLSTM(embedding_size, hidden_size, batch_first=True)
        self.out_layer = nn.Linear(hidden_size, output_size)

    def forward(self, x, hidden=None):
        x = self.embedding(x)
        x, _ = self.lstm(x, hidden)
        x = x[:, -1, :]
        return self.out_layer(x)


def train(model, criterion, optimizer, train_loader, epoch, private):
    accs, losses = [], []
    for x, y in train_loader:
        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        accs.append(float(logits.argmax(-1).eq(y).sum()) / max(len(y), 1))
        losses.append(float(loss))
    return private.get_epsilon(DELTA)


def main():
    torch.manual_seed(0)
    train_loader = DataLoader(names_dataset(640), batch_size=BATCH_SIZE)
    model = CharNNClassifier(16, 32, len(SYLLABLES))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    private = dpclip.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=SIGMA,
        max_grad_norm=MAX_PER_SAMPLE_GRAD_NORM,
        criterion=criterion,
        target_delta=DELTA,
        epochs=EPOCHS,
    )
    model, optimizer, criterion, train_loader = private
    for epoch in range(EPOCHS):
        epsilon = train(model, criterion, optimizer, train_loader, epoch, private)
    return epsilon
