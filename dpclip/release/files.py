"""The file table of the release manifest: every file a run, search or export directory can hold
(docs/accounting.md, "The release manifest")."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

RELEASED = "released"
LABELLED = "not covered by ε"
SECRET = "secret"

RUN, SEARCH, EXPORT = "run", "search", "export"


@dataclass(frozen=True)
class Entry:
    """One kind of file: where it lives, its pattern there, its class, what it is, who writes it."""

    directory: str   # RUN, SEARCH or EXPORT
    pattern: str     # glob relative to that directory, '/'-separated
    release: str     # RELEASED, LABELLED or SECRET
    what: str
    writer: str      # the command that writes it


def _run(pattern: str, release: str, what: str, writer: str = "dpclip train") -> Entry:
    return Entry(RUN, pattern, release, what, writer)


MANIFEST: tuple[Entry, ...] = (
    # ---------------------------------------------------------------- train (dpclip/rundir/run.py, trainer)
    _run("recipe.yaml", RELEASED, "the resolved recipe (its `seed` governs only public randomness); with "
         "`audit.canaries.seed` set it identifies the canaries: share it only after the audit"),
    _run("meta.json", SECRET, "member and non-member indices (membership), split, content and people fingerprints"),
    _run("plan.json", RELEASED, "what the statement is rebuilt from: privacy fingerprint, training-set size "
         "(treated as public: the statement names it not covered by ε), process count, clipping group names, "
         "the names of the buffers the training forward writes, the not-covered lines of recipes a resume replaced, whether a "
         "step's error stopped the run"),
    _run("ledger.json", RELEASED, "every step's charged DpEvent, δ, accountant; ε so far"),
    _run("metrics.jsonl", LABELLED, "per step: ε, lr, released thresholds and noise std (covered); "
         "`diagnostics` and `eval` lines (exact, labelled `not_covered_by_epsilon`)"),
    _run("summary.json", LABELLED, "the final summary; `final_eval` exact and labelled not covered by ε",
         "dpclip train (rewritten by tune-cost --run for its selected run)"),
    _run("search.json", RELEASED, "in a run selected by a search: the search directory, its ε and δ",
         "dpclip tune-cost --run"),
    _run("thresholds.png", RELEASED, "the released clipping thresholds over the run"),
    _run("training.png", LABELLED, "loss and held-out metrics (titled not covered by ε) and ε over the steps"),
    _run("checkpoints/LATEST", RELEASED, "name of the newest complete checkpoint"),
    _run("checkpoints/step_*/model.safetensors", RELEASED, "the weights at that step (post-processing of the "
         "releases charged so far)"),
    _run("checkpoints/step_*/model.json", LABELLED, "what `dpclip export` needs to rebuild the model: "
         "config; and the label names, the label column's values as they are (not covered by ε)"),
    _run("checkpoints/step_*/state.json", SECRET, "optimizer, sampler and noise-generator states, policy, "
         "banded MF's noise history or BLT's buffers, ledger (with them the noise can be regenerated)"),
    _run("checkpoints/step_*/state.safetensors", SECRET, "the tensors of those states"),
    # ---------------------------------------------------------------- continual / Hessian diagnostics
    _run("diagnostics.jsonl", LABELLED, "Hessian diagnostics (on private data: not covered by ε, labelled; "
         "on public data: post-processing of the weights)"),
    _run("hessian_over_training.png", LABELLED, "plot of diagnostics.jsonl, labelled as its data",
         "dpclip train; dpclip diagnose RUN (public data only: private measurements go outside the run)"),
    _run("improvement_vs_batch.png", LABELLED, "predicted improvement against batch size at the latest "
         "checkpoint, measured on public data", "dpclip diagnose RUN (public data only)"),
    # ---------------------------------------------------------------- TensorBoard, report
    _run("tensorboard/events.out.tfevents.*", LABELLED, "the metrics.jsonl scalars; exact ones only under "
         "the `not_covered_by_epsilon/` prefix", "dpclip train (logging.tensorboard: true)"),
    _run("report.html", LABELLED, "plots and statement on one page (the exact ones labelled)", "dpclip report"),
    # ---------------------------------------------------------------- audit (dpclip/audit, dpclip/data/canaries.py)
    _run("audit/canaries.json", SECRET, "which canaries were trained on (the audit's answer key)",
         "dpclip train (audit.canaries)"),
    _run("audit/exposure.json", SECRET, "the secrets planted in the training text and their OS entropy "
         "(canary exposure's answer key)", "dpclip train (audit.exposure)"),
    _run("audit/report.json", LABELLED, "attack metrics and ROC curves, measured on private data; each planted "
         "secret's exposure (its rank among the candidates: with the model, it names the secret)",
         "dpclip audit-mia"),
    _run("audit/one_run_audits.jsonl", RELEASED, "each one-run audit's checkpoint and confidence (your choices, "
         "counted for the multiple-testing note)", "dpclip audit-mia --attack one-run"),
    _run("audit/roc.png", LABELLED, "the attacks' ROC under the DP bound (titled not covered by ε)",
         "dpclip audit-mia"),
    _run("audit/shadows/**", SECRET, "LiRA's and RMIA's shadow runs (run directories on private subsets) and "
         "keep.json, each shadow's membership", "dpclip audit-mia --attack lira|rmia"),
    # ---------------------------------------------------------------- search (dpclip/tuning/search.py)
    Entry(SEARCH, "ledger.json", RELEASED, "the search's one repeat-and-select event", "dpclip tune-cost --run"),
    Entry(SEARCH, "summary.json", RELEASED, "the search's ε, statement and the selected run (no exact scores)",
          "dpclip tune-cost --run"),
    # ---------------------------------------------------------------- export (dpclip/export)
    Entry(EXPORT, "model.safetensors", RELEASED, "the exported weights (plain torch or transformers)",
          "dpclip export"),
    Entry(EXPORT, "model-*-of-*.safetensors", RELEASED, "the weights cut in shards (transformers, large models)",
          "dpclip export"),
    Entry(EXPORT, "model.safetensors.index.json", RELEASED, "which shard holds which weight", "dpclip export"),
    Entry(EXPORT, "privacy.json", RELEASED, "the privacy statement; its `not_covered_by_epsilon` names what "
          "the run released outside ε", "dpclip export"),
    Entry(EXPORT, "README.md", RELEASED, "the model card (the same facts as privacy.json)", "dpclip export"),
    Entry(EXPORT, "model_card.json", RELEASED, "recipe's model section, input shape, classes", "dpclip export"),
    Entry(EXPORT, "recipe.yaml", RELEASED, "the recipe without `audit` and `seed`, local paths cut to their last "
          "part", "dpclip export"),
    # before *config.json: tokenizer_config.json is the tokenizer's (first match wins)
    Entry(EXPORT, "tokenizer*", LABELLED, "the tokenizer `data.tokenizer` names, as given: taken as public "
          "(built from public text), listed not covered by ε in the card", "dpclip export"),
    Entry(EXPORT, "*config.json", RELEASED, "transformers / peft / generation configs", "dpclip export"),
    Entry(EXPORT, "adapter_model.safetensors", RELEASED, "a LoRA run's adapters and DP-trained head",
          "dpclip export"),
    Entry(EXPORT, "base/*", RELEASED, "a LoRA run's public starting weights, bit for bit", "dpclip export"),
    Entry(EXPORT, "dpclip_tokenizer.json", RELEASED, "the byte tokenizer's settings", "dpclip export"),
    Entry(EXPORT, "special_tokens_map.json", LABELLED, "the tokenizer's special tokens (as `tokenizer*`)",
          "dpclip export"),
    Entry(EXPORT, "vocab.*", LABELLED, "the tokenizer's vocabulary (as `tokenizer*`)", "dpclip export"),
    Entry(EXPORT, "merges.txt", LABELLED, "the tokenizer's merges (as `tokenizer*`)", "dpclip export"),
    Entry(EXPORT, "chat_template.*", LABELLED, "the tokenizer's chat template (as `tokenizer*`)", "dpclip export"),
    Entry(EXPORT, "added_tokens.json", LABELLED, "the tokenizer's added tokens (as `tokenizer*`)", "dpclip export"),
    Entry(EXPORT, "*.model", LABELLED, "a sentencepiece tokenizer's model (`spiece.model`; as `tokenizer*`)",
          "dpclip export"),
)


def match_path(parts: list[str], pattern: list[str]) -> bool:
    """Segment-wise glob: ``**`` matches zero or more segments, other segments by fnmatch."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(match_path(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and match_path(parts[1:], pattern[1:])


