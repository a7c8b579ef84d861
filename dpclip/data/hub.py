"""Hugging Face data sets by name (``data.source: hf``).

``datasets.load_dataset`` needs the network or a copy in the local cache. Whatever goes
wrong inside it (no network, offline mode, a misspelt name, a missing config or split)
surfaces as one :class:`DpclipError` with a hint instead of a library traceback.

A label column the data set declares a ``ClassLabel`` (its class names, in id order) has those
classes, whichever of them its rows hold: the schema, not the rows, fixes the model's output size.
"""

from __future__ import annotations

import numpy as np

from dpclip.data.files import Columns
from dpclip.errors import DpclipError, quoting_data


def _load_split(name: str, config: str | None, split: str):
    from datasets import load_dataset  # lazy: `datasets` is slow to import and only hf recipes need it

    try:
        return load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many unrelated types; all mean "cannot load"
        shown = f"{name!r}" + (f" (config {config!r})" if config else "") + f", split {split!r}"
        message = f"cannot load Hugging Face data set {shown}: {exc.__class__.__name__}: {exc}"
        raise DpclipError(
            # past not finding or reaching it (OSError: offline, a missing set), the library's message may quote
            # a row it could not read or cast
            message if isinstance(exc, OSError) else quoting_data(message),
            "a data set given by name needs network or a local cache: run once with network access, "
            "or save it to files and use data.source: files (check the name, config and split too); "
            "HF_DATASETS_OFFLINE=1 uses the cache alone, without waiting for the network",
        ) from None


def _columns_of(dataset) -> Columns:
    """Every column as a NumPy array; images decode to uint8 arrays, sequences stack."""
    as_numpy = dataset.with_format("numpy")
    return {name: _column_array(as_numpy[name]) for name in dataset.column_names}


def _column_array(values) -> np.ndarray:
    """One column as an array: stacked when its entries have one shape, else one object per row
    (ragged sequences; the feature encoder refuses them with a hint, as it does for files)."""
    try:
        return np.asarray(values)
    except ValueError:  # "inhomogeneous shape": sequences of different lengths
        column = np.empty(len(values), dtype=object)
        for index, value in enumerate(values):
            column[index] = value
        return column


def class_names(dataset, label_field: str | None) -> list[str] | None:
    """The names of ``label_field``'s classes when the data set declares them (a ``ClassLabel``: the
    data set's schema, not read from its rows), else None."""
    feature = dataset.features.get(label_field) if label_field is not None else None
    names = getattr(feature, "names", None)
    return list(names) if isinstance(names, list) and names else None


def load_hub_columns(name: str, config: str | None, split: str, test_split: str | None,
                     label_field: str | None = None) -> tuple[Columns, Columns | None, list[str] | None]:
    """(train columns, test columns or None when the test set is cut from train, the label column's
    class names when the train split's schema declares them: :func:`class_names`)."""
    train_split = _load_split(name, config, split)
    test = _columns_of(_load_split(name, config, test_split)) if test_split is not None else None
    return _columns_of(train_split), test, class_names(train_split, label_field)
