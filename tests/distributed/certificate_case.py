"""What each spawned rank runs in tests/distributed/test_certificate_ranks.py (importable by name)."""

from __future__ import annotations

from pathlib import Path


def sabotaged_on_rank_one(world, out: str, parallel: str) -> None:
    """Train a sharded or staged run whose engine, on rank 1 only, gives row i the norms of row
    i+1: the check before the cut must refuse it on rank 1, and every other rank must stop too."""
    import dpclip.engine.microbatch as microbatch
    from dpclip.train.workflow import train
    from tests.distributed.pipeline_case import pipeline_recipe
    from tests.distributed.workers import small_recipe

    if world.rank == 1:
        real = microbatch.sqrt_or_zero
        microbatch.sqrt_or_zero = lambda sq: real(sq).roll(1, dims=0)
    if parallel == "pipeline":
        recipe = pipeline_recipe(Path(out) / "runs", "training.parallel=pipeline")
    else:
        recipe = small_recipe(Path(out) / "runs", "layer", "training.parallel=fsdp")
    train(recipe, world=world, run_dir=Path(out) / "run")
