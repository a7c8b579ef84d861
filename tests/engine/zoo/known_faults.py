"""KNOWN_FAULTS: the zoo runs that are not exact today (issue 25), as strict xfails.

Keys are (case, shape, grouping, method, precision) patterns: a value, a tuple of values, or
"*" for all. When a fix lands, the runs it fixes XPASS and fail (strict): delete their entries.
``python scripts/supported_models.py --render-only --known-faults`` prints the entries that
the committed results imply.
"""

from __future__ import annotations

#: cases for which a refusal is the right answer (no per-sample gradient exists)
EXPECTED_REFUSALS: dict[str, str] = {
    "batchnorm": "BatchNorm normalises with batch statistics: per-sample gradients do not exist",
    "deberta-v2-mlm": "DisentangledSelfAttention projects the relative-position table, shared by all samples, "
                      "and repeats it over the batch: per-sample gradients of that use cannot be separated "
                      "(config pos_att_type=[] or relative_attention=False is exact)",
    "query-proj-repeat": "a Linear fed a table shared by all samples whose output is then `.repeat`ed over "
                         "the batch: the samples' gradients are summed by the repeat, no per-sample "
                         "gradient can be separated (DeBERTa's pattern)",
    "query-proj-squeeze": "the shared table's weight is read outside its module's call (`rel.weight`), "
                          "so its gradient would bypass the engine: refused as a stray gradient",
}


KNOWN_FAULTS: dict[tuple, str] = {
    # empty: every zoo run is exact or an expected refusal (issue 25). A fault found later goes
    # here as a strict xfail, with its reason, until it is fixed.
}


def _match(value: str, pattern) -> bool:
    return pattern == "*" or value == pattern or (isinstance(pattern, tuple) and value in pattern)


def known_fault(case: str, shape: str, grouping: str, method: str, precision: str) -> str | None:
    """The reason of the first KNOWN_FAULTS entry matching this run, or None."""
    key = (case, shape, grouping, method, precision)
    for pattern, reason in KNOWN_FAULTS.items():
        if all(_match(v, p) for v, p in zip(key, pattern)):
            return reason
    return None
