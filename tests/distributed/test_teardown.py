"""Leaving the world ends the process group's threads, whatever the rank imported inside it.

A gloo thread alive at interpreter exit can take the GIL while Python finalizes, which ends
the process with SIGABRT (the rare abort of rank 1 in test_pipeline.py): see
``dpclip.distributed.world._import_what_would_outlive_the_group``."""

from __future__ import annotations

import sys

import pytest
import torch.multiprocessing as mp

from tests.distributed import workers
from tests.distributed.ranks import free_port


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names in /proc")
def test_no_gloo_thread_outlives_the_world_after_the_pipeline_modules_were_imported_inside_it():
    context = mp.get_context("spawn")
    found = context.SimpleQueue()
    mp.start_processes(workers.gloo_threads_after_the_world, args=(free_port(), found), nprocs=2,
                       start_method="spawn")
    reports = sorted(found.get() for _ in range(2))
    assert [r[0] for r in reports] == [0, 1]
    for rank, imported_before, gloo_threads in reports:
        assert not imported_before, "the test needs torch._dynamo first imported by joined_world"
        assert gloo_threads == [], f"rank {rank} still runs {gloo_threads} after leaving the world"


@pytest.mark.slow   # 4-7 s: the default run keeps under 10 minutes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names in /proc")
def test_no_gloo_thread_outlives_the_world_after_a_sharded_step():
    """DTensor's sharding caches hold the device mesh, and with it the group, past
    destroy_process_group unless joined_world clears them (3 sharded runs in 4 aborted)."""
    from tests.distributed.fsdp_train_case import gloo_threads_after_a_sharded_step

    context = mp.get_context("spawn")
    found = context.SimpleQueue()
    mp.start_processes(gloo_threads_after_a_sharded_step, args=(free_port(), found), nprocs=2, start_method="spawn")
    reports = sorted(found.get() for _ in range(2))
    assert [r[0] for r in reports] == [0, 1]
    for rank, gloo_threads in reports:
        assert gloo_threads == [], f"rank {rank} still runs {gloo_threads} after leaving the world"
