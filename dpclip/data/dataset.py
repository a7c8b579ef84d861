"""From a recipe's ``data`` section to :class:`PrivateData`: tensors, task and split.

One entry point, :func:`load_data`, for every source:

- ``builtin``: digits (tables or 1x8x8 images) and synthetic restaurant text;
- ``files``: local csv / json / jsonl / parquet tables and plain text;
- ``hf``: Hugging Face data sets by name (network or local cache).

Whatever the source, the columns are read first and then turned into tensors by the same
rules (:func:`examples_from_columns`):

- a ``text_field`` and no ``label_field``: causal language modelling;
- a ``text_field`` and a ``label_field``: text classification (or regression);
- no ``text_field``: a table; features are ``feature_fields`` or every other column.

The label column decides the task: integer, boolean or string labels mean classification
(strings map to sorted class ids), float labels mean regression.

The train/test split is :func:`dpclip.data.split.split_indices` with the recipe's seed,
unless a separate test file or split is given; either way the split's fingerprint is
recorded so an audit can rebuild members and non-members later. Data with users (builtin
synthetic-users, or ``data.user_field``) are split by person instead: the test set holds
test_fraction of the people with all their records, and ``PrivateData.train_users`` says
who wrote each training row (docs/users.md).

Length: a little under 500 lines: every source's loading and the column rules they share
are one path, which is easier to follow in one file than split by source.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dpclip.data.builtin import (FOODS, load_digits_arrays, synthetic_cuisine_sentences, synthetic_restaurant_sentences,
                                 synthetic_user_sentences)
from dpclip.data.files import Columns, read_table, read_text_lines
from dpclip.data.hub import load_hub_columns
from dpclip.data.split import carve_indices, split_fingerprint, split_indices
from dpclip.data.tokenizers import Tokenizer, load_tokenizer
from dpclip.errors import DpclipError

TASKS = ("classification", "regression", "causal-lm")

# Cross-entropy ignores this target: padding positions of causal-LM labels carry it.
IGNORE_INDEX = -100

# Per-example channel counts that mark an image's last axis as channels (H, W, C).
_CHANNEL_COUNTS = (1, 3, 4)


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
    # Who wrote each training row: user ids 0..U-1 (int64, one per row of ``train``), or None
    # for data without users. Kept out of ``train`` so that no batch ever feeds it to a model.
    train_users: torch.Tensor | None = field(default=None, repr=False)
    # The same for the held-out rows, numbered on from the training people (U..): the people of
    # a user-level audit's non-members.
    test_users: torch.Tensor | None = field(default=None, repr=False)

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


@dataclass
class Examples:
    """A data set turned into tensors but not yet split.

    ``parts`` is ``[everything]`` when the test set is cut from it with test_fraction, or
    ``[train, test]`` when a separate test file or split was given.
    """

    parts: list[dict[str, torch.Tensor]]
    task: str
    input_shape: tuple[int, ...]
    num_classes: int | None = None
    label_names: list[str] | None = None
    tokenizer: Tokenizer | None = None
    users: list[np.ndarray] | None = None   # per part, who wrote each row (any hashable keys)


# ------------------------------------------------------------------ text and labels

def text_tensors(texts: list[str], tokenizer: Tokenizer, max_length: int,
                 labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Tokenized text; without ``labels`` the labels are next-token targets (causal LM)."""
    input_ids, attention_mask = tokenizer.encode_batch(texts, max_length)
    if labels is None:
        # The mask, not the pad id, marks padding: some tokenizers pad with their eos.
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _texts_of(values: np.ndarray, name: str, origin: str) -> list[str]:
    texts = values.tolist()
    for value in texts:
        if not isinstance(value, str):
            raise DpclipError(f"{origin}: text column {name!r} holds a non-string value ({value!r})",
                              "data.text_field must name a column of strings; remove rows with missing text")
    return texts


