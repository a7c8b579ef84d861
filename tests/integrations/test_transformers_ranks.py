"""DPTrainer launched on 2 processes with torchrun or `accelerate launch` trains data-parallel: with seeded sampling
and noise (tests only), it reaches the weights of the one-process run and writes the same
ledger, whose ε is `dpclip account`'s on the same (σ, q, steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.integrations import trainer_ranks_case

REPO = Path(__file__).resolve().parents[2]
CASE = Path(trainer_ranks_case.__file__)


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    # accelerate's own launcher (it runs torchrun with its settings; --multi_gpu is its data-parallel mode,
    # which runs on the CPU with gloo when there is no GPU)
    "accelerate launch": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_trainer_on_two_processes_matches_one_process_and_dpclip_account(tmp_path, cli, capsys, launcher):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for out, launch in (("one", [sys.executable, str(CASE)]), ("two", [*LAUNCHERS[launcher], str(CASE)])):
        done = subprocess.run(launch + [str(tmp_path / out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    assert one.keys() == two.keys()
    for name in one:  # the sum over ranks adds in another order: float32 rounding, no more
        assert (one[name] - two[name]).abs().max() < 1e-5, name
    ledger = json.loads((tmp_path / "two" / "ledger.json").read_text())
    assert ledger == json.loads((tmp_path / "one" / "ledger.json").read_text())
    privacy = json.loads((tmp_path / "two" / "privacy.json").read_text())
    q = trainer_ranks_case.BATCH / trainer_ranks_case.EXAMPLES
    assert privacy["sample_rate"] == q and privacy["steps"] == trainer_ranks_case.STEPS
    assert any(line.startswith("distribution: data parallel over 2 processes") for line in privacy["statement"])
    capsys.readouterr()
    result = cli("account", "--sigma", 1.0, "-q", repr(q), "--steps", trainer_ranks_case.STEPS, "--delta", 1e-5,
                 "--json")
    assert ledger["epsilon"] == json.loads(result.out)["epsilon"]
