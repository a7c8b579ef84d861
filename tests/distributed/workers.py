"""What each spawned rank runs in tests/distributed (importable by name: spawn pickles by reference)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from dpclip.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]

# The set-ups the equivalence tests pin: all-layer, layer-wise, adaptive (quantile) clipping;
# shuffled batches (B = 300 of N = 1437: the 6 steps cross an epoch, so a second permutation
# is broadcast), interrupted after step 3 and resumed; discriminative clipping's top-fraction
# rule, which ranks the norms of the whole logical batch (gathered over the ranks).
POLICIES = {
    "all-layer": ["clipping.grouping=all-layer"],
    "layer": ["clipping.grouping=layer"],
    "quantile": ["clipping.grouping=layer", "clipping.threshold={kind: quantile, initial: 1.0, sigma: 2.0}"],
    "shuffle": ["clipping.grouping=layer", "training.sampling=shuffle", "training.batch_size=300"],
    # banded MF: cyclic Poisson parts on each rank, rank 0's correlated noise (and its history)
    "banded": ["clipping.grouping=layer", "privacy.mechanism={kind: banded-mf, bands: 3}"],
    # BLT: the same cyclic parts (22 groups here), rank 0's buffers
    "blt": ["clipping.grouping=layer", "privacy.mechanism={kind: blt, buffers: 2}"],
    "top-fraction": ["clipping.grouping=layer", "training.micro_batch_size=null",
                     "clipping.threshold={kind: discriminative, small: 0.3, large: 1.5, tail_rule: top_fraction, "
                     "top_fraction: 0.25}"],
}
# Rank 1 asks to stop after this step of the "shuffle" run, which every rank then resumes.
SHUFFLE_STOP = 3


def small_recipe(out: Path, policy: str, *extra: str):
    """Quickstart, a few seeded steps (so the union of the ranks' draws is the one-process batch)."""
    return load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={out}", "training.epochs=null", "training.steps=6", "checkpoint.every_steps=3",
        "eval.every_steps=null", "privacy.unsafe_seeded_randomness=true", *POLICIES[policy], *extra])


def train_policies(world, out: str, run_names: list[str]) -> None:
    """Train each policy's recipe as one rank, into ``out/<policy>`` (rank 0 writes); then the
    engine case (:func:`engine_grads`): one spawn for all, process start-up is the cost."""
    from dpclip.train.workflow import train

    engine_grads(world, out)
    for policy in run_names:
        recipe = small_recipe(Path(out) / "runs", policy)
        if policy == "shuffle":
            first = interrupted_at(world, SHUFFLE_STOP, lambda: train(recipe, world=world, run_dir=Path(out) / policy))
            if world.main:
                (Path(out) / "shuffle-first.txt").write_text(f"{first.stopped} {first.steps_done}")
            with received_on_resume(world, Path(out) / "resume-received.json"):
                train(resume=Path(out) / policy, world=world)
        else:
            train(recipe, world=world, run_dir=Path(out) / policy)


#: what another rank must not receive of rank 0's checkpoint: the ranks' own parts (each goes to its
#: rank alone), a sampler's generator state, the noise's generator states, correlated-noise history
SECRET_KEYS = ("ranks", "sampler", "generator", "correlation")