def encode_labels(label_columns: list[np.ndarray], name: str, origin: str
                  ) -> tuple[list[torch.Tensor], str, int | None, list[str] | None]:
    """Labels of each part as tensors, plus (task, num_classes, label_names).

    Integer and boolean labels are class ids as they are (negative ones are mapped to
    sorted ids); strings map to sorted ids, recorded in label_names; floats mean
    regression. The class list comes from all parts, so train and test agree.
    """
    joined = np.concatenate(label_columns)
    if joined.ndim != 1:
        raise DpclipError(f"{origin}: label column {name!r} holds {joined.shape[1:]} values per example, not one",
                          "data.label_field must name a column with one label per example")
    kind = joined.dtype.kind
    if kind == "O":
        values = joined.tolist()
        if all(isinstance(v, str) for v in values):
            kind = "U"
        elif all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            joined = joined.astype(np.int64)
            label_columns = [column.astype(np.int64) for column in label_columns]
            kind = "i"
        else:
            shown = next((v for v in values if not isinstance(v, str)), values[0])
            raise DpclipError(
                f"{origin}: label column {name!r} holds non-integer values for classification (e.g. {shown!r}), "
                "or mixes strings with other values",
                "classification needs whole-number or string labels, regression a float column; "
                "remove rows with missing labels")
    if kind == "f":
        if np.isnan(joined).any():
            raise DpclipError(f"{origin}: label column {name!r} has missing values",
                              "remove the rows without a label")
        return ([torch.as_tensor(c.astype(np.float32)) for c in label_columns], "regression", None, None)
    if kind == "b":
        return [torch.as_tensor(c.astype(np.int64)) for c in label_columns], "classification", 2, ["False", "True"]
    if kind in "iu" and joined.min() >= 0:
        num_classes = int(joined.max()) + 1
        return [torch.as_tensor(c.astype(np.int64)) for c in label_columns], "classification", num_classes, None
    if kind in "iuU":
        classes = np.unique(joined)
        label_ids = [torch.as_tensor(np.searchsorted(classes, c).astype(np.int64)) for c in label_columns]
        return label_ids, "classification", len(classes), [str(c) for c in classes]
    raise DpclipError(f"{origin}: label column {name!r} has unsupported type {joined.dtype}",
                      "classification needs whole-number or string labels, regression a float column")


# ------------------------------------------------------------------------ features

def _numeric_column(values: np.ndarray, name: str, origin: str) -> np.ndarray:
    """A feature column as a numeric array ``[N, ...]``; nested lists are stacked."""
    if values.dtype.kind == "O":
        try:
            values = np.stack([np.asarray(v) for v in values])
        except ValueError:
            raise DpclipError(f"{origin}: feature column {name!r} holds sequences of different lengths",
                              "every example needs the same number of features") from None
    if values.dtype.kind not in "biuf":
        raise DpclipError(
            f"{origin}: feature column {name!r} is not numeric (type {values.dtype})",
            "list the numeric columns in data.feature_fields, or set data.text_field for a text column")
    if values.dtype.kind == "f" and np.isnan(values).any():
        raise DpclipError(f"{origin}: feature column {name!r} has missing values",
                          "fill or remove rows with missing values before training")
    return values


def _image_layout(pixels: np.ndarray) -> np.ndarray:
    """Images as float32 ``[N, C, H, W]``: 8-bit grey levels scaled to [0, 1], channels first."""
    images = pixels.astype(np.float32)
    if pixels.dtype == np.uint8:
        images /= 255.0
    if images.ndim == 3:
        return images[:, None]
    if images.shape[-1] in _CHANNEL_COUNTS and images.shape[1] not in _CHANNEL_COUNTS:
        return np.ascontiguousarray(images.transpose(0, 3, 1, 2))
    return images


def encode_features(feature_columns: list[dict[str, np.ndarray]], names: list[str],
                    origin: str) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """float32 features of each part and the per-example shape.

    Scalar columns are concatenated into one vector. A single column whose entries are
    2-D or 3-D arrays (a Hugging Face image column) becomes ``[C, H, W]`` images.
    """
    parts = []
    for columns in feature_columns:
        arrays = [_numeric_column(columns[name], name, origin) for name in names]
        if len(arrays) == 1 and arrays[0].ndim in (3, 4):
            parts.append(_image_layout(arrays[0]))
        else:
            flat = [a.reshape(len(a), -1).astype(np.float32) for a in arrays]
            parts.append(np.concatenate(flat, axis=1))
    shapes = {p.shape[1:] for p in parts}
    if len(shapes) != 1:
        raise DpclipError(f"{origin}: train and test features have different shapes {sorted(shapes)}",
                          "train and test files need the same feature columns")
    return [torch.as_tensor(p) for p in parts], tuple(int(d) for d in parts[0].shape[1:])


# ----------------------------------------------------------------- columns -> tensors

def _require_columns(tables: list[Columns], names: list[str], origin: str, role: str) -> None:
    for part, table in zip(("train", "test"), tables):
        missing = [name for name in names if name not in table]
        if missing:
            raise DpclipError(f"{origin}: {role} column {missing[0]!r} is not in the {part} data",
                              f"its columns are: {', '.join(table)}")


