"""What does DP cost on my own model? Step time and step memory, private vs non-private.

For a recipe's model, data and batch size, one fixed batch of the training set is run
through a non-private step (mean loss, backward, SGD step) and a private step per
grouping style (:class:`dpclip.train.step.PrivateStep`, the training loop's own, with SGD),
timed interleaved (A B C A B C ...) in one process; medians are reported with the ratio
to non-private, the median over rounds of (step / non-private step of the same round), so
that a slow stretch of the machine hits both sides of a ratio alike. The clipping function, threshold and noise come from the engine's
defaults: the cost is set by the model, the batch and the grouping, not by those.
Both sides run the recipe's ``training.precision`` (autocast for bf16), and the process is
set up as ``dpclip train`` sets up its own (:func:`dpclip.configure_speed`: the allocator
setting and the thread count); the result reports those settings.

Memory, when asked for, is measured per configuration in a fresh child process
(``python -m dpclip.bench``): how far the peak resident set (VmHWM, reset after setup)
rises during the steps above the resident set after setup, i.e. what the steps need
(activations, gradients, per-sample quantities), imports and weights excluded. Linux only.

A recipe with ``training.device: cuda`` is measured on its GPU (docs/training.md, "Device"):
each timed step is bracketed by ``torch.cuda.synchronize()``, and step memory is the peak
allocated during two steps above what was allocated before them, in this process (the
caching allocator keeps what it frees, but its counts are of live tensors).

The floor (:func:`floor_of`, on by default): the flop floor of exact per-sample clipping
for this model and batch (:mod:`dpclip.floor`) plus the noise draw, timed in the same
rounds; each private ratio is also given over it (docs/performance.md, "The floor").
"""

from __future__ import annotations

import collections
import copy
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dpclip.data import select
from dpclip.engine.compiled import CompiledMicroBatch
from dpclip.engine.precision import Precision
from dpclip.recipe import load_recipe
from dpclip.threads import configure
from dpclip.torch_compat import graph_breaks
from dpclip.train.device import resolve_device
from dpclip.train.parts import TIMING_SIGMA, build_engine, load_model
from dpclip.train.step import PrivateStep, step_precision

GROUPINGS = ("all-layer", "layer", "param")
# What bench prints is measured on the recipe's own training rows, with no noise.
NOT_COVERED = ("not covered by ε: step times, step memory and the floor's flop counts, measured on the "
               "first batch of the training data (they follow its shapes, e.g. its sequence lengths)")
NON_PRIVATE = "non-private"
# A private step whose certificate runs every time (docs/certificate.md): what the
# first step of a run, and each new batch shape, costs on top of a steady step.
CHECKED = ", checked"
# The step compiled (training.compile): the private step's micro-batch as one graph
# (dpclip.engine.compiled), the non-private step's model under torch.compile.
COMPILED = ", compiled"


@dataclass
class BenchResult:
    """Medians in seconds, ratios to non-private, and step memory in MiB (when measured).

    ``settings``: what the process ran with: ``threads`` and ``keep_freed_memory`` (as
    :func:`dpclip.configure_speed` returns them) and the recipe's ``precision``."""

    recipe: str
    batch_size: int
    threads: int
    repeats: int
    median_s: dict[str, float]
    ratio: dict[str, float]
    memory_mib: dict[str, float] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    floor: dict = field(default_factory=dict)
    graph_breaks: dict = field(default_factory=dict)   # of the compiled micro-batch (compiled_graph_breaks)
    ratio_compiled: dict[str, float] = field(default_factory=dict)   # compiled steps over compiled non-private

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "batch_size": self.batch_size, "threads": self.threads,
                "repeats": self.repeats, "median_s": self.median_s, "ratio": self.ratio,
                "memory_mib": self.memory_mib, "settings": self.settings, "floor": self.floor,
                "graph_breaks": self.graph_breaks, "ratio_compiled": self.ratio_compiled,
                "not_covered_by_epsilon": NOT_COVERED}


def method_names(groupings=GROUPINGS) -> list[str]:
    return [NON_PRIVATE] + [f"dp {g}" for g in groupings]


def set_up(recipe):
    """(model, loss_fn, batch, size): the recipe's model (assembled as a run assembles it,
    :func:`dpclip.train.parts.load_model`, on the recipe's device) and its first
    ``batch_size`` training rows (moved there by the loss, as in a run)."""
    data, model, loss_fn = load_model(recipe)
    model.to(resolve_device(recipe.training.device))
    size = min(recipe.training.batch_size, data.num_train)
    return model, loss_fn, select(data.train, torch.arange(size)), size


