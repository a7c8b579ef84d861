"""From a recipe's ``data`` section to :class:`PrivateData`: tensors, task and split.

One entry point, :func:`load_data`, for every source:

- ``builtin``: digits (tables or 1x8x8 images) and synthetic restaurant text;
- ``files``: local csv / json / jsonl / parquet tables and plain text;
- ``hf``: Hugging Face data sets by name (network or local cache).

Whatever the source, the columns are read first and then turned into tensors by the same
rules (:mod:`dpclip.data.columns`: the task from the label column, text, tables, images).

The train/test split is :func:`dpclip.data.split.split_indices` with a *split key*: a run's
is drawn from OS entropy and kept in its meta.json (secret), so that nobody holding the
released recipe (and its seed) can recompute who is a member; without a key (tests, plans that
count rows) the recipe's seed draws it. A separate test file or split is taken as it is. Either
way the split's fingerprint is recorded so an audit can rebuild members and non-members later. Data with users (builtin
synthetic-users, or ``data.user_field``) are split by person instead: the test set holds
test_fraction of the people with all their records, and ``PrivateData.train_users`` says
who wrote each training row (docs/users.md).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dpclip.data.builtin import (FOODS, load_digits_arrays, synthetic_cuisine_sentences, synthetic_restaurant_sentences,
                                 synthetic_user_sentences)
from dpclip.data.columns import Examples, examples_from_columns, require_columns, text_tensors
from dpclip.data.files import Columns, read_table, read_text_lines, words_read_as_missing
from dpclip.data.hub import load_hub_columns
from dpclip.data.split import carve_indices, split_fingerprint, split_indices
from dpclip.data.tokenizers import Tokenizer, load_tokenizer
from dpclip.data.user_sampler import spelling_clash
from dpclip.errors import DpclipError, quoting_data

TASKS = ("classification", "regression", "causal-lm")


@dataclass
class PrivateData:
    """The private training set, the held-out test set, and what they hold.

    ``train`` and ``test`` map names to tensors with one row per example:
    ``features`` (float32) and ``labels`` for tables and images; ``input_ids``,
    ``attention_mask`` (int64 ``[N, T]``) and ``labels`` for text. Causal-LM labels are
    the input ids with padding set to -100; classification labels are int64 class ids;
    regression labels are float32.

    ``train_indices`` / ``test_indices`` are the rows' positions in the original data
    set (or in their own file or split when a separate test set was given); together
    with ``fingerprint`` they say exactly who is a member of the training set.
    """

    train: dict[str, torch.Tensor]
    test: dict[str, torch.Tensor]
    task: str
    input_shape: tuple[int, ...]
    train_indices: np.ndarray
    test_indices: np.ndarray
    fingerprint: str
    source: str
    num_classes: int | None = None
    label_names: list[str] | None = None
    vocab_size: int | None = None
    pad_token_id: int | None = None
    tokenizer: Tokenizer | None = field(default=None, repr=False)
    # A table's feature columns in the order ``features`` holds them (None: no named columns)
    feature_names: list[str] | None = None
    # Who wrote each training row: user ids 0..U-1 (int64, one per row of ``train``), or None
    # for data without users. Kept out of ``train`` so that no batch ever feeds it to a model.
    train_users: torch.Tensor | None = field(default=None, repr=False)
    # The same for the held-out rows, numbered on from the training people (U..): the people of
    # a user-level audit's non-members.
    test_users: torch.Tensor | None = field(default=None, repr=False)
    # The key the train/test split was drawn with (None: the recipe's seed); secret, like the members
    split_key: int | None = field(default=None, repr=False)

    @property
    def num_train(self) -> int:
        """N, the number of private examples the sampler draws from."""
        return len(self.train["labels"])

    @property
    def num_users(self) -> int | None:
        """U, the number of people in the training set (None: data without users)."""
        return None if self.train_users is None else int(self.train_users.max()) + 1 if len(self.train_users) else 0

    @property
    def num_test(self) -> int:
        return len(self.test["labels"])

    @property
    def is_text(self) -> bool:
        return "input_ids" in self.train

    def describe(self) -> dict:
        """A short JSON-ready summary for the run's meta.json."""
        return {
            "source": self.source,
            "task": self.task,
            "num_train": self.num_train,
            "num_test": self.num_test,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "vocab_size": self.vocab_size,
            "tokenizer": getattr(self.tokenizer, "name", None),
            "split_fingerprint": self.fingerprint,
        }


