"""The field tables of the release manifest: what each field of a released JSON, JSON-lines or
TensorBoard file, or of a released safetensors file's ``__metadata__``, is (docs/accounting.md,
"The release manifest")."""

from __future__ import annotations

import fnmatch
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from dpclip.release.files import EXPORT, LABELLED, RELEASED, RUN, SEARCH, SECRET, Entry, classify, directory_kind, \
    find, is_leftover, match_path

@dataclass(frozen=True)
class Fields:
    """The fields one released file may hold.

    Field paths are '/'-separated keys from the record's top (lists are transparent: a list's
    items sit at the list's own path), with ``*`` for any one key and ``**`` for any number.
    ``self_labelled``: each record names its labelled top-level keys in its own
    ``not_covered_by_epsilon`` list, unless it is computed from public data and the weights
    alone (:data:`_PUBLIC_RECORDS`: a diagnostics record on public data, a continual run's
    public-phase and switch lines).
    """

    directory: str
    pattern: str                      # the file's MANIFEST pattern
    released: tuple[str, ...]
    labelled: tuple[str, ...] = ()
    self_labelled: bool = False
    what: str = ""


_SIGMAS = ("noise_multiplier", "gradient_noise_multiplier", "sigma_aux", "aux_fraction", "aux_sensitivity", "releases/**",
           # BLT's public plan (PlanResult.step_metadata): rate, groups, buffers, the run's sensitivity
           "sample_rate", "groups", "buffers", "sensitivity",
           "caveats/**")   # a shuffled loader's: accounted as if Poisson
_STATEMENT = ("delta", "epsilon", "epsilon_rdp", "statement")
#: The threshold policies' released (noisy) statistics (dpclip/engine/policies/).
_POLICY_KEYS = ("range", "next_range", "noisy_total", "noisy_histogram", "noisy_unclipped_fraction", "tail_score",
                "sensitivity")
_POLICY = tuple(f"policy/{key}" for key in _POLICY_KEYS)
#: A continual run's public-phase and switch lines (docs/continual.md).
_CONTINUAL = ("phase", "public_step", "alpha", "public_loss", "public_eval/*", "b_star", "probe", "kind", "reason",
              "reset", "reinit_head", "probe_steps")
#: What a search writes into the run it selected (dpclip/tuning/search.py).
_SELECTED = ("search_format", "search_dir", "ledger", "epsilon", "delta", "score", "configuration/*", "note")
#: audit/report.json's count of the canaries that went in (dpclip/audit/one_run.py): a statistic of the
#: secret answer key, computed exactly, outside the engine, so not covered by ε (named, not just under ``**``).
_INCLUDED_CANARIES = "one_run/included"
#: A released safetensors file's header ``__metadata__`` (string values; the tensors' own entries are the weights):
#: ``format`` (safetensors' and transformers'), ``dpclip_tied`` (a checkpoint's tied parameter names: the architecture).
_WEIGHTS_METADATA = ("format", "dpclip_tied")
_WEIGHTS_WHAT = "a weight file's header `__metadata__` (a checkpoint's, `save_pretrained`'s, peft's)"
#: Records computed from public data and the weights alone: nothing in them is labelled.
_PUBLIC_RECORDS = (("covered_by_epsilon", True), ("phase", "public"), ("kind", "switch"))