def make_step(method: str, model, loss_fn, batch, size: int,
              precision: Precision | None = None) -> Callable[[], None]:
    """One training step of ``method`` on its own copy of ``model``: the baseline below, or
    the one private step (:class:`~dpclip.train.step.PrivateStep`) on the whole batch, both
    under ``precision``'s autocast (the baseline with the same loss scale, for float16)."""
    model = copy.deepcopy(model)
    precision = precision or Precision()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4)
    compiled = method.endswith(COMPILED)
    method = method.removesuffix(COMPILED)
    if method == NON_PRIVATE:
        forward = torch.compile(model) if compiled else model

        def step():
            with precision.autocast():
                loss = loss_fn(forward, batch).mean()
            (loss * precision.scale).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    checked = method.endswith(CHECKED)
    engine = build_engine(model, {"grouping": method.removeprefix("dp ").removesuffix(CHECKED)},
                          gradient_noise_multiplier=TIMING_SIGMA, batch_size=size)
    if compiled:   # one micro-batch of the whole batch, as training.compile runs it
        private_step = PrivateStep(model, loss_fn, engine, opt, batch, micro_batch_size=size, precision=precision,
                                   fixed_rows=True, compiled=CompiledMicroBatch(engine, model, loss_fn))
    else:
        private_step = PrivateStep(model, loss_fn, engine, opt, batch, micro_batch_size=None, precision=precision)
    rows = torch.arange(size)

    def dp_step():
        if checked:   # the next micro-batch is checked again, as after a resume
            engine.certificate.reset()
        private_step(rows)
    return dp_step


def compiled_graph_breaks(model, loss_fn, batch, size: int, grouping: str = GROUPINGS[0]) -> dict:
    """:func:`step_graph_breaks` of what ``training.compile`` compiles: one micro-batch of the whole
    batch (:meth:`dpclip.engine.compiled.CompiledMicroBatch.graph_breaks`), after the engine's
    first eager micro-batch (the batch-axis probe and the certificate)."""
    model = copy.deepcopy(model)
    engine = build_engine(model, {"grouping": grouping}, gradient_noise_multiplier=TIMING_SIGMA, batch_size=size)
    engine.backward(loss_fn(model, batch))
    engine.privatize()
    graphs, breaks, found = CompiledMicroBatch(engine, model, loss_fn).graph_breaks(batch, size)
    engine.detach()
    return _grouped_breaks(graphs, breaks, found)


def _grouped_breaks(graphs: int, breaks: int, found: list[tuple[str, str, int]]) -> dict:
    counted = collections.Counter((reason[:90], f"{Path(file).name}:{line}") for reason, file, line in found)
    return {"graphs": graphs, "breaks": breaks,
            "reasons": [(count, reason, where) for (reason, where), count in counted.most_common()]}


def step_graph_breaks(step: Callable[[], None]) -> dict:
    """Where ``torch.compile`` breaks the graph of one call of ``step`` (run once eagerly first, so
    the batch-axis probe and the certificate are not traced): {"graphs", "breaks", "reasons":
    [(count, reason, "file:line")]}, most frequent first. A step compiled whole has one graph
    and no break (benchmarks/README.md, "Graph breaks")."""
    step()
    return _grouped_breaks(*graph_breaks(step))


