"""Sharded training (FSDP2): parameter, gradient and optimizer memory per rank against the whole.

    python benchmarks/fsdp_memory.py                 # writes benchmarks/results/fsdp_memory.txt
    python benchmarks/fsdp_memory.py --print-only
    python benchmarks/fsdp_memory.py --smoke --json FILE   # tiny sizes (tests/benchmarks runs it)

What is measured, on a GPT2LMHeadModel with random weights (tied lm_head), after 2 private
steps (engine.backward, engine.privatize, AdamW step) on a global batch of B rows:

- "whole": one process, a plain DPEngine (no sharding, no process group);
- "N ranks": N gloo processes (one torch thread each), ``Shards(model, world)`` with a
  ``ShardReducer``, each rank running the step on its B/N rows (dpclip/distributed/sharded.py).

On each process it counts the bytes of what the process holds after the last optimizer step
(before ``zero_grad``): the parameters, their ``.grad`` and every tensor in
``optimizer.state``, a DTensor by its local shard (``to_local()``), each parameter once (the
tied lm_head/wte is one parameter). "share" is a rank's bytes over the whole's, printed
beside 1/N and beside the bound the even dim-0 cut allows (``share_bound``): ``torch.chunk``
gives every rank at most ceil(rows/N) of a parameter's rows, so a rank holds at most
cut = Σ ceil(rows/N)·(row bytes) of the parameters, as much of their gradients, twice that of
AdamW's moments, and AdamW's step counts whole (one 0-dim tensor a parameter, on every rank).

Every rank frees its sharded model before leaving the process group (``joined_world`` then
clears DTensor's caches, which would keep the group alive).

Not in those columns, and measured or counted separately:

- "clipped sums": the engine's whole-size clipped sums (``engine.step_accumulator.sums``, this rank's
  examples, every parameter whole) held from the backward until ``privatize`` reduce-scatters
  them: their bytes just before ``privatize``, the largest over the steps. Without sharding
  they become the gradients (divided in place); sharded, they are held beside the shards;
- "held in the reduce-scatter": inside ``privatize``, ``ShardReducer.sum_shards`` sends the
  whole-size gradients (the clipped sums, divided by B in place) in buckets of at most
  ``BUCKET_ELEMENTS``, dropping each whole sum once it is copied into its bucket: it holds the
  whole sums not yet sent, one bucket (every rank's rows, each part padded to the longest) and
  the shards received. The reducer's own ``peak_bytes`` (the distinct storages it holds at
  once, the most over the steps) is the column;
- "largest gathered unit": FSDP2 gathers a unit's whole parameters (a transformer block, or the
  root: embeddings and final norm) for its forward and its backward: the bytes of the largest
  unit's parameters, counted from their shapes, not measured;
- "peak RSS": ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of each process at the end, for
  context only: it includes the Python interpreter, torch and transformers (a few hundred MiB),
  activations, and the gloo buffers; the columns above are the ones the 1/N claim is about.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpclip.files import write_text_atomic  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "fsdp_memory.txt"
# bucket_elements: the reduce-scatter's bucket, smaller than the model here (dpclip's default,
# 2^24 elements, exceeds this whole model) so that the column shows what bucketing holds.
FULL = {"layers": 4, "embd": 256, "heads": 4, "vocab": 2048, "seq": 32, "batch": 8, "steps": 2, "ranks": [2, 4],
        "bucket_elements": 2**18}
# Odd row counts (vocab 101, 9 positions, 3 ranks): the last rank's shards are short, and the test
# checks the shares against the bound of the uneven cut.
SMOKE = {"layers": 2, "embd": 32, "heads": 2, "vocab": 101, "seq": 9, "batch": 4, "steps": 2, "ranks": [2, 3],
         "bucket_elements": 2**10}
CLIPPING = {"threshold": {"kind": "fixed", "value": 1.0}}


def build_model(sizes: dict) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=sizes["layers"], n_embd=sizes["embd"], n_head=sizes["heads"],
                     vocab_size=sizes["vocab"], n_positions=sizes["seq"], bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)  # every rank builds the same weights before they are cut
    return GPT2LMHeadModel(cfg)


def batch_of(sizes: dict) -> torch.Tensor:
    return torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]),
                         generator=torch.Generator().manual_seed(1))


def per_sample_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each row's mean next-token cross-entropy."""
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, :-1]
    tok = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return tok.mean(1)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds of ``t``: a DTensor's local shard, else the tensor."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())  # each parameter once: the tied lm_head is wte
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"parameters": sum(local_bytes(p) for p in params),
            "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(v) for v in state),
            # AdamW's step counts: one 0-dim tensor a parameter, whole on every rank
            "optimizer_scalars": sum(local_bytes(v) for v in state if v.dim() == 0),
            "sharded_parameters": sum(hasattr(p, "to_local") for p in params), "count": len(params)}


