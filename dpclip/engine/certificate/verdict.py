"""The certificate's verdicts: a checked row's numbers from the engine against its own gradient,
and, when samples mix, the module where they meet."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from dpclip.engine.batch_axis.layout import tensor_leaves
from dpclip.engine.certificate.replay import Forward, Replayer, batch_axis, close, module_outputs, select
from dpclip.engine.sums import sum_of_squares
from dpclip.errors import EngineError
from dpclip.torch_compat import tensor_version

HINT = ("the engine's per-sample attribution does not hold for this model; freeze the named "
        "parameters, replace the module, or report the model (docs/certificate.md)")
#: a refusal is an outcome computed from the private batch (which sample, which parameter, by how much):
#: printed to whoever runs the training, written to no run file, and said to be outside ε
NOT_COVERED = " [computed from the private batch: not covered by ε]"
#: the hint of a refusal where a replay met a reentrant checkpoint called on inputs that need no gradient
REENTRANT_HINT = ("a torch.utils.checkpoint block with use_reentrant=True was called on inputs none of which needs a "
                  "gradient: torch then never runs its backward, and its parameters get no gradient (torch warns "
                  "\"None of the inputs have requires_grad=True\"); checkpoint with use_reentrant=False (transformers: "
                  "gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False})), or "
                  "checkpoint only blocks whose input needs a gradient (docs/supported-models.md, \"Gradient checkpointing\")")
MIXING_HINT = ("each sample's output must depend on that sample alone: replace batch statistics "
               "(BatchNorm, x - x.mean(0)) by per-sample ones (GroupNorm, LayerNorm) and keep no "
               "data in buffers (docs/certificate.md)")


SHARED_INPUT_HINT = ("; an input shared by all samples whose first size equals this batch's by chance (a table of "
                     "K rows, B = K) is read as one row per sample: pass it with a leading dimension 1, or keep it "
                     "in the model (a buffer)")


STATE_HINT = ("keep no data in the model's state: register such a statistic outside the forward (or compute "
              "it from public data), or update it in eval mode only; count steps in the training loop, outside "
              "the forward (the number of forwards depends on the draws' sizes), or keep such a buffer "
              "non-persistent (register_buffer(..., persistent=False): not saved, not released)")
_ONE_ROW_HINT = "; or use micro-batches of 2 rows or more (max_physical_batch_size ≥ 2)"


def refuse_written_buffer(found: str | None, batch: int | None = None) -> None:
    """Refuse a forward whose write of its state depends on the batch (``found``: "buffer NAME" or
    "frozen parameter NAME", and the replay that left it otherwise, from
    :meth:`~dpclip.engine.certificate.state.State.after`)."""
    if found is not None:
        raise EngineError(f"the model's forward writes {found} from the data: what it writes depends on the "
                          "batch (its statistics, its rows or its size: a count of the samples seen releases the "
                          "batch size, which ε does not cover), so statistics of private data would be released "
                          "with the model and read by later micro-batches' forwards" + NOT_COVERED,
                          STATE_HINT + (_ONE_ROW_HINT if batch == 1 else ""))


def refuse_written_parameter(name: str) -> None:
    """Refuse a forward that writes a frozen parameter: no copy of the model's parameters is kept, so
    the certificate cannot replay the forward from the values it found there."""
    raise EngineError(f"the model's forward writes frozen parameter {name} (requires_grad=False): the certificate "
                      "checks no write to a parameter (it keeps no copy of them), and data written there would be "
                      "released with the model" + NOT_COVERED,
                      "write no parameter in the forward: " + STATE_HINT)


def refuse_unchecked_write(name: str, batch: int, why: str) -> None:
    """Refuse a forward that writes buffer ``name`` where no replay can show that the write does
    not depend on the batch (its replay on other inputs fails: ``why``)."""
    rows = "one row: no sample can be replayed alone" if batch == 1 else f"{batch} rows replayed as a batch"
    raise EngineError(f"the model's forward writes buffer {name}, and the certificate cannot check that what it "
                      f"writes does not depend on the data: with {rows}, its replay with the rows' inputs set to "
                      f"zeros or ones, or with one row more, fails ({why})" + NOT_COVERED,
                      STATE_HINT + (_ONE_ROW_HINT if batch == 1 else ""))


def refuse_trained_parameter_write(names: list[str], params: list[Tensor], versions: list[int], disabled) -> None:
    """Refuse a training forward that wrote a trained parameter in place (its version moved from
    ``versions``; ``F.embedding(ids, weight, max_norm=...)`` renormalises the rows looked up): the
    weights then say, with no noise, which of them the private batch touched. ``disabled``: a
    sharded model or a stage (its parameters are gathered and freed in place), exempt."""
    moved = [n for n, p, v in zip(names, params, versions) if tensor_version(p) != v]
    if not moved or disabled is not None:
        return
    name = moved[0]
    raise EngineError(f"the model's forward writes the trained parameter {name} in place (F.embedding with "
                      "max_norm renormalises the rows it looks up): the weights would show, with no noise, what "
                      "the private batch touched" + NOT_COVERED,
                      "leave trained parameters to the optimizer: no max_norm, no in-place change of a weight in "
                      "the forward (clip the gradient instead)")


def refuse_write_after_the_check(name: str) -> None:
    """Refuse a forward the certificate does not check that writes buffer ``name``, which no checked
    forward wrote: nothing showed that what it writes does not depend on the batch, and a later
    forward reading it would carry this batch's data into every sample's gradient."""
    raise EngineError(f"the model's forward writes buffer {name}, which no forward the certificate checked wrote: "
                      "a write that begins after the check is not checked, and a later forward reading the buffer "
                      "would carry this batch's data into other batches' gradients" + NOT_COVERED,
                      STATE_HINT + "; a write that only later steps make must be made from the first forward on "
                      "(or checked again: verify_every=1)")


def clipped_floor(rtol: float) -> float:
    """Under 16-bit autocast (bound 2⁻⁵), the share of the sample's whole CLIPPED gradient that an error
    is measured against at least: one bf16 unit round-off (2⁻⁸, an eighth of the bound); 0 otherwise.
    A gradient that is zero in exact arithmetic comes out of a bf16 forward as noise on the scale of the
    terms that cancel: ESM C's query and key weights on a sample of one repeated token, 0 in the batch and
    up to 6.4·10⁻⁴ of the sample's gradient alone. On the clipped scale, the released sum moves by at
    most that share of C. Group norms keep their floor of 10⁻³ of the unclipped gradient: where such a
    gradient is a group of its own (layer or param grouping) its norm is noise, and the check refuses."""
    return 0.125 if rtol >= 2.0 ** -5 else 0.0


def compare(row: int, own: list[Tensor], norms: Tensor, witness: dict[int, Tensor], thresholds: Tensor,
            weight: float, scale: float, rtol: float, clip: Callable[[Tensor, Tensor], Tensor],
            group_of: list[int], names: list[str], unchecked_groups: set[int] = frozenset(),
            slack: list[float] | None = None) -> None:
    """Raise an EngineError unless the engine's group norms ``norms`` [K] of ``row`` and its witness
    sums (per parameter index: Σ over the batch with every clip factor but this row's zeroed) match
    the row's own gradient ``own`` (per parameter): ‖g_k‖, and c_k·w·scale·g with c_k the clip
    factor of ‖g_k‖ at ``thresholds`` [K]. A group whose engine norm is non-finite must contribute
    nothing (the engine drops such a sample); ``unchecked_groups`` are the groups whose norm the
    engine recomputed in float64 for this row (terms that cancel: float32 autograd cannot give a
    reference there). ``slack`` (per parameter): an allowance for the working precision's own
    rounding of this row's gradient, added to the bound (a float64 reference's retry)."""
    groups = norms.shape[0]
    group_index = torch.tensor(group_of)
    own = [g.detach() for g in own]
    # sums of squares blocked (dpclip.engine.sums: relative error ≤ 8·10⁻⁶, far inside any bound
    # here) in each gradient's own dtype and place: no float64 copy of every parameter's gradient
    own_sq = torch.stack([sum_of_squares(g.unsqueeze(0))[0].double().cpu() for g in own])   # [P]
    sq = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, own_sq)
    ref = sq.sqrt()
    total = ref.norm()
    slack_p = torch.tensor(slack if slack is not None else [0.0] * len(own), dtype=torch.float64)
    group_slack = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_index, slack_p.square()).sqrt()
    engine_norms = norms.detach().double().cpu()
    dropped = ~torch.isfinite(engine_norms)
    unchecked = torch.zeros(groups, dtype=torch.bool)
    unchecked[list(unchecked_groups)] = True
    norm_err = (engine_norms - ref).abs()
    wrong_mask = ~dropped & ~unchecked & (norm_err > rtol * (ref + 1e-3 * total) + group_slack + 1e-30)
    factors = clip(ref.to(thresholds.dtype).to(thresholds.device), thresholds.detach()).double().cpu() * weight * scale
    factors = torch.where(dropped, 0.0, factors)
    expected_total = (factors.square() * sq).nan_to_num(0.0).sum().sqrt()
    per_factor = factors[group_index]                                              # [P]
    errs = []
    for idx, g in enumerate(own):
        got, expected = witness.get(idx), g * float(per_factor[idx])
        diff = expected if got is None else got.detach().to(g.dtype) - expected
        errs.append(sum_of_squares(diff.unsqueeze(0))[0].double().cpu())
    errs, sizes = torch.stack(errs).sqrt(), per_factor.abs() * own_sq.sqrt()
    bad_mask = ~unchecked[group_index] & (errs > rtol * (sizes + (1e-3 + clipped_floor(rtol)) * expected_total)
                                          + per_factor.abs() * slack_p + 1e-30)
    wrong = wrong_mask.nonzero().flatten().tolist()
    bad = [(idx, float(errs[idx] / sizes[idx].clamp_min(1e-30))) for idx in bad_mask.nonzero().flatten().tolist()]
    if not wrong and not bad:
        return
    named = [f"{names[idx]} (relative error {e:.2g})" for idx, e in bad[:6]]
    if not named:
        named = [", ".join(names[i] for i, kk in enumerate(group_of) if kk == k)[:200] for k in wrong[:3]]
    raise EngineError(
        f"the certificate refused this model: for sample {row} of the batch, the engine's per-sample "
        f"{'norms and ' if wrong else ''}clipped gradients disagree with the sample's own gradient "
        f"(plain autograd) beyond the rounding bound {rtol:.1g}, at: " + "; ".join(named) + NOT_COVERED, HINT)


def reentrant_hinted(exc: EngineError, gradless: list) -> EngineError:
    """``exc``, a refusal of the comparison, with :data:`REENTRANT_HINT` where the replays met a
    reentrant checkpoint called on inputs that need no gradient (``gradless`` not empty)."""
    if gradless and exc.hint == HINT:
        exc.hint = REENTRANT_HINT
    return exc


def mixing_error(model: nn.Module, replayer: Replayer, forward: Forward, row: int, what: str, rtol: float,
                 replace: tuple[int, int] | None = None) -> EngineError:
    """The refusal of a model whose samples mix, naming where they meet if a replay finds it."""
    module = where_samples_meet(model, replayer, forward, row, rtol, replace)
    where = f"module {module}" if module else f"the model ({type(model).__name__})"
    rowed = [t for t in tensor_leaves((forward.args, forward.kwargs)) if t.dim() and t.shape[0] == forward.batch]
    return EngineError(f"{where} mixes samples: the model {what}; a per-sample gradient, and so the "
                       "privacy guarantee, would not hold" + NOT_COVERED,
                       MIXING_HINT + (SHARED_INPUT_HINT if len(rowed) > 1 else ""))


def users_hook(hook) -> bool:
    """Whether a forward hook is the user's, not one of dpclip's own (told apart by the package its
    function comes from: the engine's and make_private's hooks are on the root)."""
    return not getattr(hook, "__module__", "").startswith("dpclip.")


def hooked_layers(model: nn.Module) -> list[str]:
    """The modules with forward hooks of the user's, which replays run without."""
    return [name or "<root>" for name, m in model.named_modules()
            if any(users_hook(h) for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))]


