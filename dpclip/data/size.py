"""How many training examples a recipe's data section holds, without loading tensors.

Accounting needs N (the Poisson rate is q = batch_size / N and δ must be below 1/N)
before anything is trained, so `dpclip account RECIPE` can answer quickly.
"""

from __future__ import annotations

from pathlib import Path

from dpclip.data.files import TABLE_FORMATS, read_table, read_text_lines
from dpclip.data.split import carve_count, split_sizes
from dpclip.errors import DpclipError


def _count_rows(path: Path, file_format: str) -> int:
    """The rows training reads from ``path``: csv, json and jsonl by the loader's own readers
    (pandas' csv rows are not the csv module's: a quoted blank, a form feed or no-break space
    line, a lone carriage return), text by its own lines; parquet from its metadata."""
    if file_format == "text":
        return len(read_text_lines(path))
    if file_format in TABLE_FORMATS and file_format != "parquet":
        return len(next(iter(read_table(path, file_format).values())))
    if file_format != "parquet":
        raise DpclipError(f"unknown data format {file_format!r}", "use csv, json, jsonl, parquet or text")
    if not path.exists():
        raise DpclipError(f"data file not found: {path}", "check data.train / data.test in the recipe")
    try:
        import pyarrow.parquet as pq  # lazy: only parquet files need pyarrow

        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, ValueError) as exc:
        # pyarrow's ArrowInvalid (a corrupt parquet file) is a ValueError.
        raise DpclipError(f"cannot read {path} as {file_format}: {exc}", "check data.format and the file") from None


def total_examples(data) -> int:
    """Examples before the train/test split and any public carve (data: a recipe `data` section)."""
    if data.source == "builtin":
        if data.name == "digits":
            from sklearn.datasets import load_digits  # lazy: scikit-learn is slow to import

            return len(load_digits().target)
        return data.num_examples
    if data.source == "files":
        return _count_rows(Path(data.train), data.format)
    raise DpclipError(f"the size of Hugging Face data set {data.name!r} is not known without loading it",
                      "pass --dataset-size N (the number of training examples); `dpclip train` and "
                      "`dpclip tune-cost --run` load the data set and count it themselves")


def training_set_size(data) -> int:
    """N, the number of private training examples the Poisson sampler draws from."""
    total = total_examples(data)
    fraction = getattr(data, "public_fraction", None)
    if fraction is not None:  # rows carved out as public are never private (docs/continual.md)
        total -= carve_count(total, fraction)
    if data.source == "files" and data.test is not None:
        return total
    num_train, _ = split_sizes(total, data.test_fraction)
    return num_train


def public_summary(data, public) -> str:
    """Every public source a run reads, with its rows: "<source>, N examples", and the public
    test file's own "<file>, M examples" (the switch rules read it); a hub data set by its
    config and splits, without N (known only after loading). Without torch, for the
    privacy statement."""
    fraction = getattr(data, "public_fraction", None)
    if fraction is not None:
        total = total_examples(data) if data.source != "hf" else None
        where = _name(data) + f", the {fraction:g} share carved out before the private split"
        return where + ("" if total is None else f", {carve_count(total, fraction)} examples")
    if public.source == "hf":
        return _name(public)
    summary = f"{_name(public)}, {total_examples(public)} examples"
    if public.source == "files" and public.test is not None:
        rows = _count_rows(Path(public.test), public.format)
        summary += f", and its validation file files:{public.test}, {rows} examples"
    return summary


def _name(section) -> str:
    if section.source == "builtin":
        return f"builtin:{section.name}"
    if section.source == "files":
        return f"files:{section.train}"
    name = section.name + (f"/{section.config}" if section.config else "")
    return f"hf:{name}, split {section.split}" + (f" and test split {section.test_split}" if section.test_split else "")
