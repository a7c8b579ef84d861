"""Data-parallel DP training across processes on torch.distributed (docs/distributed.md).

- :mod:`~dpclip.distributed.world`: the process group from torchrun's environment, the
  engine's sum over ranks (noise drawn once, by rank 0), object collectives;
- :mod:`~dpclip.distributed.sampler`: Poisson sampling sharded over ranks (still Poisson), and
  shuffled batches split over ranks (rank 0 draws the permutation);
- :mod:`~dpclip.distributed.launch`: ``dpclip train --nproc N`` through torch.distributed's
  launcher, and one clear error when a rank fails.

Pipeline stages with per-device clipping (docs/distributed.md, "Not yet") would live here too.
"""

from dpclip.distributed.launch import (announce_interrupted, announce_run_dir, errors_to_launcher, launch,
                                       rank_threads)
from dpclip.distributed.sampler import ShardedPoissonSampler, ShardedShuffleSampler
from dpclip.distributed.world import PeerStopped, SumReducer, World, joined_world, launched

__all__ = ["World", "SumReducer", "PeerStopped", "joined_world", "launched", "ShardedPoissonSampler",
           "ShardedShuffleSampler", "launch", "announce_run_dir", "announce_interrupted", "rank_threads",
           "errors_to_launcher"]
