"""docs/engine.md's "Using it in your own training loop" runs as written."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def _loop_example() -> str:
    section = DOC.read_text(encoding="utf-8").split("## Using it in your own training loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_own_training_loop_example_of_engine_md_runs_and_charges_every_step(capsys):
    import torch

    namespace: dict = {}
    threads = torch.get_num_threads()
    try:
        exec(compile(_loop_example(), str(DOC), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)   # the example sets the process's threads (configure_speed)
    ledger, engine, model = namespace["ledger"], namespace["engine"], namespace["model"]
    assert ledger.steps == namespace["steps"] and ledger.epsilon() > 0
    assert all(p.grad is None for p in model.parameters())
    assert "ε = " in capsys.readouterr().out
    del engine
