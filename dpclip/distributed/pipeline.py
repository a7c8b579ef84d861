"""Pipeline stages with per-device clipping across processes (docs/distributed.md, "Pipeline stages").

The model (an ``nn.Sequential``) is cut into K consecutive stages, one per rank, at the
modules the recipe's ``clipping.grouping: {stages: [...]}`` names: rank k holds stage k,
its engine and its optimizer. ``torch.distributed.pipelining`` carries the activations
forward and their gradients backward (:class:`~torch.distributed.pipelining.PipelineStage`,
:class:`~torch.distributed.pipelining.ScheduleGPipe`). Per-device clipping (adaptive-per-layer
paper §4 and App. C, Alg. 2): stage k clips the per-sample gradients of its own parameters at
its own C_k during its own backward, so per-sample norms never cross a stage boundary, and
noises its own parameters. The result is the one-process ``stages`` grouping's: K groups,
sensitivity sqrt(Σ C_k²), the same noise std per group (test: tests/distributed/test_pipeline.py).

``flat=True`` is the comparison the paper argues against: one threshold over the whole
pipeline, which needs every stage's per-sample norms² summed over the stages before anyone
can clip (an all-reduce of B floats per micro-batch, and each stage holds its per-sample
quantities until then). ``benchmarks/pipeline_clipping.py`` measures both.

Fixed shapes: a PipelineStage learns its tensors' shapes from the first micro-batch, so every
micro-batch has ``micro_batch_size`` rows; the last one of a Poisson batch is padded with
zero rows of loss weight 0, which the engine drops from its sums, counts and statistics
(``DPEngine.capture(batch, samples=...)``). GPipe runs ``chunks`` micro-batches per round,
each its own forward in flight (``DPEngine.start_forward``), so the stages overlap.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from dpclip.data import micro_batches, select
from dpclip.distributed.world import RESUME_HINT, PeerStopped, World, no_answer, run_collective, timed_out
from dpclip.engine import DPEngine, StepReport, build_groups, trainable_params
from dpclip.engine.spec import ClippingSpec
from dpclip.engine.step_end import StepOutcome, end_private_step
from dpclip.errors import DpclipError

SEQUENTIAL_HINT = ("pipeline stages cut an nn.Sequential model (model.kind mlp or cnn) at top-level modules; "
                   "train other models data-parallel (training.parallel: data)")


def stage_bounds(model: nn.Module, stages: list[str]) -> list[tuple[int, int]]:
    """[first, last) top-level child indices of each stage: stage k starts at the first child
    whose name matches ``stages[k]`` (the first stage at child 0), as the one-process
    ``stages`` grouping starts group k there (:mod:`dpclip.engine.groups`)."""
    if not isinstance(model, nn.Sequential):
        raise DpclipError(f"a pipeline needs an nn.Sequential model, got {type(model).__name__}", SEQUENTIAL_HINT)
    names = [name for name, _ in model.named_children()]
    modules = [name for name, _ in model.named_modules()]
    starts = []
    for pattern in stages:
        found = next((m for m in modules if re.search(pattern, m)), None)
        if found not in names:
            raise DpclipError(f"stage regex {pattern!r} matches {found!r}, not a top-level module of the model "
                              f"({', '.join(names)})", SEQUENTIAL_HINT)
        starts.append(names.index(found))
    starts[0] = 0
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise DpclipError("pipeline stages must start at top-level modules in increasing order",
                          "reorder clipping.grouping.stages")
    return list(zip(starts, starts[1:] + [len(names)]))


def stage_module(model: nn.Sequential, bounds: tuple[int, int]) -> nn.Sequential:
    """Stage ``bounds`` of ``model``: the same child modules (and parameters), not copies."""
    return nn.Sequential(*[model[i] for i in range(*bounds)])


def stage_threshold(threshold: dict, stage: int, num_stages: int) -> dict:
    """The recipe's threshold spec for the one group of stage ``stage``, as the one-process
    ``stages`` grouping gives group k: a fixed float C (the total) becomes C/sqrt(K), a list its
    k-th entry (groupwise paper §2.3, eq. (4)); a quantile policy starts every group at
    ``initial`` and updates each from its own count. Only these two are per group."""
    kind = threshold.get("kind")
    if kind not in ("fixed", "quantile"):
        raise DpclipError(f"threshold kind {kind!r} does not run on pipeline stages yet",
                          "use threshold kind fixed or quantile (the adaptive-per-layer paper's per-stage quantiles)")
    out = dict(threshold)
    if kind == "fixed":
        value = out.get("value", 1.0)
        out["value"] = [value[stage]] if isinstance(value, list) else [float(value) / math.sqrt(num_stages)]
    return out


class StageLinkOverRanks:
    """:class:`dpclip.engine.reducer.StageLink` over torch.distributed (one stage per rank,
    one group per stage). ``sent_bytes`` counts what this rank contributed to collectives."""

    def __init__(self, world: World, *, flat: bool):
        self.world, self.flat = world, flat
        self.num_groups, self.offset = (1, 0) if flat else (world.size, world.rank)
        self.sent_bytes = 0

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world.size)]
        run_collective(dist.all_gather, parts, tensor.detach().contiguous())
        self.sent_bytes += tensor.numel() * tensor.element_size()
        return torch.cat(parts)

    def gather_releases(self, aux: list) -> list:
        if not aux and self.world.size == 1:
            return aux
        parts = self.world.all_gather([tuple(a) for a in aux])
        self.sent_bytes += 24 * len(aux)  # (Δ, σ, name) per release: an estimate of the pickled size
        return [type(aux[0])(*a) if aux else a for part in parts for a in part]

    def sum_norm_sq(self, norm_sq: torch.Tensor) -> torch.Tensor:
        out = norm_sq.detach().clone()
        run_collective(dist.all_reduce, out)
        self.sent_bytes += out.numel() * out.element_size()
        return out


class _EngineStage(PipelineStage):
    """A PipelineStage whose micro-batches are book-kept by its engine: each chunk's forward is
    a generation of its own (several are in flight in a GPipe schedule), each chunk's backward
    runs inside :meth:`~DPEngine.capture` and, per device, is clipped as soon as it is done;
    a flat stage leaves the clipping until the stages have summed the norms (after the step)."""

    def __init__(self, submodule: nn.Module, index: int, count: int, engine: DPEngine, inputs, outputs,
                 flat: bool):
        super().__init__(submodule, index, count, next(submodule.parameters()).device, input_args=inputs,
                         output_args=outputs,
                         output_grads=None if index == count - 1 else torch.zeros_like(outputs),
                         input_grads=None if index == 0 else torch.zeros_like(inputs))
        self.engine, self.flat = engine, flat
        self.samples: list[int] = []        # examples (not padding) in each chunk of the step in flight
        self.rows = 0                        # rows per chunk
        self._generations: dict[int, int] = {}
        self._chunk = 0

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self._generations[fwd_chunk_id] = self.engine.start_forward()
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        self._chunk = bwd_chunk_id
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if not self.flat:
            self.engine.finish_micro_batch()
        return result

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        chunk = self._chunk
        with self.engine.capture(self.rows, self.samples[chunk], self._generations.pop(chunk)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class PipelineEngine:
    """The engine of this rank's stage, presented as the whole pipeline's to the trainer:
    ``group_names`` and the step's report cover all K stages (gathered; public values and the
    diagnostics a one-process report has); state and noise are this stage's own."""

    def __init__(self, engine: DPEngine, link: StageLinkOverRanks, group_names: list[str], model: nn.Sequential,
                 bounds: list[tuple[int, int]], module: nn.Sequential):
        self.engine, self.link, self.group_names = engine, link, group_names
        self.model, self.bounds, self.module = model, bounds, module

    def privatize(self) -> StepReport:
        report = self.engine.privatize()
        if self.link.flat:
            return report
        parts = self.link.world.all_gather({
            "thresholds": report.thresholds, "clip_fraction": report.clip_fraction, "nonfinite": report.nonfinite,
            "noise_std_sum": report.noise_std_sum, "quantiles": dict(report.norm_quantiles),
            "summary": report.policy_summary})
        cat = lambda key: torch.cat([p[key] for p in parts])  # noqa: E731
        summary: dict = {}
        for part in parts:  # per-group lists concatenate over the stages
            for key, value in part["summary"].items():
                summary[key] = summary.get(key, []) + list(value) if isinstance(value, list) else value
        report.group_names = list(self.group_names)
        report.thresholds, report.nonfinite = cat("thresholds"), cat("nonfinite")
        report.clip_fraction = None if report.clip_fraction is None else cat("clip_fraction")
        report.noise_std_sum = cat("noise_std_sum")
        report.noise_std_grad = report.noise_std_sum / report.expected_batch_size
        report.norm_quantiles = {q: torch.cat([p["quantiles"][q] for p in parts]) for q in report.norm_quantiles}
        report.policy_summary = summary
        return report

    @property
    def noise(self):
        """This stage's noise source (its own stream)."""
        return self.engine.noise

    @property
    def forward_written_state(self) -> set[str]:
        """The saved buffers this stage's training forwards wrote (its engine's), named as the whole
        model's state_dict (the checkpoint's keys) names them: the stage's child j is the model's
        child ``first + j``, under its own name (an ``OrderedDict`` Sequential's). Only this rank's
        stage: the trainer gathers every stage's to rank 0."""
        first, children = self.bounds[self.link.world.rank][0], [name for name, _ in self.model.named_children()]
        return {f"{children[first + int(index)]}.{rest}" for index, _, rest in
                (name.partition(".") for name in self.engine.forward_written_state)}

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def detach(self) -> None:
        self.engine.detach()