def with_hooks_named(exc: EngineError, hooked: list[str]) -> EngineError:
    """A mixing refusal of a model whose layers have forward hooks: a hook that changes an output
    makes the replays (run without hooks) differ, which reads as mixing."""
    if not hooked or not exc.hint.startswith(MIXING_HINT):
        return exc
    named = ", ".join("the model itself" if n == "<root>" else f"module {n}" for n in hooked[:3])
    return EngineError(exc.message, f"{named} {'has' if len(hooked) == 1 else 'have'} forward hooks, which the "
                                    "check's replays run without (a hook may only observe): a hook that changes its module's input "
                                    "or output must be part of the module's forward; otherwise, " + MIXING_HINT)


def where_samples_meet(model: nn.Module, replayer: Replayer, forward: Forward, row: int, rtol: float,
                       replace: tuple[int, int] | None = None) -> str | None:
    """The first module (in the order calls finish) whose output differs between the batch and
    sample ``row`` alone (or the batch with row j replaced by row s, ``replace``: its other rows)."""
    names = {m: n for n, m in model.named_modules()}
    runs = []
    alone = None if replace else torch.tensor([row])
    for inputs in ((forward.args, forward.kwargs),
                   select(forward.args, forward.kwargs, forward.batch, alone, False, replace)):
        try:
            with module_outputs(model) as calls, torch.no_grad():
                replayer.run(forward, inputs, replayer.leaves())
        except Exception:   # a forward that fails alone is named by its own refusal
            return None
        runs.append(calls)

    def label(m: nn.Module) -> str:
        return f"{names.get(m) or '<root>'} ({type(m).__name__})"
    for (m, full), (m2, other) in zip(*runs):
        if m is not m2 or len(full) != len(other):
            return None
        for a, b in zip(full, other):
            if not a.is_floating_point():
                continue
            if replace is None:
                axis = batch_axis(a, b, forward.batch)
                if axis == "mixed" or not close(a if axis is None else a.narrow(axis, row, 1), b, rtol):
                    return label(m)
            elif not _same_but_row(a, b, forward.batch, replace[0], rtol):
                return label(m)
    return None


def _same_but_row(a: Tensor, b: Tensor, batch: int, j: int, rtol: float) -> bool:
    """Whether ``a`` and ``b`` agree everywhere but at index ``j`` of some axis of size ``batch``."""
    if a.shape != b.shape:
        return False
    if close(a, b, rtol):
        return True
    for axis in range(a.dim()):
        if a.shape[axis] != batch:
            continue
        keep = torch.ones(batch, dtype=torch.bool, device=a.device)
        keep[j] = False
        if close(a[(slice(None),) * axis + (keep,)], b[(slice(None),) * axis + (keep,)], rtol):
            return True
    return False
