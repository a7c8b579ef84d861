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
    "query-proj-repeat": "the shared table's weight is read outside its module's call (`rel.weight`), "
                         "so its gradient would bypass the engine: refused as a stray gradient (with the "
                         "table frozen, query_proj(...).repeat(B, 1, 1) is exact: query-proj-repeat-frozen)",
    "query-proj-squeeze": "the shared table's weight is read outside its module's call (`rel.weight`), "
                          "so its gradient would bypass the engine: refused as a stray gradient",
    # issue 49's outside cases (tests/engine/zoo/outside.py)
    "mobilebert-mlm": "its LM head multiplies by torch.cat([decoder.weight.t(), dense.weight]): the word embedding "
                      "is used functionally, outside its module's call: refused as a stray gradient (issue 52)",
    "resnet": "BatchNorm normalises with batch statistics: per-sample gradients do not exist",
    # refused at one row too: the forward writes its state from the data (the replays with the row
    # set to zeros and to ones leave it otherwise)
    "functional-batchnorm": "F.batch_norm with batch statistics: each sample's output depends on the others, "
                            "and its running buffers are written from the data (at one row too)",
    "row-in-buffer": "the forward writes a training row into a buffer (released with the model), at one row too",
    "peft-p-tuning": "the prompt encoder's embedding is fed the virtual-token ids shared by all samples and feeds an "
                     "MLP: no per-sample layout of the table's output (refused by name; prompt tuning is exact)",
    "peft-vblora": "every adapted layer reads the one vector bank inside its forward, outside the bank's own module: "
                   "the engine cannot follow its per-sample gradient (refused by name, with a hint)",
}

#: cases that mix samples (or keep data in a buffer): refused wherever the batch has two samples
#: or more; with one sample there is nothing to mix, and the run is exact
REFUSED_FROM_TWO_SAMPLES: dict[str, str] = {
    "permuted-batch": "the batch permuted inside the forward: the engine's row i is another sample",
    "centered-batch": "x - x.mean(0): each sample's output depends on the others",
    "mean-normalised-loss": "per-sample losses minus their batch mean: each loss depends on the others",
    "gather-across-batch": "tokens gathered across the batch: no per-sample layout of the gathered rows "
                           "(refused by the probe, or by the certificate where the row count fits)",
    "size-from-batch": "a torch.Size of the whole batch handed to a torch.func fallback module: the per-sample "
                       "recomputation cannot reshape one sample to it (its error, named, not a crash)",
}


KNOWN_FAULTS: dict[tuple, str] = {
    # every other zoo run is exact or an expected refusal (issue 25). A fault found later goes
    # here as a strict xfail, with its reason, until it is fixed.
    ("esmc-mlm", ("B==T", "B==T+1"), ("layer", "param"), "*", "bf16"):
        "issue 25: a false refusal: a sample of one repeated token gives the first layers' query and key weights a gradient "
        "zero in exact arithmetic, bf16 noise alone (0 in the batch); a group of its own has a norm of noise, which "
        "the certificate's group-norm bound refuses (docs/certificate.md)",
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