def select(tensors: dict[str, torch.Tensor], indices) -> dict[str, torch.Tensor]:
    """The rows ``indices`` of every tensor of a split (e.g. one batch)."""
    return {name: tensor[indices] for name, tensor in tensors.items()}


# ------------------------------------------------------------------------- sources

def _builtin_examples(config, seed: int) -> Examples:
    if config.name == "digits":
        features, labels = load_digits_arrays(config.as_images)
        part = {"features": torch.as_tensor(features), "labels": torch.as_tensor(labels)}
        return Examples([part], "classification", tuple(features.shape[1:]), num_classes=10)
    if config.name == "synthetic-text":
        text_tokenizer = load_tokenizer(config.tokenizer)
        texts = synthetic_restaurant_sentences(config.num_examples, seed)
        part = text_tensors(texts, text_tokenizer, config.max_length)
        return Examples([part], "causal-lm", (config.max_length,), tokenizer=text_tokenizer)
    if config.name == "synthetic-cuisine":
        text_tokenizer = load_tokenizer(config.tokenizer)
        texts, labels = synthetic_cuisine_sentences(config.num_examples, seed)
        part = text_tensors(texts, text_tokenizer, config.max_length, labels=torch.as_tensor(labels))
        return Examples([part], "classification", (config.max_length,), num_classes=len(FOODS),
                        label_names=list(FOODS), tokenizer=text_tokenizer)
    if config.name == "synthetic-users":
        text_tokenizer = load_tokenizer(config.tokenizer)
        if config.num_users > config.num_examples:
            raise DpclipError(f"data.num_users ({config.num_users}) is above data.num_examples ({config.num_examples})",
                              "every synthetic user writes at least one sentence: use fewer users")
        texts, users = synthetic_user_sentences(config.num_examples, config.num_users, seed)
        part = text_tensors(texts, text_tokenizer, config.max_length)
        return Examples([part], "causal-lm", (config.max_length,), tokenizer=text_tokenizer, users=[users])
    raise DpclipError(f"unknown builtin data set {config.name!r}",
                      "use digits, synthetic-text, synthetic-cuisine or synthetic-users")


def _files_examples(config) -> Examples:
    paths = [config.train] + ([config.test] if config.test is not None else [])
    origin = config.train
    if config.format == "text":
        if config.label_field is not None or config.feature_fields is not None:
            raise DpclipError("format: text holds one example per line and no columns",
                              "for labelled text use csv/jsonl with data.text_field and data.label_field")
        text_tokenizer = load_tokenizer(config.tokenizer)
        parts = [text_tensors(read_text_lines(path), text_tokenizer, config.max_length) for path in paths]
        return Examples(parts, "causal-lm", (config.max_length,), tokenizer=text_tokenizer)
    # declared string labels are matched as written: "007" is not 7
    as_written = (config.user_field, config.label_field if config.labels and isinstance(config.labels[0], str) else None)
    ordered = config.feature_fields is None and config.text_field is None   # features in the file's column order
    tables = [read_table(path, config.format, tuple(filter(None, as_written)), ordered) for path in paths]
    try:
        users = user_column(tables, config.user_field, origin)
        examples = examples_from_columns(tables, label_field=config.label_field, text_field=config.text_field,
                                         feature_fields=_without(config.feature_fields, config.user_field, tables,
                                                                 config.label_field, config.text_field),
                                         tokenizer=config.tokenizer, max_length=config.max_length, origin=origin,
                                         labels=config.labels)
    except DpclipError as error:
        if config.format != "csv":
            raise
        named = [name for name in (config.user_field, config.text_field, config.label_field) if name]
        for path in paths:
            if (noted := words_read_as_missing(error, path, named)) is not error:
                raise noted from None
        raise
    return replace(examples, users=users)