def certify_before_cut(model: nn.Module, clipping: ClippingSpec, expected_batch_size: int, run_losses):
    """The certificate's check of the whole model, before it is cut into stages (a stage's backward
    starts from the next stage's gradient, so no stage's step can replay a sample alone): an engine
    on the whole model with the clipping of one process, detached after. ``run_losses()``:
    per-sample losses of a few training rows. Returns the check's record; a mismatch raises."""
    with DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=expected_batch_size) as whole:
        return whole.certify(run_losses, before="the pipeline cut")


def pipeline_engine(model: nn.Module, clipping: ClippingSpec | dict, world: World, *, run_losses: Callable[[], torch.Tensor],
                    flat: bool = False, **engine_args) -> PipelineEngine:
    """This rank's stage of ``model`` with its engine. ``clipping`` is the whole model's (a
    ``{stages: [...]}`` grouping of one stage per rank); ``flat``: one threshold over all stages
    instead (its grouping names the cut only). ``run_losses()``: per-sample losses of the whole
    model on a few training rows, on which every rank checks the whole model first
    (:func:`certify_before_cut`); a refusal on any rank stops every rank."""
    clipping = ClippingSpec.of(clipping)
    grouping = clipping.grouping
    if not isinstance(grouping, dict) or "stages" not in grouping:
        raise DpclipError("training.parallel: pipeline cuts the model where clipping.grouping: {stages: [...]} "
                          "starts its stages", "set clipping.grouping to {stages: [regex, ...]}, one per process")
    if len(grouping["stages"]) != world.size:
        raise DpclipError(f"clipping.grouping.stages names {len(grouping['stages'])} stages for {world.size} "
                          "processes", f"start one process per stage: --nproc {len(grouping['stages'])}")
    bounds = stage_bounds(model, grouping["stages"])
    groups = build_groups(model, grouping, trainable_params(model))  # the one-process groups, for their names
    module = stage_module(model, bounds[world.rank])
    mine = {id(p) for p in module.parameters()}
    expected = {id(groups.params[i].param) for i in groups.members[world.rank]}
    if not flat and mine & {id(p.param) for p in groups.params} != expected:
        raise DpclipError("the pipeline's cut does not match the stages grouping", SEQUENTIAL_HINT)
    local = replace(clipping, grouping="all-layer")
    if flat:
        if clipping.threshold_dict().get("kind") != "fixed":
            raise DpclipError("one flat threshold over pipeline stages takes a fixed threshold", None)
    else:
        local = replace(local, threshold=stage_threshold(clipping.threshold_dict(), world.rank, world.size))
    whole = replace(clipping, grouping="all-layer") if flat else clipping
    checked = world.on_every_rank(lambda: certify_before_cut(model, whole, engine_args.get("expected_batch_size", 1),
                                                             run_losses))
    link = StageLinkOverRanks(world, flat=flat)
    seed = engine_args.pop("seed", None)
    if seed is not None:  # seeded (unsafe) mode: a stream per stage, never one stream twice
        seed = int(seed) * 1009 + world.rank
    engine = DPEngine(module, local, seed=seed, stage=link, **engine_args)
    engine.certificate.carry(checked)
    names = ["all-layer"] if flat else list(groups.names)
    return PipelineEngine(engine, link, names, model, bounds, module)


