"""The recipe's ``public:`` data: loaded like ``data:``, and refused if it holds private rows.

Public data is the user's claim (docs/continual.md, "Public data"): ε does not cover it.
What dpclip can check, it does: a public block that names the same source as the private
data (the same builtin set, file or hub data set) is refused unless the public rows are
carved out of it with ``data.public_fraction`` (disjoint by construction), and a public
block from another source is refused if any of its rows has the same inputs as a private
training or held-out row: the same features (or text), whatever its label (:func:`row_fingerprints`);
a public table must have the private table's feature columns, by name and in order.
A near-copy (a feature moved by 1e-30, the text re-encoded) is not an identical row and is not
caught: that the rows are public stays the user's declaration.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import torch

from dpclip.data.dataset import PrivateData, source_name, data_from_parts, load_data, load_examples, select
from dpclip.data.split import carve_indices, split_indices
from dpclip.errors import DpclipError, quoting_data

CARVE_HINT = "carve disjoint public rows out of it with data.public_fraction (e.g. 0.1), or use another source"


def same_source(public, private) -> bool:
    """Do two data sections name the same underlying data set (rows could be shared)?"""
    if public.source != private.source:
        return False
    if public.source == "builtin":
        return public.name == private.name
    if public.source == "files":
        paths = {Path(p).resolve() for p in (private.train, private.test) if p}
        return any(Path(p).resolve() in paths for p in (public.train, public.test) if p)
    return (public.name, public.config) == (private.name, private.config)


def describe_public(recipe) -> str:
    """The public data's source as the statement names it."""
    public, fraction = recipe.public, getattr(recipe.data, "public_fraction", None)
    if fraction is not None:
        return f"{source_name(recipe.data)}, the {fraction:g} share carved out before the private split"
    return source_name(public)


def row_fingerprints(data: PrivateData, split: str, tokens: int | None = None) -> list[str]:
    """One hash per row of ``data.train`` or ``data.test`` over the row's inputs in a form that
    does not depend on how its own data set was encoded: features as float32 values (−0 as 0),
    text as its first ``tokens`` real tokens (padding left out, so a different ``max_length``
    still compares). The label is left out: a private row with its label respelled, or
    changed, is still a private row (its inputs are the secret)."""
    tensors = getattr(data, split)
    count = len(tensors["labels"])
    digests = [hashlib.sha256() for _ in range(count)]
    if "features" in tensors:
        features = (tensors["features"].detach().cpu().to(torch.float32) + 0.0).contiguous()
        rows = features.reshape(count, -1)
        for i in range(count):
            digests[i].update(f"features:{tuple(features.shape[1:])}".encode())
            digests[i].update(rows[i].numpy().tobytes())
    if "input_ids" in tensors:
        ids, mask = tensors["input_ids"].detach().cpu(), tensors["attention_mask"].detach().cpu()
        for i in range(count):
            kept = ids[i][mask[i] != 0][:tokens].to(torch.int64)
            digests[i].update(b"tokens:" + kept.numpy().tobytes())
    return [d.hexdigest() for d in digests]


def load_public(recipe, private: PrivateData | None = None) -> PrivateData:
    """The public data of ``recipe`` as a PrivateData-shaped object: ``train`` are the rows
    public steps draw from, ``test`` the public validation rows of the switch rules.

    Refuses (DpclipError) a public block that could hold private rows (module doc);
    ``private`` (the loaded private data) enables the row-by-row check.
    """
    public, data, seed = recipe.public, recipe.data, recipe.seed
    fraction = getattr(data, "public_fraction", None)
    if fraction is not None:
        if not same_source(public, data):
            raise DpclipError(f"data.public_fraction carves public rows out of {source_name(data)}, but public: "
                              f"names {source_name(public)}",
                              "with data.public_fraction, public: must name the same source as data: (its other "
                              "fields are taken from data:); or remove data.public_fraction")
        return _carved(recipe)
    if same_source(public, data):
        raise DpclipError(f"public: names the private data's own source ({source_name(public)}): its rows "
                          "would be private rows declared public", CARVE_HINT)
    try:
        loaded = load_data(public, seed=seed)
    except DpclipError as error:
        raise about_public(error) from None
    if private is not None:
        check_disjoint(loaded, private)
    return loaded


def about_public(error: DpclipError) -> DpclipError:
    """``error``, raised loading the ``public:`` block, said of it: the message names the public
    data and the hint its fields (``public.train``, not the private block's ``data.train``)."""
    error.message = f"public data: {error.message}"
    if error.hint:
        error.hint = re.sub(r"\bdata\.(?!public_fraction)(?=[a-z])", "public.", error.hint)
    error.args = (error.message,)
    return error


def _carved(recipe) -> PrivateData:
    """The rows ``data.public_fraction`` carved out, split into public train and validation
    by the public block's ``test_fraction`` (indices are positions in the whole data set)."""
    data, seed = recipe.data, recipe.seed
    examples = load_examples(data, seed)
    part = examples.parts[0]
    rows, _ = carve_indices(len(part["labels"]), data.public_fraction, seed)
    if len(rows) < 2:
        raise DpclipError(f"data.public_fraction {data.public_fraction:g} carves only {len(rows)} public row(s)",
                          "raise data.public_fraction: the public rows need a training and a validation part")
    train_at, test_at = split_indices(len(rows), recipe.public.test_fraction, seed)
    train_indices, test_indices = rows[train_at], rows[test_at]
    train = select(part, torch.as_tensor(train_indices))
    test = select(part, torch.as_tensor(test_indices))
    return data_from_parts(examples, train, test, train_indices, test_indices, describe_public(recipe))


def check_disjoint(public: PrivateData, private: PrivateData) -> None:
    """Refuse public rows whose inputs are those of a private training or held-out row, whatever
    the labels (:func:`row_fingerprints`), not as each data set happened to encode them."""
    if set(public.train) != set(private.train):
        raise DpclipError(f"the public data ({public.source}) has columns {sorted(public.train)} where the private "
                          f"data has {sorted(private.train)}",
                          "public and private data must be the same kind of examples (same task and fields)")
    names = public.feature_names, private.feature_names
    if None not in names and names[0] != names[1]:
        fields = f"public.feature_fields: [{', '.join(names[1])}]"
        raise DpclipError(f"the public data ({public.source}) has feature columns {names[0]} where the private data "
                          f"has {names[1]}: the features would feed the model's other inputs",
                          "public and private tables need the same feature columns in the same order: " +
                          (f"name them in that order, {fields}" if public.source.startswith("files:")
                           else "give the public table the private table's column names"))
    tokens = None
    if public.is_text:
        names = getattr(public.tokenizer, "name", None), getattr(private.tokenizer, "name", None)
        if names[0] != names[1]:
            raise DpclipError(f"the public data ({public.source}) is tokenized with {names[0]!r}, the private data "
                              f"with {names[1]!r}: the same token id would mean different text to the model",
                              "give public: the private data's tokenizer (data.tokenizer)")
        tokens = min(public.train["input_ids"].shape[1], private.train["input_ids"].shape[1])
    private_rows = set(row_fingerprints(private, "train", tokens)) | set(row_fingerprints(private, "test", tokens))
    public_rows = row_fingerprints(public, "train", tokens) + row_fingerprints(public, "test", tokens)
    shared = int(np.sum([row in private_rows for row in public_rows]))
    if shared:
        raise DpclipError(quoting_data(f"{shared} of the {len(public_rows)} public rows ({public.source}) are identical "
                                       "to private training or held-out rows (the same features or text, whatever the "
                                       "label)"),
                          "use a disjoint public set: remove those rows from the public files, or " + CARVE_HINT)
