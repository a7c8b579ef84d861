"""Behaviour-equivalence harness for refactors of the training loop (issue 27).

Trains a fixed set of small recipes with ``privacy.unsafe_seeded_randomness: true`` (so
noise and batches follow the recipe's seed) with the dpclip found on ``PYTHONPATH``, and
prints, per case, the ledger's ε (all digits, from ledger.json and summary.json) and the
sha256 of every released weight file (each checkpoint's model.safetensors, and an export's
weight files). Run it on two trees and compare::

    PYTHONPATH=/tmp/base python scripts/compare_runs.py run /tmp/cmp/base
    PYTHONPATH=$PWD   python scripts/compare_runs.py run /tmp/cmp/new
    python scripts/compare_runs.py compare /tmp/cmp/base/results.json /tmp/cmp/new/results.json

Only public entry points are used (``train``, ``export_run``, the ``dpclip`` command), so the
same script drives the code before and after a refactor. Not a test: the numbers are the
base commit's, whatever they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEEDED = ["privacy.unsafe_seeded_randomness=true"]
SHORT = ["training.epochs=null", "training.steps=12", "checkpoint.every_steps=4", "checkpoint.keep=10",
         "eval.every_steps=6", *SEEDED]
CONTINUAL = ["data.public_fraction=0.1", "public={source: builtin, name: digits}"]
QUANTILE = "clipping.threshold={kind: quantile, initial: 1.0, sigma: 2.0}"
PIPELINE = ["training.parallel=pipeline", "clipping.grouping={stages: ['^1$', '^3$']}"]

# name -> (recipe file, overrides, how it is run)
CASES = {
    "quickstart-fixed": ("quickstart.yaml", SHORT, "plain"),
    "quickstart-quantile": ("quickstart.yaml", [*SHORT, QUANTILE], "plain"),
    "quickstart-histogram-dcsgd": ("dcsgd-e-digits.yaml", SHORT, "plain"),
    "quickstart-shuffle-param": ("quickstart.yaml", [*SHORT, "training.sampling=shuffle", "clipping.grouping=param"],
                                 "plain"),
    "dp-adam-quantile": ("quickstart.yaml", [*SHORT, QUANTILE, "training.optimizer={kind: adam, lr: 0.003}"], "plain"),
    "resume-after-interrupt": ("quickstart.yaml", [*SHORT, QUANTILE], "interrupt"),
    "resume-replaying-released-steps": ("quickstart.yaml", [*SHORT, QUANTILE], "replay"),
    "resume-with-changed-lr": ("quickstart.yaml", SHORT, "interrupt-lr"),
    "continual-switch-adam": ("quickstart.yaml", [*SHORT, *CONTINUAL, "training.optimizer={kind: adam, lr: 0.003}",
                                                  "continual={switch: {rule: step, at_step: 5}, "
                                                  "at_switch: {reinit_head: true}}"], "plain"),
    "continual-early-stopping-resume": ("quickstart.yaml", [*SHORT, *CONTINUAL, "continual={switch: {every_steps: 1, "
                                                            "patience: 2, max_public_steps: 9}}"], "interrupt"),
    "continual-dpmd": ("quickstart.yaml", [*SHORT, *CONTINUAL, "continual={schedule: dpmd}"], "plain"),
    "diagnostics-public": ("quickstart.yaml", [*SHORT, *CONTINUAL, "continual={schedule: only-private}",
                                               "diagnostics={every_steps: 6, data: public, probes: 2, per_sample: 4}"],
                           "plain"),
    "cnn-export": ("cnn-layer.yaml", [*SHORT, "training.steps=4", "model.channels=[4, 8]", "model.hidden=16"],
                   "export"),
    "mlp-export": ("quickstart.yaml", [*SHORT, "model.hidden=[8]"], "export"),
    "distributed-2-ranks-data": ("quickstart.yaml", [*SHORT, QUANTILE], "nproc"),
    "distributed-2-ranks-resume": ("quickstart.yaml", SHORT, "nproc-resume"),
    "distributed-2-ranks-pipeline": ("quickstart.yaml", [*SHORT, *PIPELINE, "training.micro_batch_size=16"], "nproc"),
    "distributed-2-ranks-fsdp": ("quickstart.yaml", [*SHORT, "training.parallel=fsdp"], "nproc"),
}
# Every shipped recipe, eight seeded steps each (issue 53: "every recipe and parallel mode").
BRIEF = ["training.epochs=null", "training.steps=8", "checkpoint.every_steps=4", "eval.every_steps=4", *SEEDED]
CASES.update({f"recipe-{file.stem}": (file.name, BRIEF, "plain")
              for file in sorted((REPO / "recipes").glob("*.yaml"))})


def sha256(path: Path) -> str:
    """sha256 of a weight file's content. A safetensors file is hashed canonically (tensor
    names sorted, each with dtype, shape and bytes; the metadata sorted): safetensors writes
    its header's metadata keys in a random order, so equal files differ byte for byte."""
    if path.suffix != ".safetensors":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    from safetensors import safe_open
    digest = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        digest.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name).contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(-1).view(torch_uint8()).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def torch_uint8():
    import torch
    return torch.uint8


