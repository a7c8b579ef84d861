"""Helpers that run code as 2 gloo ranks in spawned processes (one thread each)."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _entry(rank: int, size: int, port: int, fn, args, errors):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from dpclip.distributed import joined_world

    try:
        with joined_world() as world:
            fn(world, *args)
    except BaseException as exc:  # reported to the parent, which asserts on it
        errors.put((rank, type(exc).__name__, str(getattr(exc, "message", exc)), getattr(exc, "hint", None),
                    traceback.format_exc()))


def run_ranks(fn, *args, size: int = 2) -> list[tuple]:
    """Run ``fn(world, *args)`` on ``size`` gloo ranks; returns the errors (rank, type, message, hint, tb)."""
    context = mp.get_context("spawn")
    errors = context.SimpleQueue()
    ranks = mp.start_processes(_entry, args=(size, free_port(), fn, args, errors), nprocs=size, join=False,
                               start_method="spawn")
    for process in ranks.processes:   # every rank runs to its end: none is killed for another's exit
        process.join(timeout=300)
        if process.is_alive():
            process.kill()
            process.join()
    found = []
    while not errors.empty():
        found.append(errors.get())
    for rank, process in enumerate(ranks.processes):
        # a rank reports its error on the queue and exits 0: any other exit is a crash, the
        # teardown abort of tests/distributed/test_teardown.py included
        if process.exitcode != 0:
            raise RuntimeError(f"rank {rank} exited with {process.exitcode}")
    return sorted(found)
