"""From columns to tensors: the rules every data source shares (docs/recipes.md, `data`).

Whatever the source (builtin, files, Hugging Face), :mod:`dpclip.data.dataset` reads its
columns first and hands them to :func:`examples_from_columns`:

- a ``text_field`` and no ``label_field``: causal language modelling;
- a ``text_field`` and a ``label_field``: text classification (or regression);
- no ``text_field``: a table; features are ``feature_fields`` or every other column.

The label column decides the task: integer, boolean or string labels mean classification
(strings map to sorted class ids), float labels mean regression.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dpclip.data.files import Columns
from dpclip.data.tokenizers import Tokenizer, load_tokenizer
from dpclip.errors import DpclipError, quoting_data

# Cross-entropy ignores this target: padding positions of causal-LM labels carry it.
IGNORE_INDEX = -100

# Per-example channel counts that mark an image's last axis as channels (H, W, C).
_CHANNEL_COUNTS = (1, 3, 4)


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
    feature_names: list[str] | None = None  # a table's feature columns, in the order they are concatenated


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
            raise DpclipError(quoting_data(f"{origin}: text column {name!r} holds a non-string value ({value!r})"),
                              "data.text_field must name a column of strings; remove rows with missing text")
    return texts


def _declared_ids(label_columns: list[np.ndarray], declared: list, name: str, origin: str) -> list[torch.Tensor]:
    """Each part's labels as their positions in ``declared`` (the recipe's ``data.labels``: public), or a
    refusal naming the first row whose label is not one of them (a whole number is not a string, nor
    True 1)."""
    position = {(type(label), label): i for i, label in enumerate(declared)}
    wanted = type(declared[0])
    parts = []
    for part, column in zip(("", " of the test data"), label_columns):
        ids = np.empty(len(column), dtype=np.int64)
        for row, value in enumerate(column.tolist()):
            key = (wanted, value) if isinstance(value, wanted) and not isinstance(value, bool) else None
            if key not in position:
                raise DpclipError(quoting_data(f"{origin}: row {row + 1}{part} has the label {value!r} in column "
                                               f"{name!r}, which is not one of the declared classes ({_shown(declared)})"),
                                  "the classes are data.labels (without it, a hub data set's ClassLabel): add the "
                                  "class, or remove the row (a hub test split's -1 means unlabelled: cut the test set "
                                  "with test_fraction); labels match as written (a whole number is not a string)")
            ids[row] = position[key]
        parts.append(torch.as_tensor(ids))
    return parts


def _shown(declared: list) -> str:
    return ", ".join(repr(label) for label in declared[:5]) + (", ..." if len(declared) > 5 else "")


def encode_labels(label_columns: list[np.ndarray], name: str, origin: str, declared: list | None = None
                  ) -> tuple[list[torch.Tensor], str, int | None, list[str] | None]:
    """Labels of each part as tensors, plus (task, num_classes, label_names).

    ``declared`` (the recipe's ``data.labels``): the classes, in output order, and every label must be
    one of them. Otherwise the label set is read from the labels (not covered by ε): integer and
    boolean labels are class ids as they are (negative ones are mapped to sorted ids); strings map to
    sorted ids, recorded in label_names; floats mean regression. The class list comes from all parts,
    so train and test agree.
    """
    if declared is not None:
        ids = _declared_ids(label_columns, declared, name, origin)
        names = None if declared == list(range(len(declared))) else [str(label) for label in declared]
        return ids, "classification", len(declared), names
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
            _check_int64(values, name, origin)
            joined = joined.astype(np.int64)
            label_columns = [column.astype(np.int64) for column in label_columns]
            kind = "i"
        else:
            # The first value that is neither a whole number nor a string (a bool, a float, a null);
            # else strings mixed with whole numbers: the first whole number.
            shown = next((v for v in values if not isinstance(v, (str, int, np.integer)) or isinstance(v, bool)),
                         next((v for v in values if not isinstance(v, str)), values[0]))
            raise DpclipError(quoting_data(
                f"{origin}: label column {name!r} holds non-integer values for classification (e.g. {shown!r}), "
                "or mixes strings with other values"),
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
        if num_classes > len(joined):
            raise DpclipError(quoting_data(f"{origin}: the largest label in column {name!r} is {num_classes - 1}, so "
                                           f"the model would have {num_classes} outputs, more than the "
                                           f"{len(joined)} labelled rows"),
                              "a whole-number label is its class's output: number the classes 0..K-1, or declare "
                              "them with data.labels (e.g. labels: [3, 17, 2024])")
        return [torch.as_tensor(c.astype(np.int64)) for c in label_columns], "classification", num_classes, None
    if kind in "iuU":
        classes = np.unique(joined)
        label_ids = [torch.as_tensor(np.searchsorted(classes, c).astype(np.int64)) for c in label_columns]
        return label_ids, "classification", len(classes), [str(c) for c in classes]
    raise DpclipError(f"{origin}: label column {name!r} has unsupported type {joined.dtype}",
                      "classification needs whole-number or string labels, regression a float column")


def _check_int64(values: list, name: str, origin: str) -> None:
    huge = next((v for v in values if not -2**63 <= v < 2**63), None)
    if huge is not None:
        raise DpclipError(quoting_data(f"{origin}: label column {name!r} holds {huge!r}, beyond a 64-bit integer"),
                          "a whole-number label is its class's output: number the classes 0..K-1, or declare them "
                          "with data.labels")


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
    if values.dtype.kind != "f":
        return values   # whole numbers: finite as float32 (|int64| < 3.4e38)
    with np.errstate(over="ignore"):
        infinite = ~np.isfinite(values.astype(np.float32))   # features train as float32
    if infinite.any():
        row = int(np.argwhere(infinite)[0][0])
        raise DpclipError(quoting_data(f"{origin}: feature column {name!r} holds a value that is infinite as a "
                                       f"32-bit float (row {row + 1}: {values[row].tolist()!r})"),
                          "features train as float32 (at most about 3.4e38 in size): replace or rescale "
                          "infinite and huge values, or remove those rows")
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

def require_columns(tables: list[Columns], names: list[str], origin: str, role: str) -> None:
    for part, table in zip(("train", "test"), tables):
        missing = [name for name in names if name not in table]
        if missing:
            raise DpclipError(f"{origin}: {role} column {missing[0]!r} is not in the {part} data",
                              f"its columns are: {', '.join(table)}")


def examples_from_columns(tables: list[Columns], *, label_field: str | None, text_field: str | None,
                          feature_fields: list[str] | None, tokenizer: str, max_length: int,
                          origin: str, labels: list | None = None) -> Examples:
    """Tensors for a table data set: ``tables`` is [all] or [train, test] (see module doc);
    ``labels``: the classes the recipe declares (``data.labels``)."""
    if text_field is not None:
        if feature_fields is not None:
            raise DpclipError(f"{origin}: data.feature_fields and data.text_field are both set",
                              "text data uses the text column as input: remove data.feature_fields")
        require_columns(tables, [text_field], origin, "text")
        texts = [_texts_of(table[text_field], text_field, origin) for table in tables]
        text_tokenizer = load_tokenizer(tokenizer)
        if label_field is None:
            parts = [text_tensors(t, text_tokenizer, max_length) for t in texts]
            return Examples(parts, "causal-lm", (max_length,), tokenizer=text_tokenizer)
        require_columns(tables, [label_field], origin, "label")
        labels, task, num_classes, names = encode_labels([t[label_field] for t in tables], label_field, origin, labels)
        parts = [text_tensors(t, text_tokenizer, max_length, y) for t, y in zip(texts, labels)]
        return Examples(parts, task, (max_length,), num_classes, names, text_tokenizer)

    if label_field is None:
        raise DpclipError(f"{origin}: a table needs data.label_field (or data.text_field for text)",
                          f"its columns are: {', '.join(tables[0])}")
    require_columns(tables, [label_field], origin, "label")
    if feature_fields is None:
        feature_fields = [name for name in tables[0] if name != label_field]
    elif label_field in feature_fields:
        raise DpclipError(f"{origin}: the label column {label_field!r} is also listed in data.feature_fields",
                          "remove it from data.feature_fields")
    if not feature_fields:
        raise DpclipError(f"{origin}: no feature columns besides the label {label_field!r}",
                          "a table needs at least one feature column")
    require_columns(tables, feature_fields, origin, "feature")
    features, input_shape = encode_features(tables, feature_fields, origin)
    labels, task, num_classes, names = encode_labels([t[label_field] for t in tables], label_field, origin, labels)
    parts = [{"features": x, "labels": y} for x, y in zip(features, labels)]
    return Examples(parts, task, input_shape, num_classes, names, feature_names=list(feature_fields))
