"""The release manifest: every file a run, search or export directory can hold, and what it releases.

One table (:data:`MANIFEST`) classes each file, by a glob pattern relative to its directory,
as

- ``RELEASED``: covered by ε (a post-processing of the charged releases, or public facts);
- ``LABELLED``: released but NOT covered by ε, and labelled so wherever it appears;
- ``SECRET``: kept by the operator like the data itself (membership, generator states,
  the audit's answer key).

Inside the released JSON files the classing goes down to fields: :data:`FIELDS` names every
field a released JSON, JSON-lines or TensorBoard file may hold as released or labelled, and
files whose records label themselves (a ``not_covered_by_epsilon`` list of field names) must
name each labelled field they carry (:func:`unlisted_fields`).

The threat model of docs/accounting.md renders both tables (:func:`render_markdown`), and
tests/privacy/test_release_manifest.py walks real directories of every kind and fails on any
file :func:`unlisted` reports and any field :func:`unlisted_fields` reports, so a new output,
or a new field in an old one, cannot ship without an entry.

Patterns are matched segment by segment: ``*`` and ``?`` stay inside one path segment,
``**`` matches any number of segments. A search directory's trials under ``runs/<trial>/``
are run directories and are classed by the run table. Distributed runs write through rank 0
alone: their run directory holds exactly the files of a one-process run (the launcher's
``interrupted.json`` lives in a temporary folder, never in the run directory).

This package is a leaf: it imports nothing of dpclip outside itself. ``files`` holds the file
table, ``fields`` the field tables, ``render`` the docs' rendering.
"""

from dpclip.release.fields import FIELDS, OPAQUE, Fields, field_paths, fields_of, unlisted_fields
from dpclip.release.files import (EXPORT, LABELLED, MANIFEST, RELEASED, RUN, SEARCH, SECRET, Entry, classify,
                                  directory_kind, unlisted)
from dpclip.release.render import BEGIN, END, render_markdown

__all__ = ["BEGIN", "END", "EXPORT", "FIELDS", "LABELLED", "MANIFEST", "OPAQUE", "RELEASED", "RUN", "SEARCH",
           "SECRET", "Entry", "Fields", "classify", "directory_kind", "field_paths", "fields_of", "render_markdown",
           "unlisted", "unlisted_fields"]