class PipelineStep:
    """The private step of one stage (the pipeline's :class:`~dpclip.train.step.PrivateStep`):
    rank 0's Poisson draw goes to every stage; the batch runs through the stages in GPipe rounds
    of ``chunks`` micro-batches of ``micro_batch_size`` rows (the last round padded), the stages
    working on different micro-batches at once; then every stage privatizes its own parameters
    and takes its optimizer step, ending as every private step does
    (:func:`~dpclip.engine.step_end.end_private_step`, the one :class:`~dpclip.engine.step_end.StepOutcome`).
    The loss is the last stage's, the batch size rank 0's: summed over the ranks
    (:func:`dpclip.train.ranks.global_outcome`), they are the batch's.
    ``chunks`` defaults to the micro-batches of an expected batch.
    """

    def __init__(self, engine: PipelineEngine, optimizer: torch.optim.Optimizer, train: dict[str, torch.Tensor],
                 criterion: Callable, input_key: str, micro_batch_size: int, chunks: int | None = None):
        world = engine.link.world
        self.world, self.engine, self.optimizer = world, engine, optimizer
        self.train, self.criterion, self.input_key = train, criterion, input_key
        self.micro_batch_size = micro_batch_size
        self.chunks = chunks or max(1, math.ceil(engine.engine.expected_batch_size / micro_batch_size))
        inputs, outputs = _stage_examples(engine, train[input_key], micro_batch_size)
        # Static shapes: the stage's own shape inference would run a backward outside the engine.
        self.stage = _EngineStage(engine.module, world.rank, world.size, engine.engine, inputs, outputs,
                                  engine.link.flat)
        self.stage.rows = micro_batch_size
        self.first, self.last = world.rank == 0, world.rank == world.size - 1
        self._weights: list[torch.Tensor] = []
        self._loss_calls = 0
        self._loss_sum = 0.0
        self.schedule = ScheduleGPipe(self.stage, n_microbatches=self.chunks, loss_fn=self._loss, scale_grads=False)

    def _loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weights = self._weights[self._loss_calls]   # GPipe computes the chunks' losses in order
        self._loss_calls += 1
        per_sample = self.criterion(outputs, {"labels": labels})
        self._loss_sum += float((per_sample.detach() * weights).sum())
        return (per_sample * weights).sum()

    def __call__(self, indices: torch.Tensor, before_update: Callable[[StepReport], None] | None = None) -> StepOutcome:
        started = time.perf_counter()
        indices = self.world.broadcast(indices)   # rank 0's draw: every stage runs the same batch
        rows = self.micro_batch_size
        self._loss_sum = 0.0
        for part in micro_batches(indices, rows * self.chunks):
            batch = _padded(select(self.train, part), rows * self.chunks)
            n = len(part)
            self.stage.samples = [min(max(n - j * rows, 0), rows) for j in range(self.chunks)]
            self._weights = [(torch.arange(rows) < s).to(torch.get_default_dtype()) for s in self.stage.samples]
            self._loss_calls = 0
            if self.first:
                _through_pipeline(self.schedule.step, batch[self.input_key])
            elif self.last:
                _through_pipeline(self.schedule.step, target=batch["labels"])
            else:
                _through_pipeline(self.schedule.step)
            if self.engine.link.flat:  # the norms of all the round's chunks, summed over the stages
                for _ in range(self.chunks):
                    self.engine.engine.finish_micro_batch()
        return end_private_step(self.engine, self.optimizer, before_update, self._loss_sum if self.last else 0.0,
                                len(indices) if self.first else 0, started)


