"""The certificate: each clip checked against the sample's own gradient (docs/certificate.md).

The engine attributes the rows of every layer's input and output gradient to samples by
probing the forward (dpclip.engine.batch_axis). A probe is an inference; the certificate
checks its consequences on the real model and a real batch, before the first noisy step:

1. **The loss head.** For a few rows i of the micro-batch (the first, the last and two drawn
   from OS entropy), the cotangent of loss_i with respect to the model's returned tensors,
   read from the losses' own graph (:class:`~dpclip.engine.certificate.replay.Cotangents`).
2. **The sample's own gradient.** The model's forward replayed by plain autograd, its layers'
   own forwards with the book-keeping off, under the autocast and the RNG state the real
   forward had (:mod:`dpclip.engine.certificate.replay`): on sample i alone when the forward
   draws no random numbers or its draws can be cut per sample (:mod:`~dpclip.engine.certificate.alone`),
   on the whole batch when not (:mod:`~dpclip.engine.certificate.batch`; dropout: the same masks).
   g_i = J(θ)ᵀ cot_i.
3. **The comparison** (:func:`~dpclip.engine.certificate.verdict.compare`): the engine's group
   norms of row i against ‖g_{i,k}‖, and its *witness* (its own clipped-sum code run with every
   clip factor but row i's set to 0, :meth:`dpclip.engine.microbatch.MicroBatch.watch`) against
   c_{i,k}·w_i·g_i / B, parameter by parameter, within the rounding bound :data:`RTOL`.
4. **Sample independence.** Alone, sample i's outputs must be its outputs in the batch, its
   loss's cotangent must vanish off its own rows, and its replay must leave the model's state
   (buffers, frozen parameters, by name) as the real forward on the whole batch left it
   (:mod:`~dpclip.engine.certificate.state`); without random draws, every row's outputs must be
   its outputs in the batch's two halves replayed apart (:func:`~dpclip.engine.certificate.alone.halves_independent`). With a random forward the batch is replayed again
   with one other sample replaced, and the other checked rows' gradients must not move; a forward
   that wrote its state is replayed on zeros, ones and one row more (a micro-batch of one row too).

A random forward whose replay does not reproduce the step (a layer rule drawing its dropout in
another order than the module) is checked on a dry micro-batch in eval mode instead
(:mod:`dpclip.engine.certificate.dry`). Nothing of the step is disturbed: see replay.py.

Length: the recording hooks and the check share the forwards' state (one class); the check's parts are
in the submodules.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from dpclip.engine.batch_axis.layout import tensor_leaves
from dpclip.engine.certificate.alone import alone_gradients, read_cotangents
from dpclip.engine.certificate.batch import (batch_gradients, checked_before_eval_mode, float64_gradient,
                                             independent_in_batch)
from dpclip.engine.certificate.draws import Recorder
from dpclip.engine.certificate.replay import (Cotangents, Forward, NotReproducible, Replayer, copied,
                                              keep_given_or_copies, release, replaying, rng_state, same_rng, versions)
from dpclip.engine.certificate.state import buffer_versions, saved_buffer_versions, snapshot, state_kept
from dpclip.engine.certificate.verdict import (compare, hooked_layers, reentrant_hinted, refuse_trained_parameter_write,
                                              refuse_write_after_the_check, users_hook, with_hooks_named)
from dpclip.engine.precision import autocast_snapshot
from dpclip.torch_compat import tensor_version
from dpclip.errors import EngineError

#: relative rounding bound of a comparison, by the lowest precision the forward computed in
RTOL = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 2.0 ** -5, torch.float16: 2.0 ** -5}
#: float32 matmuls rounded to TF32 on CUDA (the caller's choice, kept by the replays)
TF32_RTOL = 2.0 ** -8
#: a float32 check's allowance for its own rounding, in units of the float32 gradient's distance
#: from the float64 one (both sum the same terms; the engine's float32 sums round like autograd's)
FLOAT32_SLACK = 4.0
#: the random rows checked besides the first and the last
RANDOM_ROWS = 2
#: forwards kept for one backward (a model called several times before its losses: views, multi-crop);
#: a checked micro-batch with more is refused (:func:`release_unkept`), never checked in part
MAX_FORWARDS = 16


def refuse_hook_before_the_rows(model: nn.Module, first: int) -> None:
    """Refuse a pre-hook of the user's that ran before the rows were taken (registered on the
    model with ``prepend=True`` after the engine, whose first hook is ``first``): the check would
    see the rows as it changed them."""
    for key, hook in model._forward_pre_hooks.items():
        if key == first:
            return
        if users_hook(hook):
            raise EngineError("a forward pre-hook registered on the model with prepend=True after the engine "
                              "runs before the engine records the rows, so its check would see them as the "
                              "hook changed them", "register hooks on the model before building the engine "
                              "(make_private, DPTrainer), or without prepend=True; a hook that changes the "
                              "inputs must be part of the model's forward")


def release_unkept(forwards: list[Forward], kept: list[Forward], overflow: int) -> None:
    """Release the recorded ``forwards`` not ``kept`` for a check; where ``overflow`` more ran than
    were recorded (MAX_FORWARDS), all of them, and refuse the check (before the backward: no noise):
    the uses of the forwards not kept would count in the engine's sums but in no sample's own gradient."""
    for f in forwards if overflow and kept else [f for f in forwards if f not in kept]:
        release(f)
    if not (overflow and kept):
        return
    calls = len(forwards) + overflow
    raise EngineError(f"the model ran {calls} training forwards before one engine.backward, and the certificate "
                      f"replays at most {MAX_FORWARDS} forwards of one backward, so this micro-batch's clipping "
                      "cannot be checked against each sample's own gradient",
                      f"call the model at most {MAX_FORWARDS} times per backward: pass the views through one "
                      "forward (stacked along an axis after the batch, [B, V, ...]), or call engine.backward "
                      "on fewer views at a time")


@dataclass
class CertificateRecord:
    """What a check verified (the report's; no data in it)."""

    step: int
    rows: int
    mode: str          # alone: each checked sample replayed alone; batch: the batch replayed; eval: dry, in eval mode
    unchecked_rows: int = 0   # checked rows with a group the engine recomputed in float64 (left out)
    before: str | None = None  # a check on rows of its own before training ("sharding", "the pipeline cut")


def shape_family(args: tuple, kwargs: dict, batch: int) -> tuple:
    """What a new check is due for: each input tensor's shape with its batch size left out, its
    dtype, and whether B is 1 or equals another size of an input (layouts a probe can confuse)."""
    leaves = tensor_leaves((args, kwargs))
    shapes = tuple((str(t.dtype),) + tuple(t.shape[1:]) if t.dim() and t.shape[0] == batch
                   else (str(t.dtype), "shared") + tuple(t.shape) for t in leaves)
    return shapes + ((batch == 1, any(batch in t.shape[1:] for t in leaves)),)


def checked_rows(samples: int, light: bool = False) -> list[int]:
    """The rows a check checks: the first, the last and two others drawn from OS entropy; at a new
    batch size of a family checked before (``light``), one row drawn from OS entropy (code that
    branches on the batch size: ``if x.shape[0] % 2``; docs/certificate.md)."""
    if light:
        return [secrets.randbelow(samples)] if samples > 0 else []
    others = list(range(1, samples - 1))
    return sorted({0, samples - 1} | set(secrets.SystemRandom().sample(others, min(RANDOM_ROWS, len(others)))))


def comparison_rtol(params: list[Tensor], cuda: bool, forward: Forward) -> float:
    """The rounding bound of a check: by the lowest precision of the parameters and the forward's autocast."""
    dtypes = {p.dtype for p in params} | {dtype for enabled, dtype, _ in forward.autocast.values() if enabled}
    rtol = max(RTOL.get(d, 2.0 ** -5) for d in dtypes)
    return max(rtol, TF32_RTOL) if cuda and torch.backends.cuda.matmul.allow_tf32 else rtol


class Certificate:
    """When a check is due, the forwards it needs, and the check itself (module doc).

    ``params``/``names``/``group_of``: the engine's trainable parameters, their names and groups;
    ``clip``: the clip function; ``plain``: a context in which the book-kept layers run their own
    forwards, ``is_plain()`` whether one is open; ``silence(on)`` makes the book-kept operations
    deliver nothing while the loss head's cotangents are read; ``every``: a periodic check every that many steps
    (0: none beyond the first step, new shape families and resumes)."""

    def __init__(self, model: nn.Module, params: list[Tensor], names: list[str], group_of: list[int],
                 clip: Callable[[Tensor, Tensor], Tensor], plain: Callable, is_plain: Callable[[], bool],
                 every: int = 0, silence: Callable[[bool], None] = lambda on: None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise EngineError(f"verify_every must be a whole number ≥ 0, got {every!r}",
                              "0 checks at the first step, on each new shape of the batch and after "
                              "each resume; N also every N steps")
        self.model, self.params, self.names, self.group_of = model, params, names, group_of
        self.clip, self.plain, self.is_plain, self.every = clip, plain, is_plain, every
        self.replayer = Replayer(model, names, params)
        self.families: set = set()
        self.sizes: set = set()                # (family, batch) pairs checked: a new batch size gets one row
        self.light = False                     # the armed check is a new batch size's (one row)
        self.last_step: int | None = None
        self.step = 0                          # the engine's step count, for verify_every
        self.forwards: list[Forward] = []
        self.armed, self.overflow = False, 0   # overflow: training forwards past MAX_FORWARDS while armed
        self.depth = 0
        self.disabled: str | None = None       # why no check can run (a sharded model, a pipeline stage)
        self.suspended = False                 # the engine's own dry forwards are not recorded
        self.idle = False                      # a compiled micro-batch's forward: its hooks do nothing
        self.forced = False                    # the next micro-batch is checked (a graph compiled again)
        self.last: CertificateRecord | None = None
        self.reported = True                   # the last record is in a step's report already
        self.checks = 0
        #: persistent buffers a training forward wrote (any forward; a checked one's write passed its check):
        #: saved with the weights, each forward advances them, and the number of forwards depends on the draws
        self.written_state: set[str] = set()
        self._written: list[str] = []       # the names the forward being checked wrote
        self._versions: dict[str, tuple[int, int]] | None = None   # buffers as a training forward began
        self._recorded = False              # whether the training forward running is recorded for a check
        #: buffers a checked forward wrote (its check passed): an unchecked forward may write only these
        self.checked_writes: set[str] = set()
        self._taken_writes: set[str] = set()
        self._recorded_writes: set[str] = set()   # what the recorded forwards wrote (in place or reassigned)
        self._modules = list(model.named_modules())   # walked once: ~2 µs a module is too much each forward
        self._cotangents = Cotangents(silence)
        self._recorder: Recorder | None = None
        self._gradless: list = []   # reentrant checkpoints the replays met on inputs needing no gradient
        self._devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        # the rows are taken first of the root's pre-hooks (a hook of the user's registered before the
        # engine runs after it: the replays start from the rows as given, not as it changed them); the
        # random and the model's state where the forward itself begins, after those hooks
        self._rows: tuple | None = None
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
                         model.register_forward_pre_hook(self._begin, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for f in self.forwards:
            release(f)
        self.forwards.clear()

    def reset(self, written_state=()) -> None:
        """A resume: the next micro-batch is checked whatever its shape; ``written_state``: the
        buffers the run's forwards were seen writing before (the checkpoint's)."""
        self.written_state.update(written_state)
        self.families.clear()
        self.sizes.clear()
        self.last_step = None

    # ------------------------------------------------------------ recording

    def _due(self, family: tuple, batch: int) -> str | None:
        """"full" (every row check), "size" (one row: a batch size not checked in its family) or None."""
        if self.disabled is not None:
            return None
        if self.forced or self.last_step is None or family not in self.families or \
                (self.every > 0 and self.step - self.last_step >= self.every):
            return "full"
        return "size" if (family, batch) not in self.sizes else None

    def _pre(self, module, args, kwargs):
        if self.idle:
            return None
        self.depth += 1
        if self.depth != 1 or not torch.is_grad_enabled() or self.is_plain() or self.suspended:
            return None
        self._versions, self._trained = buffer_versions(self._modules), [tensor_version(p) for p in self.params]
        self._recorded = False
        leaves = tensor_leaves((args, kwargs))
        if not leaves or leaves[0].dim() == 0:
            return None
        batch = leaves[0].shape[0]
        if not self.forwards:
            due = self._due(shape_family(args, kwargs, batch), batch)
            self.armed, self.light = due is not None, due == "size"
        if self.armed and len(self.forwards) < MAX_FORWARDS:
            refuse_hook_before_the_rows(module, self._handles[0].id)
            # copied on checked forwards only: a forward may change its inputs in place (replay.py)
            self._rows = (copied((args, kwargs)), batch, ((args, kwargs), versions((args, kwargs))))
            self._recorded = True
        self.overflow += self.armed and not self._recorded   # (past MAX_FORWARDS)
        return None

    def _begin(self, module, args, kwargs):
        if self._rows is None or self.idle or self.depth != 1:   # (not a call nested in the forward's hooks)
            return None
        ((args, kwargs), batch, given), self._rows = self._rows, None
        self.forwards.append(Forward(args, kwargs, batch, rng_state(self._devices),
                                     autocast_snapshot({p.device.type for p in self.params}),
                                     buffers=snapshot(self.model), given=given))
        self._recorder = Recorder(self.is_plain)   # the forward's random draws (draws.py)
        self._recorder.__enter__()
        return None

    def _post(self, module, args, kwargs, output):
        if self.idle:
            return None
        self.depth = max(self.depth - 1, 0)
        recorder = self._recorder if self.depth == 0 else None
        if recorder is not None:   # (first: a refusal below must not leave its dispatch mode on)
            self._recorder = None
            recorder.__exit__(None, None, None)
        if self.depth == 0 and self._versions is not None:
            before, self._versions = self._versions, None
            refuse_trained_parameter_write(self.names, self.params, self._trained, self.disabled)   # (no noise yet)
            written = {n for n, v in buffer_versions(self._modules).items() if before.get(n) != v}
            self.written_state.update(written & saved_buffer_versions(self._modules).keys())
            if self._recorded:
                self._recorded_writes |= written
            unchecked = sorted(written - self.checked_writes - self._recorded_writes)   # (recorded: checked later)
            if unchecked and not self._recorded and self.disabled is None:
                refuse_write_after_the_check(unchecked[0])   # before its backward: no noise drawn
        if self.depth == 0 and self.armed and self.forwards and not self.forwards[-1].edges:
            forward = self.forwards[-1]
            keep_given_or_copies(forward)
            self._cotangents.attach(forward, [t for t in tensor_leaves(output) if t.requires_grad])
            end = rng_state(self._devices)
            forward.random = not same_rng(forward.rng, end)
            forward.draws, forward.draw_calls = (recorder.draws, recorder.calls) if recorder is not None and (
                not forward.random or recorder.follows(forward.rng, end, self._devices)) else (None, [])   # batch.py
        return None

    def due(self) -> bool:
        """Whether the next micro-batch is checked whatever its shape (the first step, a resume,
        ``verify_every``); a compiled step runs such a micro-batch through the engine."""
        return self.disabled is None and (self.forced or self.last_step is None or (
            self.every > 0 and self.step - self.last_step >= self.every))

    def force(self) -> None:
        """Check the next micro-batch whatever its shape: torch.compile compiled a graph again for
        a shape already checked, so a guard changed (a Python flag the forward reads), and the
        forward may take a path the last check did not see (docs/compiled.md)."""
        self.forced = self.disabled is None

    def checking(self) -> bool:
        """Whether the model's forwards since the last backward are recorded for a check (then
        make_private's criterion is checked on the checked samples alone too)."""
        return self.armed and bool(self.forwards)

    def take(self, batch: int) -> list[Forward]:
        """The forwards recorded for the backward of a micro-batch of ``batch`` rows (forgotten here)."""
        forwards, self.forwards, self.armed, overflow, self.overflow = self.forwards, [], False, self.overflow, 0
        self._taken_writes, self._recorded_writes = self._recorded_writes, set()
        kept = [f for f in forwards if f.batch == batch and f.outputs] if self.disabled is None else []
        release_unkept(forwards, kept, overflow)
        return kept

    # ------------------------------------------------------------ the check

    def rows(self, samples: int) -> list[int]:
        """The rows checked (:func:`checked_rows`; ``light``: a new batch size's check)."""
        return checked_rows(samples, self.light)

    def cotangents(self, losses: Tensor, rows: list[int], forwards: list[Forward], samples: int | None = None) -> dict:
        """Per checked row, its loss's direct cotangent on each forward's returned tensors (every row's: alone.py)."""
        try:
            cots = read_cotangents(self._cotangents.of, losses, rows, forwards, samples or len(losses))
        finally:
            for f in forwards:
                release(f)
        if all(c is None for r in rows for per in cots[r] for c in per):
            raise EngineError("the per-sample losses given to engine.backward do not depend on any tensor "
                              "the model's forward returned, so the engine cannot check its attribution",
                              "compute the losses from the model's outputs (model(x) -> logits -> loss), "
                              "not from tensors taken out of the model by hooks")
        return cots

    def check(self, step: int, forwards: list[Forward], rows: list[int], cots: dict, norms: Tensor,
              witness: dict, thresholds: Tensor, weights: Tensor | None, scale: float,
              cancelling: dict[int, set[int]] | None = None, mode: str | None = None) -> None:
        """Compare the engine's norms [b, K] and witness sums with each checked row's own gradient;
        an EngineError on a mismatch. ``scale``: the witness's 1/B; ``weights``: row weights;
        ``cancelling``: row -> groups the engine recomputed in float64 for it (not compared)."""
        rtol = max(comparison_rtol(self.params, bool(self._devices), f) for f in forwards)
        if mode != "eval":   # (eval mode: the same step's check again, its writes in training mode kept)
            self._written = []
        random = any(f.random for f in forwards) or forwards[0].batch == 1
        # a random forward whose draws were recorded: each checked sample alone, with its part of them
        cut = random and forwards[0].batch > 1 and all(f.draws is not None for f in forwards)
        self._gradless.clear()
        own, cut = self._own_gradients(forwards, rows, cots, rtol, cut, random)
        batch_mode = random and not cut
        cancelling = cancelling or {}
        try:
            for r in rows:
                args = (norms[r], witness.get(r, {}), thresholds if thresholds.dim() == 1 else thresholds[r],
                        1.0 if weights is None else float(weights[r]), scale, rtol, self.clip, self.group_of,
                        self.names, cancelling.get(r, set()))
                try:
                    compare(r, own[r], *args)
                except EngineError:
                    exact = float64_gradient(self, forwards, r, cots, batch_mode, RTOL[torch.float32])
                    if exact is None:
                        raise
                    # the float32 gradient's distance from the float64 one measures the working
                    # precision's rounding of this row's sums (terms that cancel), which the engine's
                    # float32 sums share: four times it is allowed on top of the bound
                    compare(r, exact, *args, slack=[FLOAT32_SLACK * float((a.double() - b).norm())
                                                    for a, b in zip(own[r], exact)])
        except EngineError as exc:   # the hint names a reentrant checkpoint that gives no gradient
            raise reentrant_hinted(exc, self._gradless)
        family = shape_family(forwards[0].args, forwards[0].kwargs, forwards[0].batch)
        self.families.add(family)
        self.sizes.add((family, forwards[0].batch))
        self.checked_writes.update(self._written, self._taken_writes)
        if self._written:   # passed: what the model's file holds of them is labelled (docs/certificate.md)
            saved = saved_buffer_versions(self._modules)   # (state_dict would run its hooks: FSDP's, peft's)
            self.written_state.update(n for n in self._written if n in saved)
            self._written = []
        if not self.light:   # (a new batch size's one row is not the periodic check)
            self.last_step = step
        self.forced = False
        self.checks += 1
        self.last = CertificateRecord(step, len(rows), mode or ("batch" if batch_mode else "alone"),
                                      sum(1 for r in rows if cancelling.get(r)))
        self.reported = False

    def _own_gradients(self, forwards: list[Forward], rows: list[int], cots: dict, rtol: float, cut: bool,
                       random: bool) -> tuple[dict, bool]:
        """Each checked row's own gradient, replayed alone (``cut``: with its part of the recorded
        draws) or within the batch (random draws that cannot be cut); and whether they were cut."""
        hooked = hooked_layers(self.model)   # (the replays silence them)
        start = forwards[0].buffers   # the replays start where the checked forward did
        try:
            with replaying(self.model, self.plain, self._devices, self._gradless), \
                    state_kept(self.model, start) as buffers:
                self._written += [n for n in buffers.written if n not in self._written]
                if cut:
                    try:
                        return alone_gradients(self.model, self.replayer, forwards, rows, cots, rtol, buffers,
                                               cut=True), True
                    except NotReproducible:
                        buffers.restore()   # (a replay cut short)
                if random:
                    try:
                        own = batch_gradients(self, forwards, rows, cots, rtol)
                    except NotReproducible:   # then checked in eval mode (dry.py); training mode here
                        checked_before_eval_mode(self, forwards, rows, cots, rtol, buffers)
                        raise
                    independent_in_batch(self, forwards, rows, cots, own, rtol, buffers)
                    return own, False
                return alone_gradients(self.model, self.replayer, forwards, rows, cots, rtol, buffers,
                                       halves=not self.light), False   # (a new batch size's one row stays one)
        except EngineError as exc:
            named = with_hooks_named(exc, hooked)
            if named is exc:
                raise
            raise named from exc

    def carry(self, record: CertificateRecord) -> None:
        """Report ``record``, a check another engine ran on this model (before it was cut)."""
        self.last, self.reported = record, False

    def unreported(self) -> CertificateRecord | None:
        """The last check's record if no step's report has carried it yet (then it is carried)."""
        if self.reported:
            return None
        self.reported = True
        return self.last


__all__ = ["Certificate", "CertificateRecord", "Forward", "NotReproducible", "RTOL", "shape_family"]
