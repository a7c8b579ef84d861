"""What each spawned rank runs in tests/distributed/test_fsdp_train.py (importable by name)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.workers import interrupted_at, small_recipe

STOP = 3  # rank 1 asks to stop after this step of the "split" run, which every rank then resumes


def train_sharded(world, out: str, policy: str, *extra: str) -> None:
    """The same seeded recipe sharded (training.parallel: fsdp) twice: straight through into
    ``out/whole``, and stopped after step 3 then resumed into ``out/split``."""
    from dpclip.train.workflow import train

    recipe = small_recipe(Path(out) / "runs", policy, "training.parallel=fsdp", "eval.every_steps=3", *extra)
    train(recipe, world=world, run_dir=Path(out) / "whole")
    first = interrupted_at(world, STOP, lambda: train(recipe, world=world, run_dir=Path(out) / "split"))
    if world.main:
        (Path(out) / "split-first.txt").write_text(f"{first.stopped} {first.steps_done}")
    train(resume=Path(out) / "split", world=world)
