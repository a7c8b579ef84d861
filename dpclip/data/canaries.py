"""Canaries for the one-run audit (Steinke, Nasr, Jagielski 2023; docs/auditing.md).

A recipe's ``audit: {canaries: {count, kind}}`` makes ``count`` canary examples, and each
is put into the TRAINING set independently with probability 1/2. Which ones went in is
the secret the audit later tries to guess from the trained model alone.

Kinds (classification only: a canary needs a label the model can memorise):

- ``mislabel``: a held-out (test) example with its label replaced by a different class
  drawn at random. Its input is in-distribution, its label is not.
- ``ood``: an input of uniform noise in a PUBLIC domain ``[low, high]`` (every coordinate),
  with a random label (tables and images only). The domain is ``audit.canaries.domain``,
  or what a builtin data set declares of itself (:data:`dpclip.data.builtin.FEATURE_DOMAINS`);
  it is never measured on the training set: the released model is trained on the
  canaries, so a range taken from the private rows would leak through them. With neither,
  the run is refused before training.

Everything is drawn from the canary seed, which is fresh OS entropy at the start of a run
(never the recipe seed: whoever holds the recipe must not be able to rebuild the answer
key), or ``audit.canaries.seed`` if the recipe sets one (reproducible, and then the recipe
is as secret as the answer key). The seed and the inclusion bits are written to
``audit/canaries.json`` in the run directory, which is therefore a secret of the run:
whoever reads it knows which canaries were trained on. A resumed run and the audit rebuild
the canaries from the seed stored there.

User-level runs (``privacy.unit: user``, docs/users.md) get canary PEOPLE: each canary is a new
person with ``records`` records (k, the recipe's max_examples_per_user) that all go in or all
stay out together, ood inputs with one label per person; the audit scores a canary person by
the mean over their records. Mislabel canaries are refused there (the recipe's
:func:`dpclip.recipe.audit.check_audit`, and :func:`make_canaries`): their rows are real
held-out people's records, and numbering blocks of them as new people would put one real
person into several privacy units (group privacy only, not the ledger's per-person ε).

Accounting: the canaries do NOT change N. The Poisson rate is q = batch_size / N with N
the number of ordinary training examples (what `dpclip account RECIPE` uses), and the
sampler draws every example, canaries included, with that same q. The DP guarantee of
Poisson-subsampled Gaussian steps depends only on q, σ and the number of steps, so it
holds for each canary as for any other example; the expected batch grows by a factor
(N + included) / N, which only makes the per-step noise relatively smaller in the
gradient average, not the privacy weaker.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dpclip import layout
from dpclip.data.builtin import FEATURE_DOMAINS
from dpclip.errors import DpclipError
from dpclip.files import private_dir, write_json_atomic

CANARY_FILE = Path(layout.AUDIT) / layout.CANARIES


@dataclass
class CanarySet:
    """The canaries of a run: tensors (``records`` rows per canary, canary j's rows together)
    and the inclusion secret."""

    kind: str
    seed: int
    tensors: dict[str, torch.Tensor]        # same keys as PrivateData.train; labels are canary labels
    included: np.ndarray                    # bool [count]: trained on or not (the secret)
    sources: list[int | None]               # mislabel: row of data.test the input came from (per row)
    records: int = 1                        # rows per canary: 1, or k for a canary person (user-level)

    @property
    def count(self) -> int:
        return len(self.included)

    @property
    def rows_included(self) -> np.ndarray:
        """bool per row: the rows of the included canaries."""
        return np.repeat(self.included, self.records)

    def fingerprint(self) -> str:
        """Hash of the canary tensors, so an audit can check it rebuilt the same canaries."""
        digest = hashlib.sha256()
        for name in sorted(self.tensors):
            digest.update(name.encode())
            digest.update(self.tensors[name].contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "seed": self.seed, "count": self.count, "fingerprint": self.fingerprint(),
                "included": [bool(b) for b in self.included], "sources": self.sources,
                "labels": [int(y) for y in self.tensors["labels"]], "records": self.records}


def canary_seed(config, run_dir: Path | None = None) -> int | None:
    """The seed of a run's canaries: the one stored in ``run_dir``'s audit/canaries.json (a
    resumed or audited run), else ``config.seed`` if the recipe sets one, else None: the
    caller draws fresh OS entropy (module doc)."""
    if run_dir is not None:
        stored = read_canary_secret(run_dir)
        if stored is None:
            raise missing_answer_key(run_dir, "the run's canaries cannot be rebuilt")
        return int(stored["seed"])
    if getattr(config, "seed", None) is not None:
        return int(config.seed)
    return None


def missing_answer_key(run_dir: Path, consequence: str) -> DpclipError:
    """The error for a run whose recipe has canaries and whose audit/canaries.json is gone."""
    return DpclipError(f"{Path(run_dir) / CANARY_FILE} is missing: the recipe planted canaries, but their answer "
                       f"key was deleted, so {consequence}",
                       "restore it from a backup of the run directory (dpclip train writes it once, at the "
                       "start); without it, train a new run with audit.canaries")


def ood_domain(config, source: str) -> tuple[float, float]:
    """The public ``(low, high)`` of ood canaries: ``config.domain`` if declared, else the
    builtin data set's own (``source`` is ``PrivateData.source``, e.g. ``builtin:digits``).

    Only declared, public values: nothing here looks at the data's rows.
    """
    if getattr(config, "domain", None) is not None:
        low, high = config.domain
        return float(low), float(high)
    kind, _, name = source.partition(":")
    if kind == "builtin" and name in FEATURE_DOMAINS:
        return FEATURE_DOMAINS[name]
    raise DpclipError(f"ood canaries need a public feature domain, and {source} declares none "
                      "(the private data's own range would leak through the canaries)",
                      "set audit.canaries.domain: [low, high] to the range your features can take, from "
                      "public knowledge of the data (e.g. [0, 255] for 8-bit pixels), not from the data; "
                      "or use audit.canaries.kind: mislabel")


def make_canaries(data, config, seed: int, records: int = 1) -> CanarySet:
    """Build the canaries of ``config`` (a recipe's ``audit.canaries``) for ``data`` from the
    canary ``seed`` (:func:`canary_seed`); ``records`` > 1: canary people of that many records
    each (module doc).

    Deterministic in the seed: calling it twice gives the same inputs, labels and inclusion bits.
    """
    if data.task != "classification" or not data.num_classes or data.num_classes < 2:
        raise DpclipError(f"canaries need a classification task with at least 2 classes, not {data.task}",
                          "remove audit.canaries from the recipe, or audit this run with --attack loss|lira")
    rng = np.random.default_rng(seed)
    count = config.count
    included = rng.random(count) < 0.5
    rows_needed = count * records
    if config.kind == "mislabel":
        if records > 1:
            raise DpclipError("mislabel canaries are held-out records of real people; canary people made of them "
                              "would split a real person across several privacy units",
                              "at privacy.unit: user use audit.canaries.kind: ood (with audit.canaries.domain)")
        if rows_needed > data.num_test:
            raise DpclipError(f"{count} mislabel canaries of {records} records need {rows_needed} held-out examples, "
                              f"the test split has {data.num_test}", "lower audit.canaries.count, or use kind: ood")
        rows = np.sort(rng.choice(data.num_test, size=rows_needed, replace=False))
        tensors = {name: t[torch.as_tensor(rows)].clone() for name, t in data.test.items()}
        true = tensors["labels"].numpy()
        # A different class, uniformly: true + shift (mod C), shift in 1..C-1.
        shift = rng.integers(1, data.num_classes, size=rows_needed)
        tensors["labels"] = torch.as_tensor((true + shift) % data.num_classes, dtype=torch.int64)
        sources: list[int | None] = [int(r) for r in rows]
    elif config.kind == "ood":
        if "features" not in data.train:
            raise DpclipError("ood canaries are uniform-noise feature vectors; this data set is text",
                              "use audit.canaries.kind: mislabel for text classification")
        features = data.train["features"]
        low, high = ood_domain(config, data.source)
        noise = rng.random((rows_needed, *features.shape[1:])).astype(np.float32)
        labels = np.repeat(rng.integers(0, data.num_classes, size=count), records)   # one label per canary
        tensors = {"features": torch.as_tensor(low + noise * (high - low), dtype=features.dtype),
                   "labels": torch.as_tensor(labels, dtype=torch.int64)}
        sources = [None] * rows_needed
    else:
        raise DpclipError(f"unknown canary kind {config.kind!r}", "use mislabel or ood")
    return CanarySet(config.kind, seed, tensors, included, sources, records)


def with_canaries(data, canaries: CanarySet):
    """A copy of ``data`` whose training set ends with the included canaries.

    ``train_indices`` (positions in the original data set, recorded as the run's
    members) is left as it was: canaries are not members of the data set.
    """
    keep = torch.as_tensor(np.flatnonzero(canaries.rows_included))
    rows = {name: t[keep] for name, t in canaries.tensors.items()}
    return append_people(data, rows, [canaries.records] * int(canaries.included.sum()))


def append_people(data, rows: dict[str, torch.Tensor], records: list[int]):
    """A copy of ``data`` whose training set ends with ``rows`` (canaries, planted secrets);
    at the user level each entry of ``records`` is a new person with that many of the rows
    in turn, numbered after the training people."""
    train = {name: torch.cat([t, rows[name].to(t.dtype)]) for name, t in data.train.items()}
    if data.train_users is None:
        return replace(data, train=train)
    people = torch.repeat_interleave(torch.arange(len(records), dtype=torch.int64),
                                     torch.as_tensor(records, dtype=torch.int64))
    start = int(data.train_users.max()) + 1 if len(data.train_users) else 0
    return replace(data, train=train, train_users=torch.cat([data.train_users, start + people]))


def write_secret(run_dir: Path, relative: Path, record: dict) -> None:
    """A secret file of the run (the audit's answer key), written atomically."""
    path = Path(run_dir) / relative
    private_dir(path.parent)
    write_json_atomic(path, record)


def read_secret(run_dir: Path, relative: Path, check: Callable[[dict], str | None] | None = None,
                without: str = "or audit without it (--attack loss)") -> dict | None:
    """A secret file of the run, or None when the run has none; ``check`` names what is wrong
    with the mapping read (None: nothing). A damaged file is an error saying so and how to
    proceed (``without``: what can be done without the file)."""
    path = Path(run_dir) / relative
    if path.parent.exists() and not path.parent.is_dir():
        raise DpclipError(f"{path.parent} is a file, not the run's audit folder",
                          "the run directory was modified: restore it from a backup (move the file away to "
                          "audit a run that planted nothing)")
    if not path.exists():
        return None
    try:
        secret = json.loads(path.read_text(encoding="utf-8"))
        problem = f"a {type(secret).__name__}, not a mapping" if not isinstance(secret, dict) else \
            (check(secret) if check is not None else None)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = type(exc).__name__
    if problem is not None:
        raise DpclipError(f"{path} is damaged ({problem}): the audit's answer key cannot be read",
                          "it is written once by dpclip train and never changed: restore it from a backup of "
                          f"the run directory, {without}")
    return secret


def _is_int(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def canary_secret_problem(secret: dict) -> str | None:
    """What is wrong with the answer key ``secret`` (the fields :meth:`CanarySet.to_dict`
    writes, each of its type), or None. ``count``, ``labels`` and ``records`` are optional
    (older runs lack some); ``sources`` has one entry per canary row."""
    if secret.get("kind") not in ("mislabel", "ood"):
        return "kind is not mislabel or ood"
    if not _is_int(secret.get("seed")):
        return "seed is not a non-negative integer"
    if not isinstance(secret.get("fingerprint"), str):
        return "fingerprint is not a string"
    included = secret.get("included")
    if not isinstance(included, list) or not included or not all(isinstance(b, bool) for b in included):
        return "included is not a list of true/false"
    if "count" in secret and secret["count"] != len(included):
        return f"count is not the {len(included)} inclusion bits"
    records = secret.get("records", 1)
    if not _is_int(records, 1):
        return "records is not a positive integer"
    sources = secret.get("sources")
    if not isinstance(sources, list) or len(sources) != len(included) * records:
        return f"sources is not a list of {len(included) * records} entries, one per canary row"
    if not all(s is None or _is_int(s) for s in sources) or \
            (secret["kind"] == "ood") != all(s is None for s in sources):
        return f"sources is not a list of {'nulls' if secret['kind'] == 'ood' else 'held-out row numbers'}"
    labels = secret.get("labels")
    if labels is not None and not (isinstance(labels, list) and all(_is_int(y) for y in labels)):
        return "labels is not a list of class numbers"
    return None


def write_canary_secret(run_dir: Path, canaries: CanarySet) -> None:
    write_secret(run_dir, CANARY_FILE, canaries.to_dict())


def read_canary_secret(run_dir: Path) -> dict | None:
    """The run's audit/canaries.json, or None when the run has no canaries; a damaged one
    (:func:`canary_secret_problem`) is an error."""
    return read_secret(run_dir, CANARY_FILE, canary_secret_problem, without="or train a new run")
