"""Sharded training (``training.parallel: fsdp``) on torch.distributed's FSDP2 (docs/distributed.md,
"Sharded training").

Each of the W ranks holds 1/W of every parameter (rows along dim 0, as ``torch.chunk`` cuts
them), of its gradient and of the optimizer's state. FSDP2 (``fully_shard``) gathers a
block's whole weights for its forward and its backward and frees them after. The private
step stays the data-parallel one, with its sum and its noise changed:

- each rank runs the book-keeping on its own examples. A layer's backward sees the layer's
  whole weight and its examples' whole activations, so each example's norms are complete on
  the rank that holds it: nothing about norms crosses ranks (a pipeline's stages, which each
  hold only part of a model, must sum them; :mod:`dpclip.distributed.pipeline`);
- the clipped sums (whole parameters, this rank's examples) are reduce-scattered: rank r gets
  Σ over ranks of rows r of each parameter (:meth:`ShardReducer.sum_shards`);
- every rank adds the noise of its own rows, from its own stream (``noise_stream``), so each
  coordinate of the whole gradient gets N(0, σ²S²) exactly once, and no two coordinates share
  a draw;
- threshold statistics (histogram, quantile counts) are summed with their noise drawn on rank
  0 alone, as in data-parallel training (:class:`~dpclip.distributed.world.SumReducer`).

Every forward and backward of a sharded block is a collective, so the ranks run the same
number of them in the same order: a step runs as many micro-batches on every rank as the
busiest rank needs, padded with rows whose loss weight is 0 (:func:`lockstep_micro_batches`).

:class:`Shards` holds what the run needs around the step: the blocks it sharded, a meta-device
skeleton of the whole model on rank 0, :meth:`Shards.whole` (rank 0's whole weights, gathered
for a checkpoint), :meth:`Shards.loading` (rank 0's weights handed out as shards) and the
optimizer's whole state likewise (:meth:`Shards.optimizer_state`, :meth:`Shards.load_optimizer_state`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dpclip.distributed.world import SumReducer, World, run_collective
from dpclip.errors import DpclipError

# Elements of whole gradients sent in one reduce-scatter (64 MiB in float32): a step holds the
# whole sums not yet sent, one bucket and the shards, not every whole sum beside a copy of it.
BUCKET_ELEMENTS = 1 << 24
FSDP_HINT = "use training.parallel: data (each rank holds the whole model), or docs/distributed.md, 'Sharded training'"


def _reduce_scatter(out: Tensor, flat: Tensor) -> None:
    single = getattr(dist, "reduce_scatter_single", None)  # the newer name of reduce_scatter_tensor
    run_collective(single if single is not None else dist.reduce_scatter_tensor, out, flat)


def shard_rows(rows: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of the rows of a dim-0 size ``rows`` that rank ``rank`` of ``size`` holds:
    ``torch.chunk``'s cut (chunks of ceil(rows / size); the last ranks' may be short or empty),
    which is FSDP2's ``Shard(0)``."""
    chunk = -(-rows // size) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


class ShardReducer(SumReducer):
    """The engine's reducer on a sharded model (module doc): sums of statistics and counts as in
    data-parallel training, and the clipped sums reduce-scattered to each rank's rows."""

    shards = True

    def __init__(self, world: World, bucket_elements: int = BUCKET_ELEMENTS):
        super().__init__(world)
        self.bucket_elements = bucket_elements
        self.peak_bytes = 0
        # Each rank's noise stream is its own, seeded or not (identical streams would put the
        # same draw on rows of different ranks, which their difference would cancel).
        self.noise_stream = f"rank-{world.rank}-of-{world.size}"

    def _rows(self, param: Tensor) -> tuple[int, int]:
        rows = param.shape[0] if param.dim() else 1
        start, stop = shard_rows(rows, self.rank, self.size)
        local = param.to_local() if hasattr(param, "to_local") else None
        if local is not None and local.dim() and local.shape[0] != stop - start:
            raise DpclipError(f"a sharded parameter of shape {tuple(param.shape)} holds {local.shape[0]} rows on rank "
                              f"{self.rank}, not the {stop - start} of an even dim-0 cut", FSDP_HINT)
        return start, stop

    def shard_start(self, param: Tensor) -> int:
        return self._rows(param)[0]

    def sum_shards(self, grads: list[Tensor | None], params: list[Tensor]) -> list[Tensor]:
        """Per parameter, this rank's rows of Σ over ranks of ``grads`` (whole parameters).

        Reduce-scatters in buckets of at most ``bucket_elements`` (parameters in index order,
        one dtype and device a bucket; each rank's rows padded to the longest rank's, so that
        the parts are equal). Each whole gradient is dropped from ``grads`` once it is copied
        into its bucket, so that the step holds the whole sums not yet sent, one bucket and the
        shards received (``peak_bytes``: the most of these at once since the reducer was made, for
        the benchmark); the
        caller must hold no other reference to them."""
        for p in params:
            self._rows(p)  # refuses a parameter FSDP cut otherwise
        out: list[Tensor | None] = [None] * len(grads)
        bucket: list[int] = []
        for i, g in enumerate(grads):
            if bucket and ((g.dtype, g.device) != (grads[bucket[0]].dtype, grads[bucket[0]].device)
                           or sum(grads[j].numel() for j in bucket) + g.numel() > self.bucket_elements):
                self._scatter_bucket(bucket, grads, out)
                bucket = []
            bucket.append(i)
        if bucket:
            self._scatter_bucket(bucket, grads, out)
        return out  # type: ignore[return-value]

    def _scatter_bucket(self, members: list[int], grads: list[Tensor | None], out: list[Tensor | None]) -> None:
        first = grads[members[0]]
        dtype, device = first.dtype, first.device
        shapes = [grads[i].shape for i in members]
        cuts = [[shard_rows(shape[0] if len(shape) else 1, r, self.size) for shape in shapes]
                for r in range(self.size)]
        rows_numel = [math.prod(shape[1:]) if len(shape) else 1 for shape in shapes]
        part = max(sum((stop - start) * n for (start, stop), n in zip(cut, rows_numel)) for cut in cuts)
        flat = torch.zeros(self.size * part, dtype=dtype, device=device)
        self._note_held(grads, out, flat)
        offsets = [r * part for r in range(self.size)]  # where rank r's rows of the next parameter go
        for position, i in enumerate(members):
            whole, n = grads[i].reshape(-1), rows_numel[position]
            for r in range(self.size):
                start, stop = cuts[r][position]
                flat[offsets[r]:offsets[r] + (stop - start) * n] = whole[start * n:stop * n]
                offsets[r] += (stop - start) * n
            grads[i] = None   # copied into the bucket: the whole sum is not held any longer
            del whole
        mine = torch.empty(part, dtype=dtype, device=device)
        self._note_held(grads, out, flat, mine)
        _reduce_scatter(mine, flat)
        offset = 0
        for position, i in enumerate(members):
            start, stop = cuts[self.rank][position]
            count = (stop - start) * rows_numel[position]
            out[i] = mine[offset:offset + count].view((stop - start, *shapes[position][1:]) if len(shapes[position])
                                                       else shapes[position])
            offset += count

    def _note_held(self, grads: list[Tensor | None], out: list[Tensor | None], *buffers: Tensor) -> None:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*grads, *out, *buffers] if t is not None}
        self.peak_bytes = max(self.peak_bytes, sum(storages.values()))

    def as_grad(self, local: Tensor, param: Tensor) -> Tensor:
        """This rank's rows as the sharded parameter's gradient (a DTensor like the parameter)."""
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own (gathered one at a time): a transformers
    model's ``_no_split_modules`` classes, else the elements of every ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if found:
            return found
    return [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]