FIELDS: tuple[Fields, ...] = (
    Fields(RUN, "metrics.jsonl",
           released=("step", "epsilon", "lr", "thresholds", "noise_std", "policy", *_POLICY, "not_covered_by_epsilon",
                     *_CONTINUAL),
           labelled=("diagnostics/*", "diagnostics/certificate/*", "eval/*", "seconds"), self_labelled=True,
           what="a step's charged releases and ε; its exact diagnostics, wall time and held-out metrics, "
                "each named in the line's `not_covered_by_epsilon`; a public-phase line (`phase: public`) "
                "and the switch line are computed from public data and the weights alone"),
    Fields(RUN, "summary.json",
           released=(*_STATEMENT, "run_dir", "steps_done", "steps_planned", "stopped",
                     *(f"noise/{name}" for name in _SIGMAS), "sigma_change", "sigma_change/*", "sigma_change/changed/*",
                     "resume_changes", "resume_changes/*", "epsilon_this_run_alone", *(f"selected_by_search/{field}" for field in _SELECTED),
                     "not_covered_by_epsilon"),
           labelled=("final_eval/*",), self_labelled=True),
    Fields(RUN, "plan.json", released=("groups", "num_train", "num_users", "privacy_fingerprint", "world_size",
                                       "forward_written_state", "earlier_not_covered", "stopped_on_private_batch"),
           what="`num_train` (`num_users` at the user level) is N, which q = B/N gives anyway: treated as public, "
                "the statement names it not covered by ε"),
    Fields(RUN, "ledger.json",
           released=("format", "accountant", "accountant_used", "fallback_reason", "delta", "epsilon",
                     "epsilon_rdp", "steps", "entries/count", "entries/event/**",
                     *(f"entries/metadata/{name}" for name in _SIGMAS)),
           what="dp_accounting's DpEvent of each step, as its JSON"),
    Fields(RUN, "search.json", released=_SELECTED,
           what="the selection score is noisy (tuning.score: private) or exact on a held-out split the recipe "
                "declares public"),
    Fields(RUN, "diagnostics.jsonl",
           released=("step", "data", "covered_by_epsilon", "not_covered_by_epsilon", "batch_size",
                     "probes", "per_sample", "gradient_noise_multiplier", "batch_size_dp", "clip_fn", "threshold",
                     "public_batch_size"),
           labelled=("trace_h", "trace_h_stderr", "gthg", "trace_h_sigma", "grad_norm_sq",
                     "mean_sample_grad_norm_sq", "clip_factor", "decelerator", "b_star_dp", "improvement",
                     "improvement_non_private", "alpha_star"),
           self_labelled=True,
           what="on private data the measured quantities are labelled; on public data (`covered_by_epsilon: "
                "true`) they are post-processing of the weights"),
    Fields(RUN, "checkpoints/step_*/model.json",
           released=("kind", "task", "num_classes", "input_shape", "vocab_size", "model/**", "hf_class",
                     "hf_config/**", "peft_config/**", "tied/*"),
           labelled=("label_names", "hf_config/id2label/*", "hf_config/label2id/*"),
           what="the label names are the label column's values as they are (an export labels them)"),
    Fields(RUN, "audit/report.json", released=(), labelled=(_INCLUDED_CANARIES, "**"),
           what="the whole file is measured on private data; `one_run/included`, how many canaries went in, is an "
                "exact count of the answer key's secret inclusion bits (audit/canaries.json): the canaries' "
                "membership, private records with `mislabel` canaries; it narrows the answer key"),
    Fields(RUN, "audit/one_run_audits.jsonl", released=("checkpoint", "confidence")),
    Fields(RUN, "tensorboard/events.out.tfevents.*",
           released=("privacy/epsilon", "privacy/epsilon_this_run_alone", "train/lr", "thresholds/*",
                     "noise_std/*", *(f"{key}/**" for key in _POLICY)),
           labelled=("not_covered_by_epsilon/**",),
           what="scalar tags; the exact ones only under `not_covered_by_epsilon/`"),
    Fields(SEARCH, "ledger.json",
           released=("format", "accountant", "accountant_used", "fallback_reason", "delta", "epsilon",
                     "epsilon_rdp", "steps", "entries/count", "entries/event/**", "entries/metadata/**")),
    Fields(SEARCH, "summary.json",
           released=("search_format", "search_dir", "mechanism", "trials_distribution", "trials_mean", "trials_shape",
                     "sigma_per_run", "sample_rate", "steps_per_run", "score", "score_meaning", "score_noise",
                     "seeded_randomness", "promised_epsilon", "epsilon", "delta", "accountant", "stopped",
                     "selected_run", "selected_run_dir", "selected_configuration", "selected_configuration/*",
                     "selected_score", "not_released"),
           what="`selected_score` as in a run's search.json"),
    Fields(RUN, "**/*.safetensors", released=_WEIGHTS_METADATA, what=_WEIGHTS_WHAT),
    Fields(EXPORT, "**/*.safetensors", released=("format",), what=_WEIGHTS_WHAT),
    Fields(EXPORT, "privacy.json",
           released=("format", "dpclip", "accountant", "checkpoint", "checkpoint_step", "conversion", "covers",
                     "delta", "epsilon", "neighbouring", "noise_multiplier", "gradient_noise_multiplier",
                     "not_covered_by_epsilon", "recipe",
                     "sample_rate", "sampling", "sampling_assumption", "seeded_randomness", "statement", "steps",
                     "unit_of_privacy", "warning", "caveats", "selected_by_search/*", "mechanism/*", "processes",
                     "distribution", "steps_planned", "stopped", "progress")),
    Fields(EXPORT, "model_card.json",
           released=("format", "input_shape", "model/**", "num_classes", "privacy/*", "privacy/selected_by_search/*",
                     "privacy/mechanism/*",
                     "rebuild", "task", "weights", "vocab_size"),
           labelled=("label_names",)),
)