def _hub_examples(config) -> Examples:
    train, test, names = load_hub_columns(config.name, config.config, config.split, config.test_split,
                                          config.label_field)
    tables = [train] if test is None else [train, test]
    origin = f"hf:{config.name}"
    users = user_column(tables, config.user_field, origin)
    labels = config.labels
    if names is not None and labels is None:   # a ClassLabel: the schema's classes, by id
        labels = list(range(len(names)))
    elif names is not None and isinstance(labels[0], str):   # declared by name: the ids are the schema's names
        tables = [{**table, config.label_field: _named(table[config.label_field], names)} for table in tables]
    examples = examples_from_columns(tables, label_field=config.label_field, text_field=config.text_field,
                                     feature_fields=_without(None, config.user_field, tables, config.label_field,
                                                             config.text_field),
                                     tokenizer=config.tokenizer, max_length=config.max_length, origin=origin,
                                     labels=labels)
    if names is not None and config.labels is None:
        examples = replace(examples, label_names=names)
    return replace(examples, users=users)


def _named(ids: np.ndarray, names: list[str]) -> np.ndarray:
    """A ClassLabel column's ids as their names (an id outside the names stays as it is, and is refused)."""
    return np.asarray([names[i] if isinstance(i, int) and 0 <= i < len(names) else i for i in ids.tolist()],
                      dtype=object)


def user_column(tables: list[Columns], user_field: str | None, origin: str) -> list[np.ndarray] | None:
    """Who wrote each row, from the column ``user_field`` of every table (None without one).
    Refuses a missing column and any missing value: a record of nobody cannot be protected."""
    if user_field is None:
        return None
    require_columns(tables, [user_field], origin, "user")
    columns = []
    for table in tables:
        values = np.asarray(table[user_field], dtype=object)
        missing = [i for i, v in enumerate(values) if v is None or (isinstance(v, float) and math.isnan(v))
                   or (isinstance(v, str) and not v.strip())]
        if missing:
            raise DpclipError(quoting_data(f"{origin}: {len(missing)} rows have no {user_field!r} (first: row "
                                           f"{missing[0] + 1})"),
                              "every record must name the person it belongs to: fill the column or drop those rows")
        columns.append(values)
    # across the files too: a separate test file's person who also wrote training records is a member
    clash = spelling_clash(np.concatenate(columns))
    if clash is not None:
        row = clash.row
        where = f"row {row + 1}" if row < len(columns[0]) else f"row {row - len(columns[0]) + 1} of the test file"
        raise DpclipError(quoting_data(f"{origin}: {where} names its {user_field!r} {clash.person!r}, an earlier row "
                                       f"{clash.earlier!r}: {clash.what}, one person or two cannot be told"), clash.hint)
    return [np.asarray([str(v) for v in values], dtype=object) for values in columns]


def _without(feature_fields, user_field, tables, label_field, text_field):
    """The feature columns with the user column left out (it names a person: never an input)."""
    if user_field is None or text_field is not None:
        return feature_fields
    if feature_fields is None:
        return [name for name in tables[0] if name not in (label_field, user_field)]
    return [name for name in feature_fields if name != user_field]


def source_name(config) -> str:
    if config.source == "builtin":
        return f"builtin:{config.name}"
    if config.source == "files":
        return f"files:{config.format}:{config.train}" + (f" (test {config.test})" if config.test else "")
    name = config.name + (f"/{config.config}" if config.config else "")
    return f"hf:{name}:{config.split}" + (f" (test {config.test_split})" if config.test_split else "")


def load_examples(config, seed: int) -> Examples:
    """The tensors of a recipe's ``data`` (or ``public``) section, not yet split."""
    if config.source == "builtin":
        return _builtin_examples(config, seed)
    if config.source == "files":
        return _files_examples(config)
    if config.source == "hf":
        return _hub_examples(config)
    raise DpclipError(f"unknown data source {config.source!r}", "use builtin, files or hf")