def time_rounds(steps: dict[str, Callable[[], None]], repeats: int, warmup: int,
                sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds per step, one entry per round, interleaved A B C A B C ... after ``warmup`` rounds.
    ``sync`` waits for queued device work (``torch.cuda.synchronize``) before and after each step."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def round_ratios(times: dict[str, list[float]], reference: str) -> dict[str, tuple[float, float, float]]:
    """Per method: (median, lower quartile, upper quartile) over rounds of its step time
    divided by ``reference``'s step time in the same round."""
    out = {}
    for name, ts in times.items():
        ratios = sorted(t / r for t, r in zip(ts, times[reference]))
        if len(ratios) >= 2:
            q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        else:
            q1 = q3 = ratios[0]
        out[name] = (statistics.median(ratios), q1, q3)
    return out


NOISE_DRAWS = ("noise draw", "noise draw, flat")


def noise_draws(model) -> dict[str, Callable[[], None]]:
    """The noise of a private step alone, two ways: the engine's draw (``NoiseSource``,
    split over threads on a CPU, packed on a GPU) added to gradient-sized buffers, and one
    ``normal_`` over a flat buffer of all parameters (no add: a lower bound). Nothing
    private is drawn for, so neither generator is secret."""
    from dpclip.engine.noise import NoiseSource

    params = [p for p in model.parameters() if p.requires_grad]
    source = NoiseSource()
    buffers = [torch.zeros_like(p) for p in params]
    stds = [1.0] * len(buffers)
    flat = torch.empty(sum(p.numel() for p in params), device=params[0].device)
    generator = torch.Generator(device=flat.device)
    return {NOISE_DRAWS[0]: lambda: source.add_gaussians(buffers, stds),
            NOISE_DRAWS[1]: lambda: flat.normal_(generator=generator)}


def floor_of(model, loss_fn, batch, size: int, times: dict[str, list[float]]) -> dict:
    """The floor beside the measured ratios (docs/performance.md, "The floor"): the flop
    floor of exact per-sample norms and clipped sums (:func:`dpclip.floor.step_floor`), plus
    the noise share, the faster noise draw over the non-private step of the same round; per
    private method, the median over rounds of (its ratio / the floor)."""
    from dpclip.floor import step_floor

    model = copy.deepcopy(model)
    flops = step_floor(model, lambda: loss_fn(model, batch).mean().backward(),
                       lambda: loss_fn(model, batch), size)
    base = times[NON_PRIVATE]
    noise = [min(a, b) / r for a, b, r in zip(times[NOISE_DRAWS[0]], times[NOISE_DRAWS[1]], base)]
    out = {"flop_ratio": flops["ratio"], "nonprivate_flops": flops["nonprivate_flops"],
           "extra_flops": flops["extra_flops"], "unmodelled": flops["unmodelled"],
           "noise_share": statistics.median(noise), "noise_s": {d: statistics.median(times[d]) for d in NOISE_DRAWS}}
    if flops["ratio"] is None:
        return out
    out["floor"] = flops["ratio"] + out["noise_share"]
    out["gap"] = {name: statistics.median(t / r / (flops["ratio"] + share)
                                          for t, r, share in zip(ts, base, noise))
                  for name, ts in times.items() if name not in NOISE_DRAWS and name != NON_PRIVATE
                  and not name.endswith(CHECKED)}
    return out


def status_kib(name: str) -> int:
    """A ``/proc/self/status`` field (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise KeyError(name)


def step_memory_mib(step: Callable[[], None], steps: int = 2) -> float:
    """Peak RSS rise (MiB) over ``steps`` steps in this process; call in a fresh process.

    Writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    """
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    for _ in range(steps):
        step()
    return (status_kib("VmHWM") - before) / 1024


def gpu_step_memory_mib(step: Callable[[], None], steps: int = 2) -> float:
    """Peak allocated on the GPU (MiB) during ``steps`` steps above what was allocated before."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def memory_in_child(recipe_path: Path, overrides: list[str], method: str, threads: int | None) -> float:
    """:func:`step_memory_mib` of ``method`` in a fresh ``python -m dpclip.bench`` process."""
    spec = json.dumps({"recipe": str(recipe_path), "overrides": list(overrides), "method": method,
                       "threads": threads})
    out = subprocess.run([sys.executable, "-m", "dpclip.bench", spec], capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def bench_recipe(recipe_path: Path, overrides: list[str] | None = None, *, groupings=GROUPINGS,
                 repeats: int = 5, warmup: int = 1, threads: int | str | None = "auto",
                 memory: bool = True, floor: bool = True, breaks: bool = False,
                 compiled: bool = False) -> BenchResult:
    """Time (and optionally measure memory of) non-private vs private steps for a recipe,
    and (``floor``) set each private ratio against the floor (:func:`floor_of`).

    ``threads``: as ``dpclip train --threads`` ("auto", a number; None keeps torch's).
    ``breaks``: also where torch.compile breaks the compiled micro-batch (:func:`compiled_graph_breaks`).
    ``compiled``: also the non-private step with its model compiled and the first grouping's private
    step as ``training.compile`` runs it (their first calls, which compile, are the warm-up's)."""
    overrides = list(overrides or [])
    recipe = load_recipe(recipe_path, overrides)
    settings = configure(threads)   # what `dpclip train` sets up (dpclip.configure_speed)
    threads = settings["threads"]
    model, loss_fn, batch, size = set_up(recipe)
    precision = step_precision(recipe, model)
    names = method_names(groupings)
    extra = [names[1] + CHECKED] + ([NON_PRIVATE + COMPILED, names[1] + COMPILED] if compiled else [])
    steps = {name: make_step(name, model, loss_fn, batch, size, precision) for name in names + extra}
    if floor:
        steps.update(noise_draws(model))
    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    times = time_rounds(steps, repeats, warmup, sync=torch.cuda.synchronize if on_gpu else (lambda: None))
    floor_info = floor_of(model, loss_fn, batch, size, times) if floor else {}
    times = {name: ts for name, ts in times.items() if name not in NOISE_DRAWS}
    ratios = round_ratios(times, NON_PRIVATE)
    result = BenchResult(recipe.name, size, threads, repeats,
                         {name: statistics.median(ts) for name, ts in times.items()},
                         {name: r[0] for name, r in ratios.items()},
                         settings={**settings, "precision": precision.name, "device": str(device)},
                         floor=floor_info)
    if compiled:
        both = {name: ts for name, ts in times.items() if name.endswith(COMPILED)}
        result.ratio_compiled = {name: r[0] for name, r in round_ratios(both, NON_PRIVATE + COMPILED).items()}
    if breaks:
        result.graph_breaks = compiled_graph_breaks(model, loss_fn, batch, size, groupings[0])
    if memory and on_gpu:
        result.memory_mib = {name: gpu_step_memory_mib(make_step(name, model, loss_fn, batch, size, precision))
                             for name in names}
    elif memory:
        result.memory_mib = {name: memory_in_child(Path(recipe_path), overrides, name, threads)
                             for name in names}
    return result


def _child(spec: dict) -> float:
    configure(spec["threads"])  # as in the `dpclip` process that asked for this measurement
    recipe = load_recipe(Path(spec["recipe"]), spec["overrides"])
    model, loss_fn, batch, size = set_up(recipe)
    return step_memory_mib(make_step(spec["method"], model, loss_fn, batch, size, step_precision(recipe, model)))


if __name__ == "__main__":
    print(_child(json.loads(sys.argv[1])))