def tied_names(model: nn.Module) -> dict[str, str]:
    """alias -> the first name of the same Parameter, for every parameter shared by two names."""
    first: dict[int, str] = {}
    ties = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
    return ties


def retie(model: nn.Module, ties: dict[str, str]) -> nn.Module:
    """``model`` with each alias set to its first name's Parameter again (in place)."""
    for alias, name in ties.items():
        owner, _, attribute = alias.rpartition(".")
        setattr(model.get_submodule(owner), attribute, model.get_parameter(name))
    return model


class Shards:
    """A model sharded over ``world`` (module doc), in two steps around the engine:

    1. ``Shards(model, world)``, before the engine: rank 0 keeps a meta-device copy of the
       whole model (its structure, for checkpoints);
    2. the engine is built on the whole model with a :class:`ShardReducer`, which the certificate
       checks on a few training rows (:meth:`DPEngine.certify`; it probes the batch axes too);
    3. :meth:`shard` cuts the model (FSDP2's ``fully_shard``: each block, then the root), and
       the engine adopts the shards (:meth:`DPEngine.adopt_parameters`);
    4. the optimizer is built on the shards, so its state is sharded too.
    """

    def __init__(self, model: nn.Module, world: World):
        if world.size < 2:
            raise DpclipError("training.parallel: fsdp shards a model over processes, and this is one process",
                              "start several: dpclip train RECIPE --nproc N (or use training.parallel: data)")
        self.world = world
        self.model = model
        self.skeleton = copy.deepcopy(model).to("meta") if world.main else None
        # to_empty gives every parameter its own storage, which unties tied weights (a GPT-2's
        # lm_head and wte): the whole model re-ties them, so its checkpoint is one process's.
        self.ties = tied_names(model)
        self.blocks: list[nn.Module] = []

    def shard(self, engine=None) -> None:
        from torch.distributed.fsdp import fully_shard
        self.blocks = blocks_of(self.model)
        for block in self.blocks:
            fully_shard(block)
        fully_shard(self.model)
        if engine is not None:
            engine.adopt_parameters("a sharded model's ranks cannot probe alone (docs/distributed.md, "
                                    "'Sharded training')")

    def reshard(self) -> None:
        """Put every block back to its shards. A forward without a backward (an evaluation)
        leaves the root gathered, and the optimizer and the engine hold the shards."""
        from torch.distributed.fsdp import FSDPModule
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @contextmanager
    def whole(self) -> Iterator[nn.Module | None]:
        """Rank 0: the whole model with the current weights (gathered from every rank, a
        collective: every rank enters); other ranks: None. The weights are freed after."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        self.reshard()
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.world.main:
            yield None
            return
        whole = retie(self.skeleton.to_empty(device="cpu"), self.ties)
        try:
            whole.load_state_dict(state, strict=True)
            yield whole
        finally:
            self.skeleton = whole.to("meta")

    @contextmanager
    def loading(self) -> Iterator[nn.Module | None]:
        """Rank 0: an empty whole model to load weights into (a checkpoint's); on leaving, every
        rank takes its shards of them (a collective: every rank enters)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        whole = retie(self.skeleton.to_empty(device="cpu"), self.ties) if self.world.main else None
        try:
            yield whole
            state = whole.state_dict() if whole is not None else {}
            set_model_state_dict(self.model, state,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        finally:
            if whole is not None:
                self.skeleton = whole.to("meta")

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The optimizer's whole state on rank 0 (parameters named, not numbered); None elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        self.reshard()
        state = get_optimizer_state_dict(self.model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.world.main else None

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict | None) -> None:
        """Rank 0's whole optimizer state (from :meth:`optimizer_state`) as every rank's shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        tensors = self.world.broadcast(self.world.main and any(
            isinstance(v, Tensor) and v.dim() > 0 for entry in state["state"].values() for v in entry.values()))
        if not tensors:  # no state per parameter (SGD without momentum, or no step yet): the groups alone,
            # which torch's sharded loader cannot place (it takes the device from the state's tensors)
            groups = self.world.broadcast(state["param_groups"] if self.world.main else None)
            order = [id(p) for group in optimizer.param_groups for p in group["params"]]
            position = {name: order.index(id(p)) for name, p in self.model.named_parameters() if id(p) in order}
            optimizer.load_state_dict({"state": {}, "param_groups": [
                {**group, "params": [position[name] for name in group["params"]]} for group in groups]})
            return
        set_optimizer_state_dict(self.model, optimizer, state if self.world.main else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def lockstep_micro_batches(world: World, count: int) -> int:
    """The number of micro-batches every rank runs this step: the most any rank needs, and at
    least one (module doc)."""
    value = torch.tensor([float(max(count, 1))])
    run_collective(dist.all_reduce, value, op=dist.ReduceOp.MAX)
    return int(value.item())
