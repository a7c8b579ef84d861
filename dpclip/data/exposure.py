"""Secrets planted in a language model's training text, for canary exposure (Carlini, Liu,
Erlingsson, Kos, Song 2019, "The Secret Sharer"; docs/auditing.md).

A recipe's ``audit: {exposure: {template, alphabet, length, repetitions, controls}}`` draws
one secret of ``length`` characters of ``alphabet`` per entry of ``repetitions`` and puts
``template`` with that secret into the TRAINING text as many times as the entry says; it
also draws ``controls`` secrets the same way that are never planted. After training,
``dpclip audit-mia RUN --attack exposure`` ranks each secret among every candidate of the
space by the model's log-perplexity (dpclip.audit.exposure).

The secrets are drawn from OS entropy, never from the recipe seed: whoever holds the recipe
must not know them. The entropy and the secrets are written to ``audit/exposure.json``, a
secret of the run (the audit's answer key); a resumed run reads them back from there, and
the ranks of a multi-process run take rank 0's draw.

Accounting: the planted rows do NOT change N, as for the one-run canaries
(dpclip.data.canaries): every row, planted or not, is sampled at the same q = B/N, and the
guarantee of each step is a function of q, σ and the steps only. A secret planted r times is
r records; its exposure measures what r records of the same text leak (at the user level
the r records are one new person).
"""

from __future__ import annotations

import hashlib
import json
import secrets as os_entropy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpclip import layout
from dpclip.data.canaries import append_people, read_secret, write_secret
from dpclip.data.columns import text_tensors
from dpclip.errors import DpclipError

EXPOSURE_FILE = Path(layout.AUDIT) / layout.EXPOSURE
SECRET_SLOT = "{secret}"   # where a template takes its secret (audit.exposure.template)


@dataclass
class ExposureSet:
    """A run's planted secrets (``repetitions[j]`` copies of secret j; 0 for a control)."""

    template: str
    alphabet: str
    length: int
    secrets: list[str]
    repetitions: list[int]
    entropy: int

    @property
    def space(self) -> int:
        return len(self.alphabet) ** self.length

    def text(self, secret: str) -> str:
        return self.template.replace(SECRET_SLOT, secret)

    def planted_texts(self) -> list[str]:
        """The training rows: each planted secret's text, repeated, secret by secret."""
        return [self.text(s) for s, r in zip(self.secrets, self.repetitions) for _ in range(r)]

    def fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps([self.template, self.alphabet, self.secrets, self.repetitions]).encode())
        return digest.hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"template": self.template, "alphabet": self.alphabet, "length": self.length,
                "secrets": self.secrets, "repetitions": self.repetitions, "entropy": str(self.entropy),
                "fingerprint": self.fingerprint()}


def draw_exposure(config, entropy: int | None = None) -> ExposureSet:
    """The secrets of ``config`` (a recipe's ``audit.exposure``): planted ones first, then the
    controls, all distinct; ``entropy`` None draws fresh OS entropy (a new run)."""
    entropy = os_entropy.randbits(128) if entropy is None else int(entropy)
    count = len(config.repetitions) + config.controls
    if count > config.space:
        raise DpclipError(f"audit.exposure wants {count} distinct secrets, but the space holds {config.space}",
                          "lengthen audit.exposure.length or widen its alphabet")
    rng = np.random.default_rng(entropy)
    drawn: dict[str, None] = {}
    while len(drawn) < count:
        drawn[''.join(rng.choice(list(config.alphabet), size=config.length))] = None
    return ExposureSet(config.template, config.alphabet, config.length, list(drawn),
                       [*config.repetitions, *([0] * config.controls)], entropy)


def exposure_rows(data, exposure: ExposureSet) -> dict[str, torch.Tensor]:
    """The planted rows, tokenized as the data set's own text (right-padded to its length)."""
    max_length = data.input_shape[0]
    texts = exposure.planted_texts()
    rows = text_tensors(texts, data.tokenizer, max_length)
    # A secret cut off by truncation is not what the audit ranks: refuse before training. Every
    # secret, planted or control, and each character of the alphabet repeated (the longest
    # candidates of the space for the byte tokenizer): token counts differ (a multi-byte
    # character, a tokenizer's merges), so the first secret's says nothing of the others'.
    texts = [exposure.text(s) for s in [*exposure.secrets, *(c * exposure.length for c in exposure.alphabet)]]
    whole = text_tensors(texts, data.tokenizer, max_length + 8 * exposure.length + 64)
    needed = int(whole["attention_mask"].sum(dim=1).max())
    if needed > max_length:   # the secrets are the answer key: never shown
        raise DpclipError(f"the planted text {exposure.text('X' * exposure.length)!r} needs up to {needed} tokens "
                          f"with secrets of its alphabet, more than data.max_length {max_length}",
                          "shorten audit.exposure.template or raise data.max_length (or use an alphabet of "
                          "one-byte characters)")
    return rows


def with_exposure(data, exposure: ExposureSet):
    """A copy of ``data`` whose training set ends with the planted rows (each planted secret a
    new person at the user level). ``train_indices`` is left as it was: planted rows are
    not members of the data set."""
    if data.tokenizer is None or "input_ids" not in data.train:
        raise DpclipError("audit.exposure plants secrets in text, and this data set is not text",
                          "use audit.canaries for tables and images")
    rows = exposure_rows(data, exposure)
    return append_people(data, rows, [r for r in exposure.repetitions if r > 0])


def write_exposure_secret(run_dir: Path, exposure: ExposureSet) -> None:
    write_secret(run_dir, EXPOSURE_FILE, exposure.to_dict())


def read_exposure_secret(run_dir: Path) -> dict | None:
    """The run's audit/exposure.json, or None when the run planted no secrets."""
    return read_secret(run_dir, EXPOSURE_FILE)


def stored_exposure(run_dir: Path, config) -> ExposureSet:
    """The secrets a run planted, redrawn from its stored entropy and checked against the file."""
    stored = read_exposure_secret(run_dir)
    if stored is None:
        raise DpclipError(f"{run_dir} has no {EXPOSURE_FILE}, so its planted secrets are unknown",
                          "the answer key was deleted or the run planted none; train a new run with audit.exposure")
    exposure = draw_exposure(config, int(stored["entropy"]))
    if exposure.fingerprint() != stored["fingerprint"]:
        raise DpclipError(f"{Path(run_dir) / EXPOSURE_FILE} does not match the recipe's audit.exposure",
                          "the recipe's audit block changed since training; restore it")
    return exposure