def pipeline_input(loss_fn) -> str:
    """The batch key stage 0 takes (the model's input) for a per-sample loss of
    :mod:`dpclip.models.losses`; other forwards (keyword inputs) cannot be cut into stages."""
    name = getattr(getattr(loss_fn, "forward", None), "__name__", "")
    keys = {"forward_features": "features", "forward_token_ids": "input_ids"}
    if name not in keys:
        raise DpclipError("pipeline stages take models called as model(features) or model(input_ids)",
                          SEQUENTIAL_HINT)
    return keys[name]


def _stage_examples(engine: PipelineEngine, features: torch.Tensor, size: int):
    """Example input and output of this rank's stage at ``size`` rows (zeros through the whole
    model, which every rank holds; no autograd, so the engine does not see it)."""
    x = features.new_zeros((size, *features.shape[1:]))
    rank = engine.link.world.rank
    with torch.no_grad():
        for stage, (first, last) in enumerate(engine.bounds):
            y = x
            for index in range(first, last):
                y = engine.model[index](y)
            if stage == rank:  # a later stage's input carries a gradient back (the metadata says so)
                return (x if stage == 0 else x.clone().requires_grad_(True)), y
            x = y
    raise AssertionError("unreachable: every rank has a stage")


def _through_pipeline(step: Callable, *args, **kwargs) -> None:
    """A schedule step. torch wraps what a stage raises in RuntimeError: a DpclipError comes out as
    itself, and gloo's lost connection (a peer stopped or was killed) as :class:`PeerStopped`, so
    the launcher names the rank that failed first (docs/distributed.md, "Faults")."""
    try:
        step(*args, **kwargs)
    except RuntimeError as exc:
        inner = exc.__cause__
        while inner is not None and not isinstance(inner, DpclipError):
            inner = inner.__cause__
        if inner is not None:
            raise inner from exc
        if timed_out(exc):   # a stage stuck, not stopped: this rank's own error, naming the timeout
            raise no_answer(exc) from exc
        if "gloo" in str(exc) or "Connection closed" in str(exc) or "Connection reset" in str(exc):
            raise PeerStopped("another stage stopped, so this one cannot go on", RESUME_HINT) from exc
        raise


def _padded(batch: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """Zero rows appended up to ``size`` (their loss weight is 0)."""
    n = len(next(iter(batch.values())))
    if n == size:
        return batch
    return {k: torch.cat([v, v.new_zeros((size - n, *v.shape[1:]))]) for k, v in batch.items()}


def sync_stages(model: nn.Module, bounds: list[tuple[int, int]], world: World) -> None:
    """Every rank's copy of ``model`` takes each stage's current weights from the stage's rank
    (before an evaluation or a checkpoint, which rank 0 makes of the whole model)."""
    for stage, (first, last) in enumerate(bounds):
        for index in range(first, last):
            for tensor in model[index].state_dict().values():
                run_collective(dist.broadcast, tensor, src=stage)
