"""Reading local data files: csv, json, jsonl and parquet tables, and plain text.

Tables come back as ``Columns``: an ordered mapping from column name to a NumPy array
with one entry per row (strings and nested lists as ``object`` arrays). Turning columns
into tensors is :mod:`dpclip.data.dataset`'s job, shared with Hugging Face data sets.

We read with pandas / pyarrow / the json module rather than ``datasets``' local loaders:
the result is the same for these formats, and nothing is written to the Hugging Face cache.
:func:`dpclip.data.size.training_set_size`, which accounting uses before any tensor is made,
counts rows with these same readers, so its N is the number of rows training draws from
(a csv's rows are pandas', which are not the csv module's).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dpclip.errors import DpclipError, quoting_data

Columns = dict[str, np.ndarray]

TABLE_FORMATS = ("csv", "json", "jsonl", "parquet")

# UTF-8 that drops a leading byte order mark (Windows editors write one): it marks the encoding, it is no
# row's text (pandas drops it from a csv by itself)
UTF8 = "utf-8-sig"


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DpclipError(f"data file not found: {path}", "check data.train / data.test in the recipe")
    if path.is_dir():
        raise DpclipError(f"data path is a directory, not a file: {path}", "point data.train / data.test at a file")
    return path


def _columns_of(frame) -> Columns:
    return {str(name): frame[name].to_numpy() for name in frame.columns}


def _json_records(path: Path, file_format: str) -> list[dict] | dict[str, list]:
    """json: a list of records or a mapping of columns; jsonl: one record per non-blank line."""
    if file_format == "json":
        content = json.loads(path.read_text(encoding=UTF8))
        if isinstance(content, list) and all(isinstance(record, dict) for record in content):
            return content
        if isinstance(content, dict) and content and all(isinstance(v, list) for v in content.values()):
            return content
        raise DpclipError(f"{path}: expected a JSON list of records or a mapping of columns",
                          "or use format: jsonl with one record per line")
    records = []
    with path.open(encoding=UTF8) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                # json numbers the lines of the string it was given: one line of the file.
                raise DpclipError(quoting_data(f"cannot read {path} as jsonl: line {line_number} is not valid JSON: "
                                               f"{exc.msg} (column {exc.colno})"),
                                  "each non-blank line of a jsonl file must be one JSON object") from None
            if not isinstance(record, dict):
                raise DpclipError(quoting_data(f"{path}, line {line_number}: expected a JSON object, got "
                                               f"{type(record).__name__}"),
                                  "write one object per line, e.g. {\"text\": \"...\", \"label\": 1}")
            records.append(record)
    return records


def _check_key_order(records: list[dict], path: Path, file_format: str) -> None:
    """Refuse records that list their keys in different orders: the columns come in the order of first
    appearance, so the first record's order would be the features' order (one record, added or
    removed, would reorder the model's inputs)."""
    position: dict = {}
    for record in records:
        for key in record:
            position.setdefault(key, len(position))
    for number, record in enumerate(records, start=1):
        places = [position[key] for key in record]
        if places != sorted(places):
            where = f"line {number}" if file_format == "jsonl" else f"record {number}"
            raise DpclipError(quoting_data(f"{path}, {where}: its keys come in another order than earlier records' "
                                           f"({', '.join(map(repr, record))}), so which feature is the model's "
                                           "first input would depend on the rows"),
                              "list the feature columns in data.feature_fields (their order is the model's input "
                              "order), or write every record's keys in one order")


def read_table(path: str | Path, file_format: str, as_written: tuple[str, ...] = (), one_key_order: bool = False
               ) -> Columns:
    """The columns of a csv, json, jsonl or parquet file; a csv's columns ``as_written`` are read as
    text, not parsed as numbers (a person id: "007", "7" and "7.0" name three people, not one).
    ``one_key_order``: json or jsonl records must list their keys in one order (the columns are features
    in that order)."""
    import pandas as pd  # lazy: only local-file recipes need pandas

    path = _existing(path)
    try:
        if file_format == "csv":
            frame = pd.read_csv(path, skip_blank_lines=True, dtype={name: str for name in as_written})
        elif file_format in ("json", "jsonl"):
            records = _json_records(path, file_format)
            if one_key_order and isinstance(records, list):
                _check_key_order(records, path, file_format)
            frame = pd.DataFrame(records) if isinstance(records, dict) else pd.DataFrame.from_records(records)
        elif file_format == "parquet":
            import pyarrow.parquet as pq  # lazy: only parquet files need pyarrow

            frame = pq.read_table(path).to_pandas()
        else:
            raise DpclipError(f"{file_format!r} is not a table format", f"use one of {', '.join(TABLE_FORMATS)}")
    except DpclipError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        # pandas' ParserError, json's JSONDecodeError and pyarrow's ArrowInvalid are ValueErrors.
        raise DpclipError(quoting_data(f"cannot read {path} as {file_format}: {exc}"),
                          "check data.format and the file") from None
    if frame.shape[1] == 0 or len(frame) == 0:
        raise DpclipError(f"{path} holds no rows", "the data file must have a header and at least one row")
    return _columns_of(frame)


def words_read_as_missing(error: DpclipError, path: str | Path, columns: list[str]) -> DpclipError:
    """``error`` (a refusal of ``columns`` of the csv ``path``), told where the csv holds a word that
    pandas reads as a missing value (NA, N/A, NULL, null, None, NaN, ...) in one of ``columns`` (the
    column the error names first), or as it is. A second read, as written: on this error path only."""
    import pandas as pd  # lazy, as in read_table

    named = sorted(dict.fromkeys(columns), key=lambda name: repr(name) not in error.message)
    try:
        parsed, written = (pd.read_csv(path, skip_blank_lines=True, dtype=str, usecols=lambda c: c in named,
                                       keep_default_na=keep) for keep in (True, False))
    except (OSError, UnicodeDecodeError, ValueError):
        return error
    if len(parsed) != len(written):
        return error
    for name in (name for name in named if name in parsed):
        for row, (value, word) in enumerate(zip(parsed[name], written[name])):
            if not isinstance(value, str) and isinstance(word, str) and word.strip():
                return DpclipError(quoting_data(f"{error.message} ({path}, row {row + 1}: {name!r} is written {word!r}, "
                                                "a word pandas reads as missing, as it reads NA, N/A, NULL, null, None "
                                                "and NaN)"),
                                   "dpclip reads csv with pandas' missing-value words: write that value another way "
                                   "(for a real value), leave the cell empty (for a missing one), or write the data "
                                   "as jsonl, whose strings are read as written")
    return error


def read_text_lines(path: str | Path) -> list[str]:
    """One example per non-blank line, without its line ending."""
    path = _existing(path)
    try:
        with path.open(encoding=UTF8) as handle:
            lines = [line.rstrip("\r\n") for line in handle if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DpclipError(quoting_data(f"cannot read {path} as UTF-8 text: {exc}"), "save the file as UTF-8") from None
    if not lines:
        raise DpclipError(f"{path} holds no text", "write one training example per line")
    return lines
