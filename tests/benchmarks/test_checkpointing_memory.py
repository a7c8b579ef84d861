"""benchmarks/checkpointing_memory.py at smoke size: the script behind docs/performance.md's
"Gradient checkpointing" table still runs every configuration, and checkpointing in either
setting leaves the private gradients unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpointing_memory.py"


@pytest.mark.slow
def test_checkpointing_in_either_setting_changes_no_gradient():
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, check=True,
                         timeout=600).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert list(result["rows"]) == ["non-private", "non-private, checkpointing", "non-private, reentrant checkpointing",
                                    "private", "private, checkpointing", "private, reentrant checkpointing"]
    # float32 sums in another order would differ by rounding only (a lost or doubled use: by O(1))
    assert max(result["gradient_difference"].values()) <= 1e-5
