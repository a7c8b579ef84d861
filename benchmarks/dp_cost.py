"""What does a private step cost? dpclip's groupings and Opacus against non-private training.

Step = forward, loss, backward(s), clipping, noise, SGD step. Methods:

    non-private       mean loss, loss.backward(), SGD step
    dpclip <grouping> per-sample losses, engine.backward, engine.privatize, SGD step
                      (grouping all-layer, layer, param; norm_method auto)
    opacus hooks      PrivacyEngine.make_private(grad_sample_mode="hooks"): per-sample grads
    opacus ghost      PrivacyEngine.make_private(grad_sample_mode="ghost"): ghost clipping
                      (two backwards, through Opacus' DPLossFastGradientClipping criterion)

Workloads: gpt2 (docs/performance.md: 4 layers, n_embd 256, vocab 1024, T 128, B 16; position ids
passed to every method, as Opacus needs them), cnn (the digits CNN of recipes/cnn-*.yaml on
1x8x8 images, B 64), mlp (128 -> 512 -> 512 -> 10, B 1024), and gpt2-small (the 124M GPT-2
small configuration: 12 layers, n_embd 768, 12 heads, vocab 50257, 1024 positions, tied
embeddings, random init) at each (B, T) of its ``shapes``, (4, 256) and (2, 1024). A
gpt2-small step takes seconds, so it is not in the default workloads and has its own,
smaller round counts (``--gpt2-small-repeats`` and the options next to it).

Timing: all methods of a workload are built in one process and timed interleaved
(A B C ... A B C ...), medians reported, ratio to non-private. Memory (``--memory``): each
configuration runs alone in a fresh child process; the figure is how far the child's peak
resident set (VmHWM, reset after setup) rises during the steps above its resident set after
setup (model, optimizer, batch and DP wrappers built): the memory the training steps need
(activations, gradients, per-sample quantities), imports and weights excluded.
Scaling (``--scaling``): GPT-2 ratio for a grid of T and B, with the norm method (ghost or
instantiate) the engine's mixed rule picks for each layer shape at each T.

    python benchmarks/dp_cost.py                      # timing table, all workloads
    python benchmarks/dp_cost.py --memory --scaling   # + memory and the GPT-2 scaling table
    python benchmarks/dp_cost.py --markdown           # tables as markdown (docs/performance.md)
    python benchmarks/dp_cost.py --smoke              # tiny sizes, 1 repeat (CI)
    python benchmarks/dp_cost.py --workloads gpt2-small --memory   # about 25 minutes, quiet machine
    python benchmarks/dp_cost.py --workloads gpt2-small --gpt2-small-shapes 2x1024 \
        --gpt2-small-repeats 7 --methods non-private "dpclip all-layer" "dpclip layer"

Opacus is a benchmark extra (``pip install opacus``); without it the Opacus rows are
skipped and the script says so.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import platform
import resource
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import warnings

import torch
import torch.nn.functional as F
from torch import nn

# Opacus' hooks fire on modules whose inputs need no grad (embeddings, the first layer).
warnings.filterwarnings("ignore", message="Full backward hook is firing")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from engine_step_ratio import build_model as build_gpt2  # noqa: E402

from dpclip.bench import round_ratios, status_kib, time_rounds  # noqa: E402  (one timing and memory probe for both)
from dpclip.allocator import keep_freed_memory  # noqa: E402

GROUPINGS = ("all-layer", "layer", "param")
METHODS = ("non-private",) + tuple(f"dpclip {g}" for g in GROUPINGS) + ("opacus hooks", "opacus ghost")
WORKLOADS = ("gpt2", "cnn", "mlp", "gpt2-small")
DEFAULT_WORKLOADS = ("gpt2", "cnn", "mlp")
FULL = {
    "gpt2": dict(layers=4, embd=256, vocab=1024, seq=128, batch=16),
    "cnn": dict(batch=64),
    "mlp": dict(features=128, hidden=512, batch=1024),
    # transformers' GPT2Config() defaults: the 124M GPT-2 small
    "gpt2-small": dict(layers=12, embd=768, heads=12, vocab=50257, positions=1024,
                       shapes=[[4, 256], [2, 1024]]),
}
SMOKE = {
    "gpt2": dict(layers=1, embd=32, vocab=64, seq=16, batch=4),
    "cnn": dict(batch=8),
    "mlp": dict(features=16, hidden=32, batch=32),
    "gpt2-small": dict(layers=2, embd=64, heads=2, vocab=500, positions=64, shapes=[[2, 16], [1, 64]]),
}


def instances(name: str, sizes: dict) -> list[tuple[str, dict]]:
    """(result key, sizes) of each configuration a workload runs: one per (B, T) of its
    ``shapes`` ("gpt2-small 4x256"), else the workload itself."""
    if "shapes" not in sizes:
        return [(name, sizes)]
    base = {k: v for k, v in sizes.items() if k != "shapes"}
    return [(f"{name} {b}x{t}", dict(base, batch=b, seq=t)) for b, t in sizes["shapes"]]


def parse_shape(text: str) -> list[int]:
    """"2x1024" -> [2, 1024] (batch, sequence length)."""
    try:
        batch, seq = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: shape {text!r} is not BxT (for example 2x1024)") from None
    return [batch, seq]


def map_large_blocks() -> bool:
    """glibc: blocks of 1 MiB or more are mmapped and unmapped when freed, and the heap
    is trimmed eagerly, so the resident set follows the live tensors (``--allocator
    map-large``: step memory without heap growth). True if glibc accepted it."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return mallopt(-3, 1 << 20) == 1 and mallopt(-1, 0) == 1   # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def opacus_available() -> bool:
    return importlib.util.find_spec("opacus") is not None


