"""The run directory's layout: every file name a run, a search or an audit writes, once.

A leaf module (no dpclip imports) so that every layer that reads or writes a run
directory spells its files from here: the trainer, the checkpoints, the canaries (data),
audit-mia, export, the search and the CLI. ``tests/test_architecture.py`` refuses these
names as string literals anywhere else in the package (``dpclip/release/`` keeps its
glob patterns). What each file holds, and which are released: docs/training.md ("The run
directory") and docs/accounting.md ("Threat model").

::

    RUN_DIR/
      recipe.yaml  meta.json (secret)  plan.json  ledger.json  metrics.jsonl  summary.json
      diagnostics.jsonl  training.png  thresholds.png  hessian_over_training.png
      search.json (a search's selected run)  report.html  tensorboard/
      checkpoints/LATEST  checkpoints/step_NNNNNN/{model.safetensors, model.json,
                                                   state.json, state.safetensors}
      audit/canaries.json (secret)  audit/exposure.json (secret)  audit/report.json  audit/roc.png  audit/shadows/
    SEARCH_DIR/runs/<trial>/   (a search directory: its trials are run directories)
"""

from __future__ import annotations

from pathlib import Path

# --------------------------------------------------------------------- a run directory
RECIPE = "recipe.yaml"
META = "meta.json"                # secret: membership, data fingerprints, the seed
PLAN = "plan.json"                # released: what the privacy statement is rebuilt from
LEDGER = "ledger.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
DIAGNOSTICS = "diagnostics.jsonl"
SEARCH_MARKER = "search.json"     # in a run selected by a search: points to the search directory
REPORT = "report.html"
TENSORBOARD = "tensorboard"
TRAINING_PLOT = "training.png"
THRESHOLDS_PLOT = "thresholds.png"
HESSIAN_PLOT = "hessian_over_training.png"
IMPROVEMENT_PLOT = "improvement_vs_batch.png"

# --------------------------------------------------------------------- checkpoints
CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
MODEL_WEIGHTS = "model.safetensors"   # also the weights file of an exported model directory
MODEL_INFO = "model.json"
STATE = "state.json"
STATE_TENSORS = "state.safetensors"
CHECKPOINT_FILES = (STATE, STATE_TENSORS, MODEL_WEIGHTS)  # a complete checkpoint has all three

# --------------------------------------------------------------------- audit and search
AUDIT = "audit"
CANARIES = "canaries.json"        # under audit/: secret (which canaries were included)
EXPOSURE = "exposure.json"        # under audit/: secret (the planted secrets of canary exposure)
AUDIT_REPORT = "report.json"      # under audit/: audit-mia's result
SHADOWS = "shadows"               # under audit/: LiRA's shadow runs
ROC_PLOT = "roc.png"
ONE_RUN_LOG = "one_run_audits.jsonl"  # under audit/: each one-run audit's checkpoint and confidence
SEARCH_RUNS = "runs"              # in a search directory: its trials


def step_dir_name(step: int) -> str:
    """A checkpoint's folder under checkpoints/: ``step_000500``."""
    return f"step_{step:06d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def audit_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / AUDIT


def canaries_file(run_dir: str | Path) -> Path:
    return audit_dir(run_dir) / CANARIES

# ------------------------------------------------------ a Hugging Face Trainer checkpoint (DPTrainer)
TRAINER_STATE = "dpclip_state_rank{rank}.pt"   # secret: a rank's sampler and noise generator states
TRAINER_RELEASES = "dpclip_releases.jsonl"      # each released step's gradient fingerprint (covered by ε)
