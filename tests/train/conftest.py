import subprocess
import time

import pytest


@pytest.fixture
def signal_after_first_step():
    """``signal_after_first_step(command, env, runs_dir, signum)``: start ``dpclip train`` as
    ``command``, send ``signum`` once its first metrics line is written, wait for it to end;
    returns ``(returncode, stdout, stderr, run_dir)``."""

    def run(command, env, runs_dir, signum):
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline, metrics = time.time() + 300, []
        while time.time() < deadline:
            metrics = list(runs_dir.glob("*/metrics.jsonl"))
            if metrics and metrics[0].stat().st_size > 0:
                break
            time.sleep(0.02)
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
        assert metrics, f"no run wrote metrics within the deadline: {err}"
        return process.returncode, out, err, metrics[0].parent

    return run
