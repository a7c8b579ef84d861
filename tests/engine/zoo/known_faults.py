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
}

NOT_T = ("generic", "B==T+1", "B==1")       # every shape family but B == T

KNOWN_FAULTS: dict[tuple, str] = {
    # --- batch axis inferred from a size: refused when no size matches, wrong when T == B
    ("t5", NOT_T, "*", "*", "*"):
        "issue 25: refused: relative_attention_bias (Embedding) gets [T, T] bucket ids, no batch axis",
    ("t5", "B==T", "*", "*", "*"):
        "issue 25: wrong: [T, T] relative-position ids taken as [B, T]; relative_attention_bias off by 0.38",
    ("encoder-layer-seq-first", NOT_T, "*", "*", "*"):
        "issue 25: refused: TransformerEncoderLayer(batch_first=False) norm2 sees [T, B, d]",
    ("encoder-layer-seq-first", "B==T", "*", "*", "*"):
        "issue 25: wrong: [T, B, d] taken as [B, T, d] when T == B (linear2/norm2 off by 0.28)",
    ("opacus-dpmha", NOT_T, "*", "*", "*"):
        "issue 25: refused: DPMultiheadAttention's out_proj sees [T, B, d]",
    ("opacus-dpmha", "B==T", "*", "*", "*"):
        "issue 25: wrong: DPMultiheadAttention [T, B, d] taken as [B, T, d] when T == B (off by 0.38)",
    ("seq-first-linear", NOT_T, "*", "*", "*"):
        "issue 25: refused: nn.Linear on sequence-first [T, B, d]",
    ("seq-first-linear", "B==T", "*", "*", "*"):
        "issue 25: wrong: nn.Linear's [T, B, d] input taken as [B, T, d] when T == B (off by 0.41)",
    ("seq-first-embedding", NOT_T, "*", "*", "*"):
        "issue 25: refused: nn.Embedding on sequence-first [T, B] ids",
    ("seq-first-embedding", "B==T", "*", "*", "*"):
        "issue 25: wrong: nn.Embedding's [T, B] ids taken as [B, T] when T == B (off by 0.14)",
    ("nanogpt-positions", NOT_T, "*", "*", "*"):
        "issue 25: refused: wpe(torch.arange(T)) has no batch axis",
    ("nanogpt-positions", "B==T", "*", "*", "*"):
        "issue 25: wrong: wpe(torch.arange(T)) taken as per-sample ids when T == B (wpe off by 0.12)",
    ("linear-on-shared-table", NOT_T, "*", "*", "*"):
        "issue 25: refused: nn.Linear on a shared [T, d] table",
    ("linear-on-shared-table", "B==T", "*", "*", "*"):
        "issue 25: wrong: a shared [T, d] table taken as [B, d] when T == B (proj off by 0.43)",
    ("custom-on-shared-table", NOT_T, "*", "*", "*"):
        "issue 25: refused: torch.func fallback module fed a shared [T, d] tensor",
    ("custom-on-shared-table", "B==T", "*", "*", "*"):
        "issue 25: wrong: torch.func fallback maps a shared [T, d] tensor over samples when T == B (off by 0.28)",
    ("learned-query-index0", ("generic", "B==T", "B==T+1"), "*", "*", "*"):
        "issue 25: wrong: lin(q)[0] on a learned [1, R, d] query: the batch's gradient lands on sample 0 (off by 0.41)",
    ("bart", ("generic", "B==T", "B==T+1"), "*", "*", "*"):
        "issue 25: refused: BartLearnedPositionalEmbedding returns [1, T, d] (no batch axis) when B > 1",
    ("opt", "*", "*", "*", "*"):
        "issue 25: refused: OPT reshapes to [B*T, d] before fc1/fc2",
    # --- crashes with internal tracebacks
    ("query-proj-repeat", ("generic", "B==T", "B==T+1"), "*", "*", "*"):
        "issue 25: crashed: query_proj(rel.unsqueeze(0)) returns [B, R, d], so .repeat(B, 1, 1) gives B*B rows",
    ("query-proj-squeeze", ("generic", "B==T", "B==T+1"), "*", "*", "*"):
        "issue 25: crashed: query_proj(rel.unsqueeze(0)) returns [B, R, d], so .squeeze(0) keeps 3 dims",
    ("query-proj-repeat", "B==1", "*", "*", "*"):
        "issue 25: refused: rel.weight read outside the Embedding's call",
    ("query-proj-squeeze", "B==1", "*", "*", "*"):
        "issue 25: refused: rel.weight read outside the Embedding's call",
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