# ---------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """A model and one fixed batch, seen three ways: per-sample losses (dpclip), the logits
    and flat targets a criterion takes (Opacus ghost), and the shape that criterion needs
    to turn per-token losses into per-sample ones."""

    model: nn.Module
    inputs: dict
    forward: Callable[[nn.Module, dict], torch.Tensor]  # -> logits [N, C]
    targets: torch.Tensor  # [N]
    token_shape: tuple[int, int] | None  # (B, T') when N = B * T', else None
    batch: int

    def per_sample_loss(self, model: nn.Module) -> torch.Tensor:
        tok = F.cross_entropy(self.forward(model, self.inputs), self.targets, reduction="none")
        return tok.view(self.token_shape).mean(1) if self.token_shape else tok


def resolve(key: str, smoke: bool = False) -> tuple[str, dict]:
    """(workload name, sizes) of a configuration key: a workload ("gpt2"; for one with
    shapes, its first) or one of :func:`instances`' keys ("gpt2-small 2x1024")."""
    name = key.split(" ", 1)[0]
    table = SMOKE if smoke else FULL
    if name not in table:
        raise ValueError(f"unknown workload {key!r}")
    found = dict(instances(name, table[name]))
    return name, found.get(key, next(iter(found.values())))


def make_workload(name: str, sizes: dict) -> Workload:
    gen = torch.Generator().manual_seed(0)
    b = sizes["batch"]
    if name in ("gpt2", "gpt2-small"):
        if name == "gpt2":
            model = build_gpt2(sizes["layers"], sizes["embd"], sizes["vocab"], sizes["seq"], "cpu")
        else:
            model = build_gpt2_small(sizes)
        ids = torch.randint(0, sizes["vocab"], (b, sizes["seq"]), generator=gen)
        pos = torch.arange(sizes["seq"]).expand(b, -1).contiguous()

        def forward(m, x):
            logits = m(input_ids=x["ids"], position_ids=x["pos"], use_cache=False).logits
            return logits[:, :-1].reshape(-1, logits.shape[-1])

        return Workload(model, {"ids": ids, "pos": pos}, forward, ids[:, 1:].reshape(-1),
                        (b, sizes["seq"] - 1), b)
    torch.manual_seed(0)
    if name == "cnn":  # recipes/cnn-*.yaml: channels [16, 32], kernel 3, 4 groups, hidden 64
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        x = torch.randn(b, 1, 8, 8, generator=gen)
    elif name == "mlp":
        h = sizes["hidden"]
        model = nn.Sequential(nn.Linear(sizes["features"], h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                              nn.Linear(h, 10))
        x = torch.randn(b, sizes["features"], generator=gen)
    else:
        raise ValueError(f"unknown workload {name!r}")
    y = torch.randint(0, 10, (b,), generator=gen)
    return Workload(model, {"x": x}, lambda m, inp: m(inp["x"]), y, None, b)


def build_gpt2_small(sizes: dict) -> nn.Module:
    """GPT2LMHeadModel of ``sizes`` (layers, embd, heads, vocab, positions), random init,
    lm_head tied to wte (transformers' default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=sizes["layers"], n_embd=sizes["embd"], n_head=sizes["heads"],
                     vocab_size=sizes["vocab"], n_positions=sizes["positions"],
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


# ------------------------------------------------------------------------------ steps


def make_step(method: str, w: Workload) -> Callable[[], None]:
    """A closure running one training step of ``method`` on its own copy of the model
    (:data:`NOISE_DRAW`: the noise draw alone, no copy)."""
    if method == NOISE_DRAW:
        return noise_draw_step(w.model)
    if method == FLAT_NOISE_DRAW:
        return flat_noise_draw_step(w.model)
    model = copy.deepcopy(w.model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    if method.endswith(COMPILED):
        return _compiled_step(method.removesuffix(COMPILED), w, model, opt)
    if method == "non-private":
        def step():
            w.per_sample_loss(model).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    if method.startswith("dpclip "):
        from dpclip.engine import DPEngine

        engine = DPEngine(model, {"grouping": method.split(" ", 1)[1]}, gradient_noise_multiplier=1.0,
                          expected_batch_size=w.batch, seed=0)

        def step():
            engine.backward(w.per_sample_loss(model))
            engine.privatize()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step.engine = engine  # the memory child reads its stash meter
        return step
    if method.startswith("opacus "):
        return _opacus_step(method.split(" ", 1)[1], w, model, opt)
    raise ValueError(f"unknown method {method!r}")


# The same steps compiled: the non-private one with its model under torch.compile, the private
# one as training.compile runs it (dpclip.engine.compiled; on a GPU also a CUDA graph). Their
# first call compiles: the warm-up's.
COMPILED = " compiled"


def _compiled_step(method: str, w: Workload, model: nn.Module, opt) -> Callable[[], None]:
    if method == "non-private":   # compiled the same way: on a GPU, CUDA graphs too
        on_gpu = next(model.parameters()).device.type == "cuda"
        compiled_model = torch.compile(model, mode="reduce-overhead" if on_gpu else None)

        def step():
            w.per_sample_loss(compiled_model).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    from dpclip.engine import DPEngine
    from dpclip.engine.compiled import CompiledMicroBatch

    engine = DPEngine(model, {"grouping": method.split(" ", 1)[1]}, gradient_noise_multiplier=1.0,
                      expected_batch_size=w.batch, seed=0)
    rows = {**w.inputs, "targets": w.targets.reshape(w.batch, -1)}

    def per_sample_loss(m: nn.Module, batch: dict) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "targets"}
        tok = F.cross_entropy(w.forward(m, inputs), batch["targets"].reshape(-1), reduction="none")
        return tok.view(w.batch, -1).mean(1)
    compiled = CompiledMicroBatch(engine, model, per_sample_loss)

    def step():
        compiled(rows, w.batch)
        engine.privatize()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.engine = engine
    return step


# Not training methods: one Gaussian per parameter, as the engine draws it each step, and
# as one normal_ call over a flat parameter-sized buffer draws it (no add: a lower bound).
NOISE_DRAW = "noise draw"
FLAT_NOISE_DRAW = "noise draw, flat"


def flat_noise_draw_step(model: nn.Module) -> Callable[[], None]:
    """One ``normal_`` over a buffer of all trainable parameters' size: the fewest launches
    a GPU can draw them in (on a CPU, one core draws it: the engine's split draw is faster)."""
    params = [p for p in model.parameters() if p.requires_grad]
    buffer = torch.empty(sum(p.numel() for p in params), device=params[0].device)
    generator = torch.Generator(device=buffer.device).manual_seed(0)

    def step():
        buffer.normal_(generator=generator)
    step.buffers = [buffer]
    return step


def noise_draw_step(model: nn.Module) -> Callable[[], None]:
    """The noise of a private step alone: ``NoiseSource.add_gaussians`` (the engine's own
    draw, split over threads on CPU) into one gradient-sized buffer per parameter. The
    work a private step must add that no flop count holds (benchmarks/floor_gap.py)."""
    from dpclip.engine.noise import NoiseSource

    source = NoiseSource(seed=0)
    buffers = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    stds = [1.0] * len(buffers)

    def step():
        source.add_gaussians(buffers, stds)
    step.buffers = buffers
    return step


def untie_output_embedding(model: nn.Module) -> bool:
    """Give a tied output head its own copy of the weight; True if it was tied.

    Opacus ghost clipping refuses tied parameters (NotImplementedError), so it runs on
    an untied GPT-2: same arithmetic per layer, one more V x d parameter."""
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if get_out else None
    if head is None or head.weight is not model.get_input_embeddings().weight:
        return False
    head.weight = nn.Parameter(head.weight.detach().clone())
    return True


def _opacus_step(mode: str, w: Workload, model: nn.Module, opt) -> Callable[[], None]:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    if mode == "ghost" and untie_output_embedding(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    # make_private wants a data loader; one of B dummy rows gives expected batch size B.
    loader = DataLoader(TensorDataset(torch.zeros(w.batch, 1)), batch_size=w.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
            grad_sample_mode=mode)
    if mode == "ghost":
        module, dp_opt, criterion, _ = made

        def step():
            loss = criterion(w.forward(module, w.inputs), w.targets, shape=w.token_shape)
            loss.backward()  # both ghost-clipping backwards
            dp_opt.step()
            dp_opt.zero_grad(set_to_none=True)
        return step
    module, dp_opt, _ = made

    def step():
        w.per_sample_loss(module).mean().backward()
        dp_opt.step()
        dp_opt.zero_grad(set_to_none=True)
    return step


def time_methods(w: Workload, methods: list[str], repeats: int, warmup: int) -> dict:
    """Methods interleaved A B C A B C ... after warm-up: median seconds per step, and the
    ratio to non-private as the median over rounds of the same-round ratio, with its
    quartiles (how much the ratio moved from round to round)."""
    faults: dict[str, list[int]] = {m: [] for m in methods}

    def counted(method: str, step: Callable[[], None]) -> Callable[[], None]:
        def run():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step()
            faults[method].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return run

    times = time_rounds({m: counted(m, make_step(m, w)) for m in methods}, repeats, warmup)
    ratios = round_ratios(times, "non-private")
    out = {"median_s": {m: statistics.median(ts) for m, ts in times.items()},
           "ratio": {m: r[0] for m, r in ratios.items()},
           "ratio_quartiles": {m: [r[1], r[2]] for m, r in ratios.items()},
           "page_faults": {m: statistics.median(f[warmup:]) for m, f in faults.items()}}
    if "opacus hooks" in times:
        out["ratio_to_opacus_hooks"] = {m: r[0] for m, r in round_ratios(times, "opacus hooks").items()}
    if "opacus ghost" in times:
        out["ratio_to_opacus_ghost"] = {m: r[0] for m, r in round_ratios(times, "opacus ghost").items()}
    return out


# ----------------------------------------------------------------------------- memory


def child_memory(workload: str, method: str, sizes: dict, steps: int, threads: int) -> dict:
    """Run in a fresh process: build everything, reset the peak-RSS mark, run ``steps``
    steps, and report how far the peak rose above the resident set at the reset.

    ``ru_maxrss`` cannot be used here: Linux carries it over from the parent across
    fork/exec. ``VmHWM`` belongs to the new address space, and writing 5 to
    ``/proc/self/clear_refs`` resets it to the current RSS (Linux >= 4.0); where that
    is refused, the peak counts from process start and setup is subtracted as VmRSS.
    """
    torch.set_num_threads(threads)
    w = make_workload(workload, sizes)
    step = make_step(method, w)
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    before = status_kib("VmRSS")
    for _ in range(steps):
        step()
    peak = status_kib("VmHWM")
    engine = getattr(step, "engine", None)
    return {"setup_kib": before, "peak_kib": peak, "peak_reset": reset,
            "step_mib": (peak - before) / 1024,
            "stash_peak_mib": engine.stash_bytes_peak / 2**20 if engine is not None else None}


def measure_memory(workload: str, method: str, sizes: dict, steps: int, threads: int,
                   allocator: str = "keep-freed", runs: int = 1) -> dict:
    """Median over ``runs`` fresh children of the step memory (MiB; it moves by about
    ±15 MiB from child to child on the GPT-2), and the engine's stash peak (exact, MiB;
    None for non-dpclip methods)."""
    spec = json.dumps({"workload": workload, "method": method, "sizes": sizes, "steps": steps,
                       "threads": threads})
    results = [run_child("--child", spec, allocator, f"memory child for {workload} / {method}")
               for _ in range(runs)]
    return {"step_mib": statistics.median(r["step_mib"] for r in results),
            "stash_peak_mib": results[0]["stash_peak_mib"]}


def time_in_child(workload: str, sizes: dict, methods: list[str], repeats: int, warmup: int,
                  threads: int, allocator: str) -> dict:
    """:func:`time_methods` in a fresh child process, so that the heap it keeps dies with it."""
    spec = json.dumps({"workload": workload, "sizes": sizes, "methods": methods,
                       "repeats": repeats, "warmup": warmup, "threads": threads})
    return run_child("--time-child", spec, allocator,
                     f"timing child for {workload} {sizes.get('batch')}x{sizes.get('seq')}")


def run_child(flag: str, spec: str, allocator: str, what: str) -> dict:
    """This script in a fresh process with ``flag spec``; its last stdout line, as JSON."""
    out = subprocess.run([sys.executable, __file__, "--allocator", allocator, flag, spec],
                         capture_output=True, text=True)
    if out.returncode != 0:  # say why (a child killed for memory has no traceback)
        raise RuntimeError(f"{what} exited with {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_timing(workload: str, sizes: dict, methods: list[str], repeats: int, warmup: int,
                 threads: int) -> dict:
    torch.set_num_threads(threads)
    result = time_methods(make_workload(workload, sizes), methods, repeats, warmup)
    result["timing_process_peak_mib"] = status_kib("VmHWM") / 1024
    return result


# ---------------------------------------------------------------------------- scaling


def gpt2_norm_methods(embd: int, vocab: int, seq: int) -> dict[str, str]:
    """The norm method the engine's mixed rule (``dpclip.engine.factors.choose_ghost``) picks
    for each GPT-2 layer at sequence length ``seq``, as "all-layer / layer-wise": all-layer
    keeps every layer until the end of the backward (memory rule, instantiate iff G_i is no
    larger than its factors, m·n ≤ T(m+n));
    layer-wise clips each layer at once (time rule, instantiate iff m·n ≤ 2T(m+n)), except
    the tied wte/lm_head, whose two modules make it wait. The rule is asked with the
    layer's factor shapes (on the meta device, nothing is computed)."""
    from dpclip.engine.factors import Bilinear, choose_ghost

    def dense(m, n):
        return Bilinear(torch.empty(1, 1, seq, m, device="meta"), torch.empty(1, 1, seq, n, device="meta"))

    def ids(v):
        return Bilinear(torch.empty(1, seq, dtype=torch.long, device="meta"),
                        torch.empty(1, 1, seq, embd, device="meta"), vocab=v)

    shapes = {
        f"attn.c_attn {embd}x{3 * embd}": dense(embd, 3 * embd),
        f"attn.c_proj {embd}x{embd}": dense(embd, embd),
        f"mlp.c_fc {embd}x{4 * embd}": dense(embd, 4 * embd),
        f"mlp.c_proj {4 * embd}x{embd}": dense(4 * embd, embd),
        f"wte/lm_head {vocab}x{embd} (tied)": ids(vocab),
        f"wpe Tx{embd}": ids(seq),  # n_positions = T here
    }

    def word(use, transient):
        return "ghost" if choose_ghost(use, "auto", transient) else "instantiate"

    return {name: f"{word(use, False)} / {word(use, 'tied' not in name)}"
            for name, use in shapes.items()}


def scaling(seqs, batches, base: dict, repeats: int, warmup: int,
            max_tokens: int | None = None) -> list[dict]:
    """One row per (T, B) with B·T <= ``max_tokens``: DP / non-private step ratios."""
    rows = []
    for seq in seqs:
        methods = gpt2_norm_methods(base["embd"], base["vocab"], seq)
        for b in batches:
            if max_tokens and b * seq > max_tokens:
                print(f"  scaling T {seq} B {b}: skipped (B·T > {max_tokens})", flush=True)
                continue
            sizes = dict(base, seq=seq, batch=b)
            timed = time_methods(make_workload("gpt2", sizes), ["non-private", "dpclip all-layer",
                                                                 "dpclip layer"], repeats, warmup)
            ref = timed["median_s"]["non-private"]
            rows.append({"T": seq, "B": b, "non_private_s": ref,
                         "all_layer": timed["ratio"]["dpclip all-layer"],
                         "layer": timed["ratio"]["dpclip layer"], "norm_methods": methods})
            print(f"  scaling T {seq} B {b}: non-private {ref:.4f} s, all-layer "
                  f"{rows[-1]['all_layer']:.2f}x, layer {rows[-1]['layer']:.2f}x", flush=True)
    return rows


# ---------------------------------------------------------------------------- report


def describe(name: str, sizes: dict) -> str:
    if name == "gpt2-small":
        return (f"GPT-2 small ({sizes['layers']} layers, n_embd {sizes['embd']}, {sizes['heads']} heads, "
                f"vocab {sizes['vocab']}, tied), B {sizes['batch']}, T {sizes['seq']}")
    if name == "gpt2":
        return (f"GPT-2 {sizes['layers']} layers, n_embd {sizes['embd']}, vocab {sizes['vocab']}, "
                f"T {sizes['seq']}, B {sizes['batch']}")
    if name == "cnn":
        return f"digits CNN (conv 16, 32; GroupNorm; hidden 64) on 1x8x8, B {sizes['batch']}"
    return f"MLP {sizes['features']}-{sizes['hidden']}-{sizes['hidden']}-10, B {sizes['batch']}"


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def render(result: dict, markdown: bool) -> str:
    lines = [f"machine: {result['machine']}; allocator {result.get('allocator', 'glibc-default')}; "
             f"{result['repeats']} interleaved repeats, {result['warmup']} warm-up, median"]
    if result["skipped"]:
        lines.append(f"skipped: {result['skipped']}")
    for name, wl in result["workloads"].items():
        lines.append("")
        lines.append(f"{'### ' if markdown else ''}{wl['description']}")
        notes = [wl["note"]] if wl.get("note") else []
        if wl.get("rounds"):
            notes.append(f"{wl['rounds']['repeats']} interleaved repeats, {wl['rounds']['warmup']} warm-up")
        if wl.get("memory_rounds"):
            mr = wl["memory_rounds"]
            notes.append(f"memory: {mr['runs']} child, {mr['steps']} steps" if mr["runs"] == 1
                         else f"memory: median of {mr['runs']} children, {mr['steps']} steps each")
        if notes:
            lines += ["", "; ".join(notes)] if markdown else ["; ".join(notes)]
        mem = wl.get("memory_mib")
        quart = wl.get("ratio_quartiles", {})
        hooks = wl.get("ratio_to_opacus_hooks")
        if markdown:
            lines.append("")
            head = "| method | median step (s) | ratio to non-private (quartiles) |"
            rule = "|---|---|---|"
            if hooks:
                head += " ratio to Opacus hooks |"
                rule += "---|"
            if mem:
                head += " peak step memory (MiB) | ratio | engine stash peak (MiB) |"
                rule += "---|---|---|"
            lines += [head, rule]
        else:
            lines.append(f"{'method':<18}{'median s':>10}{'ratio':>8}{'quartiles':>13}"
                         + (f"{'/hooks':>8}" if hooks else "")
                         + (f"{'MiB':>10}{'ratio':>8}{'stash':>8}" if mem else ""))
        ref_mem = mem.get("non-private") if mem else None
        for m, t in wl["median_s"].items():
            r = wl["ratio"][m]
            q = quart.get(m)
            q_text = f"{q[0]:.2f}-{q[1]:.2f}" if q else "-"
            extra = [f"{hooks[m]:.2f}"] if hooks else []
            if mem:
                mm = mem.get(m)
                stash = wl.get("stash_peak_mib", {}).get(m)
                extra += [f"{mm:.1f}" if mm is not None else "-",
                          f"{mm / ref_mem:.2f}" if mm is not None and ref_mem else "-",
                          f"{stash:.1f}" if stash is not None else "-"]
            if markdown:
                lines.append("| " + " | ".join([m, f"{t:.4f}", f"{r:.2f}x ({q_text})"] + extra) + " |")
            else:
                widths = ([8] if hooks else []) + ([10, 8, 8] if mem else [])
                lines.append(f"{m:<18}{t:>10.4f}{r:>8.2f}{q_text:>13}"
                             + "".join(f"{e:>{w}}" for e, w in zip(extra, widths)))
        if wl.get("page_faults") and not markdown:
            lines.append("minor page faults per step: " + ", ".join(
                f"{m} {v:.0f}" for m, v in wl["page_faults"].items()))
    if result.get("scaling"):
        rows = result["scaling"]
        lines += ["", f"{'### ' if markdown else ''}GPT-2 scaling: DP step / non-private step "
                  f"(rows T, columns B)"]
        batches = sorted({r["B"] for r in rows})
        seqs = sorted({r["T"] for r in rows})
        cell = {(r["T"], r["B"]): r for r in rows}
        if markdown:
            lines += ["", "| T | " + " | ".join(f"B {b}: all-layer / layer (non-private s)" for b in batches) + " |",
                      "|---|" + "---|" * len(batches)]
        for seq in seqs:
            cells = []
            for b in batches:
                r = cell.get((seq, b))
                cells.append(f"{r['all_layer']:.2f}x / {r['layer']:.2f}x ({r['non_private_s']:.3f} s)"
                             if r else "-")
            lines.append(("| " + " | ".join([str(seq)] + cells) + " |") if markdown
                         else f"T {seq:<5}" + "  ".join(f"B {b}: {c}" for b, c in zip(batches, cells)))
        lines += ["", f"{'### ' if markdown else ''}Norm method per layer, all-layer / layer-wise "
                  "(engine's mixed rule: dpclip.engine.factors.choose_ghost)"]
        by_seq = {r["T"]: r["norm_methods"] for r in rows}
        if markdown:
            lines += ["", "| layer | " + " | ".join(f"T {s}" for s in seqs) + " |", "|---|" + "---|" * len(seqs)]
        for layer in rows[0]["norm_methods"]:
            vals = [by_seq[s][layer] for s in seqs]
            lines.append(("| " + " | ".join([layer] + vals) + " |") if markdown
                         else f"{layer:<34}" + "".join(f"{v:>26}" for v in vals))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory", action="store_true", help="peak step memory, one child process each")
    ap.add_argument("--memory-steps", type=int, default=3)
    ap.add_argument("--memory-runs", type=int, default=3, help="children per configuration (median)")
    ap.add_argument("--gpt2-small-repeats", type=int, default=3,
                    help="rounds for gpt2-small (a step takes seconds)")
    ap.add_argument("--gpt2-small-warmup", type=int, default=1)
    ap.add_argument("--gpt2-small-memory-runs", type=int, default=1)
    ap.add_argument("--gpt2-small-memory-steps", type=int, default=1)
    ap.add_argument("--gpt2-small-shapes", nargs="+", metavar="BxT",
                    help="only these (B, T) of gpt2-small, e.g. 2x1024 (default: all of its shapes)")
    ap.add_argument("--scaling", action="store_true", help="GPT-2 ratio over a T x B grid")
    ap.add_argument("--scaling-seq", nargs="+", type=int, default=[32, 128, 512])
    ap.add_argument("--scaling-batch", nargs="+", type=int, default=[8, 32, 128])
    ap.add_argument("--scaling-repeats", type=int, default=3)
    ap.add_argument("--scaling-max-tokens", type=int, default=16384,
                    help="skip grid cells with B·T above this (time budget); 0: no limit")
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    ap.add_argument("--json", type=Path, help="also write the raw result here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat, no warm-up (CI)")
    ap.add_argument("--allocator", default="keep-freed", choices=["keep-freed", "glibc-default", "map-large"],
                    help="keep-freed (default): glibc keeps freed memory between steps, as the "
                         "dpclip command does (dpclip.allocator); map-large: every block of 1 MiB "
                         "or more is its own mapping, returned when freed, so step memory counts "
                         "live tensors, not heap growth; applies to every method alike")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--time-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    allocator = args.allocator
    if allocator == "keep-freed" and not keep_freed_memory():
        allocator = "glibc-default (keep-freed unavailable here)"
    if allocator == "map-large" and not map_large_blocks():
        allocator = "glibc-default (map-large unavailable here)"
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_memory(**spec)))
        return {}
    if args.time_child:
        print(json.dumps(child_timing(**json.loads(args.time_child))))
        return {}
    torch.set_num_threads(args.threads)
    sizes = SMOKE if args.smoke else FULL
    if args.smoke:
        args.repeats, args.warmup, args.memory_steps, args.scaling_repeats = 1, 0, 1, 1
        args.memory_runs = 1
        args.gpt2_small_repeats, args.gpt2_small_warmup = 1, 0
        args.gpt2_small_memory_runs, args.gpt2_small_memory_steps = 1, 1
        args.scaling_seq, args.scaling_batch = [8, 16], [2]

    methods, skipped = list(args.methods), ""
    if not opacus_available() and any(m.startswith("opacus") for m in methods):
        methods = [m for m in methods if not m.startswith("opacus")]
        skipped = "opacus is not installed (pip install opacus): Opacus rows skipped"
        print(skipped, flush=True)
    if "non-private" not in methods:
        methods.insert(0, "non-private")

    result = {"machine": machine(), "allocator": allocator, "repeats": args.repeats, "warmup": args.warmup,
              "skipped": skipped, "workloads": {}}
    for name in args.workloads:
        big = name == "gpt2-small"
        repeats, warmup = ((args.gpt2_small_repeats, args.gpt2_small_warmup) if big
                           else (args.repeats, args.warmup))
        mem_runs, mem_steps = ((args.gpt2_small_memory_runs, args.gpt2_small_memory_steps) if big
                               else (args.memory_runs, args.memory_steps))
        table = sizes[name]
        if big and args.gpt2_small_shapes:
            table = dict(table, shapes=[parse_shape(text) for text in args.gpt2_small_shapes])
        for key, inst in instances(name, table):
            print(f"timing {key} ...", flush=True)
            if big:
                # A fresh process per shape: with freed memory kept, the timing process keeps
                # its heap at the peak of its largest step (about 17 GB at B 2, T 1024 beside
                # six models), and the memory children below would need as much again.
                timed = time_in_child(name, inst, methods, repeats, warmup, args.threads,
                                      args.allocator)
            else:
                timed = time_methods(make_workload(name, inst), methods, repeats, warmup)
            wl = {"description": describe(name, inst), "workload": name, "sizes": inst, **timed}
            if (repeats, warmup) != (args.repeats, args.warmup):
                wl["rounds"] = {"repeats": repeats, "warmup": warmup}
            if name.startswith("gpt2") and "opacus ghost" in methods:
                wl["note"] = ("opacus ghost runs with lm_head untied: Opacus ghost clipping refuses "
                              "tied parameters")
            if args.memory:
                print(f"memory {key} ...", flush=True)
                mem = {m: measure_memory(name, m, inst, mem_steps, args.threads, args.allocator,
                                         mem_runs) for m in methods}
                wl["memory_mib"] = {m: r["step_mib"] for m, r in mem.items()}
                wl["stash_peak_mib"] = {m: r["stash_peak_mib"] for m, r in mem.items()
                                        if r["stash_peak_mib"] is not None}
                if (mem_runs, mem_steps) != (args.memory_runs, args.memory_steps):
                    wl["memory_rounds"] = {"runs": mem_runs, "steps": mem_steps}
            result["workloads"][key] = wl
    if args.scaling:
        print("scaling gpt2 ...", flush=True)
        result["scaling"] = scaling(args.scaling_seq, args.scaling_batch, sizes["gpt2"],
                                    args.scaling_repeats, min(args.warmup, 1), args.scaling_max_tokens)
    print(render(result, args.markdown))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