def cut_bytes(model: nn.Module, size: int) -> int:
    """The most bytes of the parameters a rank can hold under torch.chunk's dim-0 cut:
    ceil(rows/size) rows of each parameter."""
    cut = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        cut += math.ceil(rows / size) * (p.numel() // max(rows, 1)) * p.element_size()
    return cut


def largest_unit_bytes(model: nn.Module) -> int:
    """Bytes of the largest set of parameters FSDP2 gathers at once: a block's, or the root's
    (every parameter in no block), from the shapes of the model before it is cut."""
    from dpclip.distributed.sharded import blocks_of

    blocks = blocks_of(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    units.append(sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks))
    return max(units)


def sums_bytes(engine) -> int:
    return sum(s.numel() * s.element_size() for s in engine.step_accumulator.sums if s is not None)


def run_steps(model, engine, optimizer, ids: torch.Tensor, steps: int) -> tuple[dict, int]:
    """``steps`` private steps. Returns what the process holds after the last optimizer step
    (before ``zero_grad``, so the gradients count) and the peak bytes of the engine's clipped
    sums just before ``privatize``."""
    peak, held = 0, {}
    for step in range(steps):
        engine.backward(per_sample_loss(model, ids))
        peak = max(peak, sums_bytes(engine))
        engine.privatize()
        optimizer.step()
        if step == steps - 1:
            held = held_bytes(model, optimizer)
        optimizer.zero_grad()
    return held, peak


def measure_whole(sizes: dict, out: str) -> None:
    torch.set_num_threads(1)
    from dpclip.engine import DPEngine

    model = build_model(sizes)
    unit = largest_unit_bytes(model)
    engine = DPEngine(model, CLIPPING, gradient_noise_multiplier=1.0, expected_batch_size=sizes["batch"], seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    held, peak = run_steps(model, engine, optimizer, batch_of(sizes), sizes["steps"])
    Path(out).write_text(json.dumps({**held, "sums_peak": peak, "unit_bytes": unit,
                                     "seconds": time.perf_counter() - started,
                                     "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def _rank(rank: int, size: int, port: int, sizes: dict, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from dpclip.distributed import joined_world
    from dpclip.distributed.sharded import ShardReducer, Shards
    from dpclip.engine import DPEngine

    ids = batch_of(sizes)
    mine = ids.tensor_split(size)[rank]  # B/N rows each (B/N rounded); the global batch is the whole's
    with joined_world() as world:
        model = build_model(sizes)
        cut = cut_bytes(model, size)
        shards = Shards(model, world)
        reducer = ShardReducer(world, **({"bucket_elements": sizes["bucket_elements"]}
                                         if "bucket_elements" in sizes else {}))
        engine = DPEngine(model, CLIPPING, gradient_noise_multiplier=1.0, expected_batch_size=sizes["batch"],
                          seed=0, reducer=reducer)
        engine.certify(lambda: per_sample_loss(model, ids[:4]), before="sharding")
        shards.shard(engine)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after sharding: its state is sharded
        world.any(False)  # the ranks start together
        started = time.perf_counter()
        held, peak = run_steps(model, engine, optimizer, mine, sizes["steps"])
        row = {**held, "sums_peak": peak, "cut_bytes": cut,
               "reduce_scatter_peak": reducer.peak_bytes,
               "seconds": time.perf_counter() - started,
               "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
        rows = world.all_gather(row)
        if world.main:
            Path(out).write_text(json.dumps(rows))
        engine.detach()
        del engine, shards, model, optimizer  # joined_world then frees DTensor's caches before the group goes


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(sizes: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "whole.json")
        child = mp.get_context("spawn").Process(target=measure_whole, args=(sizes, out))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"the whole-model process exited with {child.exitcode}")
        result = {"sizes": sizes, "whole": json.loads(Path(out).read_text()), "sharded": {}}
        for size in sizes["ranks"]:
            out = str(Path(tmp) / f"sharded-{size}.json")
            mp.start_processes(_rank, args=(size, _port(), sizes, out), nprocs=size, join=True,
                               start_method="spawn")
            result["sharded"][str(size)] = json.loads(Path(out).read_text())
    return result


def share_bound(rank: dict, whole: dict) -> float:
    """The largest share of the whole's bytes a rank may hold (module doc): (4·cut + the step
    counts) / the whole's parameters + gradients + optimizer state."""
    return (4 * rank["cut_bytes"] + rank["optimizer_scalars"]) / held(whole)


def held(r: dict) -> int:
    return r["parameters"] + r["gradients"] + r["optimizer"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def render(result: dict) -> str:
    s, whole = result["sizes"], result["whole"]
    lines = [f"GPT2LMHeadModel, {s['layers']} layers, n_embd {s['embd']}, {s['heads']} heads, vocab {s['vocab']}, "
             f"T {s['seq']}, tied lm_head, float32, random weights; global batch B {s['batch']} (B/N rows a rank), "
             f"{s['steps']} private steps (fixed threshold 1, sigma 1) with AdamW; reduce-scatter bucket "
             f"{s.get('bucket_elements', 'default')} elements; gloo, one torch thread a process, "
             f"{os.cpu_count()} cores, torch {torch.__version__}.",
             "Bytes held after the last optimizer step (before zero_grad): parameters, .grad, optimizer.state tensors, "
             "a DTensor by its local shard. share = (rank's params + grads + optimizer) / the whole's.",
             "",
             "| run | rank | parameters MiB | gradients MiB | optimizer MiB | total MiB | share | 1/N | bound | "
             "clipped sums before privatize MiB | held in the reduce-scatter MiB | peak RSS MiB (context) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|",
             f"| whole (1 process, no sharding) | - | {_mib(whole['parameters'])} | {_mib(whole['gradients'])} | "
             f"{_mib(whole['optimizer'])} | {_mib(held(whole))} | 1 | 1 | 1 | {_mib(whole['sums_peak'])} | - | "
             f"{whole['rss_kib'] / 1024:.0f} |"]
    for size, rows in result["sharded"].items():
        for rank, r in enumerate(rows):
            lines.append(f"| {size} ranks | {rank} | {_mib(r['parameters'])} | {_mib(r['gradients'])} | "
                         f"{_mib(r['optimizer'])} | {_mib(held(r))} | {held(r) / held(whole):.5f} | "
                         f"{1 / int(size):.5f} | {share_bound(r, whole):.5f} | {_mib(r['sums_peak'])} | "
                         f"{_mib(r['reduce_scatter_peak'])} | "
                         f"{r['rss_kib'] / 1024:.0f} |")
    lines += ["",
              f"Largest unit FSDP2 gathers whole for its forward and backward (counted from shapes): "
              f"{_mib(whole['unit_bytes'])} MiB.",
              "Step time (2 steps, seconds): whole " + f"{whole['seconds']:.2f}" + "".join(
                  f"; {size} ranks {max(r['seconds'] for r in rows):.2f}" for size, rows in result["sharded"].items())
              + " (for context; 2 cores shared by all ranks)."]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; prints only")
    parser.add_argument("--json", type=Path, help="also write the raw measurement here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = measure(SMOKE if args.smoke else FULL)
    result["wall_seconds"] = time.perf_counter() - started
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(result))
    text = render(result)
    print(text)
    if not (args.print_only or args.smoke):
        header = "# python benchmarks/fsdp_memory.py (docs/performance.md, 'Sharded training: memory per rank')\n"
        write_text_atomic(RESULT, header + text + "\n")
    return result


if __name__ == "__main__":
    main()