def weight_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every weight file under ``folder`` (model weights only, not optimizer state)."""
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and (p.name.startswith("model") and p.suffix in (".safetensors", ".bin")
                                or p.name == "adapter_model.safetensors") and ".staging" not in str(p)}


def epsilons(run_dir: Path) -> dict[str, str]:
    ledger = json.loads((run_dir / "ledger.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"ledger_epsilon": repr(ledger.get("epsilon")), "summary_epsilon": repr(summary.get("epsilon")),
            "steps": repr(summary.get("steps_done")), "stopped": summary.get("stopped")}


def _load(recipe: str, overrides: list[str], out: Path):
    from dpclip.recipe import load_recipe
    return load_recipe(REPO / "recipes" / recipe, [f"output_dir={out}", *overrides])


class _StopAfter:
    """An observer that sends this process SIGTERM after private step ``step`` (the trainer
    defers it to the step boundary and checkpoints there)."""

    def __init__(self, step: int):
        self.step = step

    def on_start(self, info): pass
    def on_eval(self, record): pass
    def on_end(self, result): pass

    def on_step(self, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _dpclip(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "dpclip", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0 and "interrupted" not in done.stdout + done.stderr:
        raise RuntimeError(f"dpclip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def run_case(name: str, out: Path) -> dict:
    from dpclip.train.workflow import train

    recipe_file, overrides, how = CASES[name]
    case_dir = out / name
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    run_dir = case_dir / "run"
    result: dict = {}
    if how in ("plain", "export"):
        train(_load(recipe_file, overrides, case_dir), run_dir=run_dir)
    elif how in ("interrupt", "interrupt-lr", "replay"):
        first = train(_load(recipe_file, overrides, case_dir), run_dir=run_dir, observer=_StopAfter(6))
        result["first_stop"] = f"{first.stopped}@{first.steps_done}"
        if how == "replay":  # as after a crash: the latest checkpoint is behind the released steps
            (run_dir / "checkpoints" / "LATEST").write_text("step_000004\n")
            shutil.rmtree(run_dir / "checkpoints" / "step_000006")
        if how == "interrupt-lr":
            train(_load(recipe_file, [*overrides, "training.optimizer.lr=0.1"], case_dir), resume=run_dir)
        else:
            train(resume=run_dir)
    elif how in ("nproc", "nproc-resume"):
        from dpclip.recipe import recipe_to_yaml
        recipe = _load(recipe_file, overrides, case_dir / "runs")
        file = case_dir / "recipe.yaml"
        file.write_text(recipe_to_yaml(recipe))
        _dpclip("train", str(file), "--nproc", "2", "--threads", "1", cwd=case_dir)
        run_dir = next((case_dir / "runs").iterdir())
        if how == "nproc-resume":  # as after a crash at step 12 with checkpoint 4 current: steps 5-12 replayed
            (run_dir / "checkpoints" / "LATEST").write_text("step_000004\n")
            for later in ("step_000008", "step_000012"):
                shutil.rmtree(run_dir / "checkpoints" / later)
            _dpclip("train", "--resume", str(run_dir), "--nproc", "2", "--threads", "1", cwd=case_dir)
    result.update(epsilons(run_dir))
    result["weights"] = weight_hashes(run_dir)
    if how == "export":
        from dpclip.export.run import export_run
        export_run(run_dir, case_dir / "export")
        result["weights"].update({f"export/{k}": v for k, v in weight_hashes(case_dir / "export").items()})
    return result


def rehash(out: Path) -> None:
    """Recompute the weight hashes of the runs already in ``out`` (results.json rewritten)."""
    results = json.loads((out / "results.json").read_text())
    for name, result in results.items():
        run_dir = out / name / "run"
        if not run_dir.exists():
            run_dir = next((out / name / "runs").iterdir())
        result["weights"] = weight_hashes(run_dir)
        if (out / name / "export").exists():
            result["weights"].update({f"export/{k}": v for k, v in weight_hashes(out / name / "export").items()})
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))


def run_all(out: Path, names: list[str]) -> None:
    import torch
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    file = out / "results.json"
    results = json.loads(file.read_text()) if file.exists() else {}  # a rerun continues where one stopped
    for name in names or list(CASES):
        if name in results:
            continue
        results[name] = run_case(name, out)
        print(name, results[name]["ledger_epsilon"], len(results[name]["weights"]), "weight files", flush=True)
        file.write_text(json.dumps(results, indent=1, sort_keys=True))


def compare(base_file: Path, new_file: Path) -> int:
    base, new = json.loads(base_file.read_text()), json.loads(new_file.read_text())
    bad = 0
    print(f"| case | ε base | ε new | weight files | same |\n|---|---|---|---|---|")
    for name in base:
        b, n = base[name], new.get(name)
        same = n is not None and b == n
        bad += not same
        eps_new = "-" if n is None else n["ledger_epsilon"]
        print(f"| {name} | {b['ledger_epsilon']} | {eps_new} | {len(b['weights'])} | {'yes' if same else 'NO'} |")
        if n is not None and not same:
            for key in sorted(set(b) | set(n)):
                if b.get(key) != n.get(key):
                    print(f"    {key}: {b.get(key)!r} != {n.get(key)!r}"[:400])
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run_all(Path(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1] == "rehash":
        rehash(Path(sys.argv[2]))
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