#: Released JSON files whose fields are not dpclip's to class, and why.
OPAQUE = {
    "*config.json": "written by transformers / peft: the architecture (and label names, labelled in the card)",
    "tokenizer*": "the data's tokenizer as given, as transformers writes it: taken as public, not covered by ε",
    "special_tokens_map.json": "the tokenizer's",
    "vocab.*": "the tokenizer's",
    "dpclip_tokenizer.json": "the byte tokenizer's fixed settings",
    "added_tokens.json": "the tokenizer's",
    "model.safetensors.index.json": "written by transformers: each weight's shard file and the total size",
}


def field_paths(record: object, prefix: tuple[str, ...] = ()) -> list[str]:
    """Every leaf of a JSON record as a '/'-separated key path (lists transparent)."""
    if isinstance(record, dict):
        return [path for key, value in record.items() for path in field_paths(value, (*prefix, str(key)))]
    if isinstance(record, list):
        return sorted({path for item in record for path in field_paths(item, prefix)}) or ["/".join(prefix)]
    return ["/".join(prefix)]


def fields_of(relpath: str | Path, directory: str = RUN) -> Fields | None:
    """The field table of the file at ``relpath``, or None."""
    return find(relpath, directory, FIELDS)


def _field_class(path: str, table: Fields) -> str | None:
    parts = path.split("/")
    for release, patterns in ((LABELLED, table.labelled), (RELEASED, table.released)):
        if any(match_path(parts, pattern.split("/")) for pattern in patterns):
            return release
    return None


def _records(path: Path) -> list[object]:
    """The records of a JSON, JSON-lines or TensorBoard events file (TensorBoard: one record,
    the tags of every kind of summary it holds, scalars, histograms, images, audio, text and
    other tensors, and ``(graph)``-style fields for a graph or run metadata: any of them can
    carry a value of the data)."""
    if path.suffix == ".safetensors":   # an 8-byte little-endian header length, then the JSON header
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            return [json.loads(handle.read(length)).get("__metadata__") or {}]
    if path.name.startswith("events.out.tfevents."):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        tags: dict[str, None] = {}
        for kind, found in accumulator.Tags().items():
            if isinstance(found, (list, tuple)):
                tags.update((tag, None) for tag in found)
            elif found:   # a graph or meta-graph: no tag, still a field
                tags[f"({kind})"] = None
        return [tags]
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return [json.loads(text)]


def _needs_fields(relpath: Path, entry: Entry) -> bool:
    readable = relpath.suffix in (".json", ".jsonl", ".safetensors") or relpath.name.startswith("events.out.tfevents.")
    opaque = any(fnmatch.fnmatchcase(relpath.name, pattern) for pattern in OPAQUE)
    return entry.release != SECRET and readable and not opaque


def unlisted_fields(directory: str | Path, kind: str | None = None) -> list[str]:
    """Every field of a released file (a safetensors file: its ``__metadata__``) under ``directory`` that
    :data:`FIELDS` does not class,
    every labelled field a self-labelling record does not name, and every released JSON file
    with no field table, as sorted ``'relpath: field'`` lines."""
    root = Path(directory)
    kind = kind or directory_kind(root)
    found: set[str] = set()
    for path in sorted(root.rglob("*")):
        relpath = path.relative_to(root)
        entry = classify(relpath, kind) if path.is_file() and not is_leftover(relpath) else None
        if entry is None or not _needs_fields(relpath, entry):
            continue
        table = fields_of(relpath, kind)
        if table is None:
            found.add(f"{relpath.as_posix()}: (no field table)")
            continue
        for record in _records(path):
            labels = record.get("not_covered_by_epsilon") if isinstance(record, dict) else None
            covered = isinstance(record, dict) and any(record.get(key) == value for key, value in _PUBLIC_RECORDS)
            for field in field_paths(record):
                release = _field_class(field, table)
                if release is None:
                    found.add(f"{relpath.as_posix()}: {field}")
                elif (release == LABELLED and table.self_labelled and not covered
                      and field.split("/")[0] not in (labels or ())):
                    found.add(f"{relpath.as_posix()}: {field} (labelled, but the record does not say so)")
    return sorted({_generalise(line) for line in found})


def _generalise(line: str) -> str:
    """Checkpoint and trial names are not fields: one report line per kind of file."""
    return re.sub(r"^runs/[^/]+/", "runs/<trial>/", re.sub(r"step_\d+", "step_*", line))