def secret_paths(obj, path: str = "") -> list[str]:
    """The paths in ``obj`` (nested dicts and lists) of :data:`SECRET_KEYS` and of noise generator states."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            where = f"{path}.{key}" if path else str(key)
            if key in SECRET_KEYS or (key == "noise" and isinstance(value, dict) and value.get("states")):
                found.append(where)
            else:
                found += secret_paths(value, where)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found += secret_paths(value, f"{path}[{i}]")
    return found


@contextmanager
def received_on_resume(world, out: Path):
    """Rank 1 writes to ``out`` the secret paths of what rank 0 broadcast to it inside the block."""
    found: list[str] = []
    broadcast = world.broadcast

    def recorded(obj):
        got = broadcast(obj)
        found.extend(secret_paths(got))
        return got

    world.broadcast = recorded
    try:
        yield
    finally:
        del world.broadcast
        if world.rank == 1:
            out.write_text(json.dumps(found))


def interrupted_at(world, step: int, run):
    """``run()`` with rank 1 asking to stop (as SIGTERM would) after ``step`` steps."""
    from dpclip.train import trainer

    flags = []
    enter, train_step = trainer.DeferredInterrupt.__enter__, trainer.train_step

    def entered(self):
        flags.append(self)
        return enter(self)

    def stepped(parts, state, indices, output):
        train_step(parts, state, indices, output)
        if world.rank == 1 and state.step == step:
            flags[-1].requested = True

    trainer.DeferredInterrupt.__enter__, trainer.train_step = entered, stepped
    try:
        return run()
    finally:
        trainer.DeferredInterrupt.__enter__, trainer.train_step = enter, train_step


def engine_grads(world, out: str) -> None:
    """noise 0: each rank's half of one batch through DPEngine with the world's reducer; rank 0
    saves p.grad per policy (the one-process grads are computed by the test)."""
    from tests.distributed.engine_case import CLIPPING, grads_for, step_grads

    results = {name: grads_for(name, world.rank, world.size, world.reducer) for name in CLIPPING}
    results["empty-part"] = step_grads(world.rank, world.size, world.reducer)
    if world.main:
        torch.save(results, Path(out) / "engine.pt")


def disagree(world, out: str) -> None:
    """Rank 1 means another learning rate: every rank must refuse before anything is written."""
    from dpclip.train.workflow import train

    extra = ["training.optimizer.lr=0.1"] if world.rank == 1 else []
    train(small_recipe(Path(out) / "runs", "layer", *extra), world=world, run_dir=Path(out) / "run")


def other_code(world, out: str) -> None:
    """Rank 1 runs another dpclip (another node's install): every rank must refuse before anything is written."""
    from dpclip.distributed import code
    from dpclip.train.workflow import train

    if world.rank == 1:
        code.code_fingerprint = lambda: "dpclip 0.0.9 (source 0123456789ab), torch 2.0.0"
    train(small_recipe(Path(out) / "runs", "layer"), world=world, run_dir=Path(out) / "run")


def raise_at_step(world, out: str, step: int) -> None:
    """Rank 1 raises inside its step ``step``: rank 0 must stop too, with its ledger whole."""
    from dpclip.errors import DpclipError
    from dpclip.train import step as step_module
    from dpclip.train.workflow import train

    if world.rank == 1:
        original = step_module.PrivateStep.__call__
        calls = {"n": 0}

        def failing(self, indices, before_update=None):
            calls["n"] += 1
            if calls["n"] == step:
                raise DpclipError("injected failure on rank 1", "this is a test")
            return original(self, indices, before_update)

        step_module.PrivateStep.__call__ = failing
    train(small_recipe(Path(out) / "runs", "layer", "training.steps=20"), world=world, run_dir=Path(out) / "run")


def gloo_threads_left(wait: float = 5.0) -> list[str]:
    """The names of this process's gloo threads still alive once they had ``wait`` seconds to end:
    a thread that ends a moment after the group (a loaded machine) is not one that outlives the
    interpreter; one that lingers is."""
    import os
    import time

    deadline = time.monotonic() + wait
    while True:
        names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
        alive = sorted(name for name in names if "gloo" in name)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def gloo_threads_after_the_world(rank: int, port: int, found) -> None:
    """A spawned rank (not through run_ranks: it looks past the world's end) that imports the
    pipeline's torch modules after joining, as the trainer does when a test's worker imports
    it, runs a collective, leaves the world and puts on ``found``: (rank, whether torch._dynamo
    was imported before joining, the names of this process's gloo threads still alive)."""
    import os
    import sys

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
    from dpclip.distributed import joined_world

    imported_before = "torch._dynamo" in sys.modules
    with joined_world() as world:
        import torch.distributed.pipelining  # noqa: F401
        world.all_gather(rank)
    found.put((rank, imported_before, gloo_threads_left()))


USER_LEVEL = ["data.num_examples=300", "data.num_users=60", "data.max_length=24", "training.epochs=null",
              "training.steps=5", "training.batch_size=8", "training.micro_batch_size=32", "eval.every_steps=null",
              "checkpoint.every_steps=5", "privacy.unsafe_seeded_randomness=true",
              "model.config={model_type: gpt2, n_layer: 2, n_embd: 16, n_head: 2, n_positions: 24, resid_pdrop: 0.0, "
              "embd_pdrop: 0.0, attn_pdrop: 0.0}"]  # no dropout: its masks follow each rank's rows


def user_recipe(out: Path, *extra: str):
    """The user-text recipe, a few seeded steps of a tiny model (people sampled per rank)."""
    return load_recipe(REPO / "recipes" / "user-text.yaml", [f"output_dir={out}", *USER_LEVEL, *extra])


def train_users(world, out: str, parallel: str) -> None:
    from dpclip.train.workflow import train
    train(user_recipe(Path(out) / "runs", f"training.parallel={parallel}"), world=world, run_dir=Path(out) / "run")


def stuck_rank_one(world, seconds: float) -> None:
    """Rank 1 is stuck for ``seconds`` (longer than the group's timeout) before a collective that
    rank 0 is already waiting in."""
    import time

    if world.rank == 1:
        time.sleep(seconds)
    world.all_gather(world.rank)