def load_data(config, seed: int, split_key: int | None = None) -> PrivateData:
    """Load a recipe's ``data`` section (a BuiltinData, FilesData or HFData) and split it.

    ``seed`` is the recipe's seed: it draws, for synthetic text, the sentences, and the
    train/test split unless ``split_key`` is given (a run's private key, module doc). With ``data.public_fraction`` the carved public rows
    (:func:`dpclip.data.split.carve_indices`) are left out first; the indices stay
    positions in the whole data set, so members and non-members never name a public row.
    """
    examples = load_examples(config, seed)
    fraction = getattr(config, "public_fraction", None)
    split_seed = seed if split_key is None else split_key
    if examples.users is not None:
        return replace(_split_by_users(examples, config, split_seed), split_key=split_key)
    if len(examples.parts) == 2:
        train, test = examples.parts
        train_indices, test_indices = np.arange(len(train["labels"])), np.arange(len(test["labels"]))
        if fraction is not None:
            _, train_indices = carve_indices(len(train_indices), fraction, seed)
            train = select(train, torch.as_tensor(train_indices))
    else:
        everything, = examples.parts
        rows = np.arange(len(everything["labels"]))
        if fraction is not None:
            _, rows = carve_indices(len(rows), fraction, seed)
        train_at, test_at = split_indices(len(rows), config.test_fraction, split_seed)
        train_indices, test_indices = rows[train_at], rows[test_at]
        train = select(everything, torch.as_tensor(train_indices))
        test = select(everything, torch.as_tensor(test_indices))
    data = data_from_parts(examples, train, test, train_indices, test_indices, source_name(config))
    return replace(data, split_key=split_key)


def _split_by_users(examples: Examples, config, seed: int) -> PrivateData:
    """Train and test hold different people (a member is a person): test_fraction of the
    users, drawn with ``seed`` (the split key, or the recipe's seed), and all their records go to the test set; a separate
    test file is taken as it is. Users are renumbered 0..U-1 in order of first appearance."""
    if getattr(config, "public_fraction", None) is not None:
        raise DpclipError("data.public_fraction with users is not built yet",
                          "carve public data from data without users, or name a separate public: block")
    if len(examples.parts) == 2:
        train, test = examples.parts
        keys, test_keys = examples.users
        train_indices, test_indices = np.arange(len(keys)), np.arange(len(test["labels"]))
    else:
        everything, = examples.parts
        all_keys = examples.users[0]
        people = list(dict.fromkeys(all_keys.tolist()))
        train_at, _ = split_indices(len(people), config.test_fraction, seed)
        train_people = {people[i] for i in train_at}
        in_train = np.asarray([key in train_people for key in all_keys])
        train_indices, test_indices = np.flatnonzero(in_train), np.flatnonzero(~in_train)
        train = select(everything, torch.as_tensor(train_indices))
        test = select(everything, torch.as_tensor(test_indices))
        keys, test_keys = all_keys[train_indices], all_keys[test_indices]
    if len(keys) == 0:
        raise DpclipError("no training records are left once the test users are set aside",
                          "lower data.test_fraction, or add users")
    numbering = {key: number for number, key in enumerate(dict.fromkeys(keys.tolist()))}
    users = torch.as_tensor([numbering[key] for key in keys.tolist()], dtype=torch.int64)
    # A person of a separate test file who also wrote training records keeps their number.
    for key in test_keys.tolist():
        numbering.setdefault(key, len(numbering))
    test_users = torch.as_tensor([numbering[key] for key in test_keys.tolist()], dtype=torch.int64)
    data = data_from_parts(examples, train, test, train_indices, test_indices, source_name(config))
    return replace(data, train_users=users, test_users=test_users)


def data_from_parts(examples: Examples, train, test, train_indices, test_indices, source: str) -> PrivateData:
    """A :class:`PrivateData` from split tensors (used for the public data set too)."""
    tokenizer = examples.tokenizer
    return PrivateData(
        train=train, test=test, task=examples.task, input_shape=examples.input_shape,
        train_indices=train_indices, test_indices=test_indices,
        fingerprint=split_fingerprint(train_indices, test_indices), source=source,
        num_classes=examples.num_classes, label_names=examples.label_names,
        vocab_size=tokenizer.vocab_size if tokenizer is not None else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer is not None else None,
        tokenizer=tokenizer, feature_names=examples.feature_names,
    )