def find(relpath: str | Path, directory: str, rows: tuple):
    """The first of ``rows`` (each with a ``directory`` and a glob ``pattern``) that matches the
    file at ``relpath`` in a ``directory`` of that kind, or None. In a search directory, a file
    under ``runs/<trial>/`` is looked up as a run directory's (a trial is a run)."""
    parts = Path(relpath).as_posix().split("/")
    if directory == SEARCH and len(parts) > 2 and parts[0] == "runs":
        return find("/".join(parts[2:]), RUN, rows)
    return next((row for row in rows if row.directory == directory
                 and match_path(parts, row.pattern.split("/"))), None)


def classify(relpath: str | Path, directory: str = RUN) -> Entry | None:
    """The entry of the file at ``relpath`` (relative to a ``directory`` of that kind), or None."""
    return find(relpath, directory, MANIFEST)


def directory_kind(directory: str | Path) -> str:
    """What ``directory`` is: an export (privacy.json and no ledger), a search (runs/ and no
    meta.json) or a run."""
    path = Path(directory)
    if (path / "privacy.json").is_file() and not (path / "ledger.json").exists():
        return EXPORT
    if (path / "runs").is_dir() and not (path / "meta.json").exists():
        return SEARCH
    return RUN


def is_leftover(relpath: Path) -> bool:
    """An interrupted atomic write's temporary file (``.NAME.*.tmp``, dpclip/files.py) or a
    checkpoint's staging folder (``.step_NNNNNN.staging``, dpclip/rundir/checkpoint.py): left
    by a crash, never read as an output. Any other dot-named file is checked like the rest."""
    name_is_tmp = relpath.name.startswith(".") and relpath.name.endswith(".tmp")
    return name_is_tmp or any(fnmatch.fnmatchcase(part, ".step_*.staging") for part in relpath.parts[:-1])


def unlisted(directory: str | Path, kind: str | None = None) -> list[str]:
    """Every file under ``directory`` (its kind guessed unless given) that no entry classes,
    as sorted '/'-separated relative paths."""
    root = Path(directory)
    kind = kind or directory_kind(root)
    found = []
    for path in sorted(root.rglob("*")):
        relpath = path.relative_to(root)
        if path.is_file() and not is_leftover(relpath) and classify(relpath, kind) is None:
            found.append(relpath.as_posix())
    return found


