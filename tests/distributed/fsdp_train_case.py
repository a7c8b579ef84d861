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


def _one_sharded_step(world) -> None:
    """A two-block model sharded over the world, one private step and one optimizer step; every
    object of it is dropped when this returns."""
    import torch
    from torch import nn

    from dpclip.distributed.sharded import ShardReducer, Shards
    from dpclip.engine import DPEngine

    class TwoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 2)])

        def forward(self, rows):
            return self.blocks[1](torch.tanh(self.blocks[0](rows))).pow(2).sum(1)

    torch.manual_seed(0)
    model = TwoBlocks()
    shards = Shards(model, world)
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=1.0, expected_batch_size=4,
                      reducer=ShardReducer(world))
    engine.certify(lambda: model(torch.randn(3, 4)), before="sharding")
    shards.shard(engine)
    optimizer = torch.optim.AdamW(model.parameters())
    engine.backward(model(torch.randn(2, 4)))
    engine.privatize()
    optimizer.step()
    engine.detach()


def gloo_threads_after_a_sharded_step(rank: int, port: int, found) -> None:
    """A spawned rank that runs one sharded step, leaves the world and puts on ``found``: (rank,
    the names of this process's gloo threads still alive)."""
    import os

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
    from dpclip.distributed import joined_world
    from tests.distributed.workers import gloo_threads_left

    with joined_world() as world:
        _one_sharded_step(world)
    found.put((rank, gloo_threads_left()))