def examples_from_columns(tables: list[Columns], *, label_field: str | None, text_field: str | None,
                          feature_fields: list[str] | None, tokenizer: str, max_length: int,
                          origin: str) -> Examples:
    """Tensors for a table data set: ``tables`` is [all] or [train, test] (see module doc)."""
    if text_field is not None:
        if feature_fields is not None:
            raise DpclipError(f"{origin}: data.feature_fields and data.text_field are both set",
                              "text data uses the text column as input: remove data.feature_fields")
        _require_columns(tables, [text_field], origin, "text")
        texts = [_texts_of(table[text_field], text_field, origin) for table in tables]
        text_tokenizer = load_tokenizer(tokenizer)
        if label_field is None:
            parts = [text_tensors(t, text_tokenizer, max_length) for t in texts]
            return Examples(parts, "causal-lm", (max_length,), tokenizer=text_tokenizer)
        _require_columns(tables, [label_field], origin, "label")
        labels, task, num_classes, names = encode_labels([t[label_field] for t in tables], label_field, origin)
        parts = [text_tensors(t, text_tokenizer, max_length, y) for t, y in zip(texts, labels)]
        return Examples(parts, task, (max_length,), num_classes, names, text_tokenizer)

    if label_field is None:
        raise DpclipError(f"{origin}: a table needs data.label_field (or data.text_field for text)",
                          f"its columns are: {', '.join(tables[0])}")
    _require_columns(tables, [label_field], origin, "label")
    if feature_fields is None:
        feature_fields = [name for name in tables[0] if name != label_field]
    elif label_field in feature_fields:
        raise DpclipError(f"{origin}: the label column {label_field!r} is also listed in data.feature_fields",
                          "remove it from data.feature_fields")
    if not feature_fields:
        raise DpclipError(f"{origin}: no feature columns besides the label {label_field!r}",
                          "a table needs at least one feature column")
    _require_columns(tables, feature_fields, origin, "feature")
    features, input_shape = encode_features(tables, feature_fields, origin)
    labels, task, num_classes, names = encode_labels([t[label_field] for t in tables], label_field, origin)
    parts = [{"features": x, "labels": y} for x, y in zip(features, labels)]
    return Examples(parts, task, input_shape, num_classes, names)


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
    tables = [read_table(path, config.format) for path in paths]
    users = user_column(tables, config.user_field, origin)
    examples = examples_from_columns(tables, label_field=config.label_field, text_field=config.text_field,
                                     feature_fields=_without(config.feature_fields, config.user_field, tables,
                                                             config.label_field, config.text_field),
                                     tokenizer=config.tokenizer, max_length=config.max_length, origin=origin)
    return replace(examples, users=users)


def _hub_examples(config) -> Examples:
    train, test = load_hub_columns(config.name, config.config, config.split, config.test_split)
    tables = [train] if test is None else [train, test]
    origin = f"hf:{config.name}"
    users = user_column(tables, config.user_field, origin)
    examples = examples_from_columns(tables, label_field=config.label_field, text_field=config.text_field,
                                     feature_fields=_without(None, config.user_field, tables, config.label_field,
                                                             config.text_field),
                                     tokenizer=config.tokenizer, max_length=config.max_length, origin=origin)
    return replace(examples, users=users)


def user_column(tables: list[Columns], user_field: str | None, origin: str) -> list[np.ndarray] | None:
    """Who wrote each row, from the column ``user_field`` of every table (None without one).
    Refuses a missing column and any missing value: a record of nobody cannot be protected."""
    if user_field is None:
        return None
    _require_columns(tables, [user_field], origin, "user")
    columns = []
    for table in tables:
        values = np.asarray(table[user_field], dtype=object)
        missing = [i for i, v in enumerate(values) if v is None or (isinstance(v, float) and math.isnan(v))
                   or (isinstance(v, str) and not v.strip())]
        if missing:
            raise DpclipError(f"{origin}: {len(missing)} rows have no {user_field!r} (first: row {missing[0] + 1})",
                              "every record must name the person it belongs to: fill the column or drop those rows")
        columns.append(np.asarray([str(v) for v in values], dtype=object))
    return columns


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


def load_data(config, seed: int) -> PrivateData:
    """Load a recipe's ``data`` section (a BuiltinData, FilesData or HFData) and split it.

    ``seed`` is the recipe's seed: it draws the train/test split and, for synthetic
    text, the sentences. With ``data.public_fraction`` the carved public rows
    (:func:`dpclip.data.split.carve_indices`) are left out first; the indices stay
    positions in the whole data set, so members and non-members never name a public row.
    """
    examples = load_examples(config, seed)
    fraction = getattr(config, "public_fraction", None)
    if examples.users is not None:
        return _split_by_users(examples, config, seed)
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
        train_at, test_at = split_indices(len(rows), config.test_fraction, seed)
        train_indices, test_indices = rows[train_at], rows[test_at]
        train = select(everything, torch.as_tensor(train_indices))
        test = select(everything, torch.as_tensor(test_indices))
    return data_from_parts(examples, train, test, train_indices, test_indices, source_name(config))


def _split_by_users(examples: Examples, config, seed: int) -> PrivateData:
    """Train and test hold different people (a member is a person): test_fraction of the
    users, drawn with the recipe's seed, and all their records go to the test set; a separate
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
        tokenizer=tokenizer,
    )
