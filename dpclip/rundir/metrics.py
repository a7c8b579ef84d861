"""metrics.jsonl, one record per released step (docs/training.md, "metrics.jsonl"): the record
itself, its append, and the records a crash left after the checkpoint, which a resume's
redone steps must release again exactly (``released_part``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpclip.files import OWNER_ONLY, append_line, jsonl_records, write_text_atomic


#: Fields of a metrics record that are charged releases (what a replay must reproduce). The
#: exact diagnostics are left out: a replay never writes them again, so float differences
#: there (another thread count) release nothing new and need not stop a resume.
_RELEASED_FIELDS = ("thresholds", "noise_std", "policy")


def released_part(record: dict[str, Any]) -> str:
    return json.dumps({k: record.get(k) for k in _RELEASED_FIELDS}, sort_keys=True)


def step_record(step, report, epsilon, loss_sum, batch_len, expected_batch, lr, seconds, clip_fn,
                 diagnostics: bool = True) -> dict[str, Any]:
    """One step's line of metrics.jsonl: the released part (:data:`_RELEASED_FIELDS`) and,
    with exact diagnostics on, the labelled diagnostics and the step's wall time ``seconds``
    (docs/training.md, "metrics.jsonl"); with them off, neither is written."""
    summary = report.to_dict()
    record = {
        "step": step,
        "epsilon": epsilon,
        "lr": lr,
        "thresholds": summary["thresholds"],
        "noise_std": summary["noise_std_grad"],
        "policy": summary["policy_summary"] or None,
    }
    if diagnostics:
        # Computed WITHOUT noise from the private batch: not covered by ε, and marked so.
        record["diagnostics"] = {
            "train_loss": loss_sum / expected_batch,
            "batch_size": batch_len,
            "clip_fraction": None if clip_fn == "auto" else summary["clip_fraction"],
            "norm_median": summary["norm_quantiles"].get("median"),
            "nonfinite": summary["nonfinite"],  # samples dropped for a non-finite norm, per group
        }
        if summary["certificate"] is not None:   # this step's check of the engine (docs/certificate.md)
            record["diagnostics"]["certificate"] = summary["certificate"]
        # The step's wall time follows its realised (private) Poisson batch size.
        record["seconds"] = round(seconds, 4)
        record["not_covered_by_epsilon"] = ["diagnostics", "seconds"]
    return record


def last_released_step(path: Path) -> int:
    """The step of metrics.jsonl's last private step record (one with ``noise_std``; 0: none): the
    loop writes ledger.json before each step's record, so a ledger with fewer steps was cut back.
    Every line is read, past a cut or damaged one (a record after it still left the process)."""
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines() if path.is_file() else []
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue   # a line cut by a crash
        if isinstance(record, dict) and "noise_std" in record and is_step(record.get("step")):
            return record["step"]
    return 0


def is_step(value: Any) -> bool:
    """Whether ``value`` is a step number as the loop writes it (a whole number, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def append_record(path: Path, record: dict[str, Any]) -> None:
    append_line(path, json.dumps(record))


def released_records(path: Path, last_step: int) -> dict[tuple[str, int], dict[str, Any]]:
    """Records of metrics.jsonl after step ``last_step`` (they left the process before a
    crash), and an evaluation at ``last_step`` (the final one, made after the closing checkpoint),
    keyed by (kind, step); the file keeps every complete line, so the replayed steps are not
    written twice. A line cut by the crash is dropped."""
    if not path.exists():
        path.touch(mode=OWNER_ONLY)
        return {}
    kept, later = [], {}
    for line, record in jsonl_records(path):   # up to a line cut by the crash (or damaged)
        if not is_step(record.get("step")):
            break   # not a record the loop wrote: neither it nor what follows is kept
        kept.append(line)
        kind = "eval" if "eval" in record else "step"
        # The final evaluation follows the closing checkpoint of its step: a resume from it evaluates again.
        if record["step"] > last_step or (kind == "eval" and record["step"] == last_step):
            later[(kind, record["step"])] = record
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))
    return later
