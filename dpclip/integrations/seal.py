"""``make_private``'s engine, driven by the parts it returns alone (docs/python-api.md, "What
the loop must do").

``private.engine`` is the :class:`~dpclip.engine.DPEngine` behind the loss and the optimizer. Its
own step calls bypass the loop's checks: ``engine.backward`` adds rows the draw tracker never
counted (an example's clipped gradient twice in one step, charged once), ``engine.privatize``
writes a noisy gradient the ledger never charges, ``engine.paused()`` lets raw, unclipped
gradients of the batch into ``p.grad``, and ``engine.debug_clipped()`` (or ``step_accumulator``
while a batch is drawn) hands out the clipped sums without noise. Each is refused here, before
anything is written; the engine's settings (groups, thresholds, the plan's σ) stay readable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dpclip.engine import DPEngine
from dpclip.errors import DpclipError
from dpclip.integrations.rows import DrawTracker

BACKWARD_HINT = ("call loss.backward() on the loss the returned criterion gives (or private.train_step): the loop's "
                 "checks count each drawn row once; a loop built on the engine itself is a DPEngine of your own "
                 "(docs/engine.md)")

#: engine calls outside the returned parts: what each would let out, and what to call instead
REFUSED = {
    "paused": ("forwards and backwards inside it run the model outside the engine, so the batch's raw gradients "
               "(unclipped, without noise) land in p.grad",
               "evaluate under torch.no_grad(); train on public data with a model of your own (copied before "
               "make_private), or with dpclip train's continual public phase (docs/continual.md)"),
    "debug_clipped": ("it returns the step's clipped sums computed from the private batch without noise (not "
                      "covered by ε) and ends the step, so that optimizer.step() would release noise alone",
                      "read p.grad after optimizer.step() (the noisy gradient, covered by ε); to debug the "
                      "clipping, run a DPEngine of your own on public data (docs/engine.md)"),
}


def seal_engine(engine: DPEngine, tracker: DrawTracker) -> DrawTracker:
    """Refuse ``engine``'s step calls unless the returned parts make them: backward inside the
    loss's (or train_step's) engine backward, privatize inside ``optimizer.step()``. Returns
    ``tracker``, the loop's, which says where they are."""
    for name in ("backward", "capture", "finish_micro_batch"):
        _guard(engine, name, lambda: tracker.busy, "the loop's checks would not count its rows: an example's clipped "
               "gradient could enter its step twice, charged once", BACKWARD_HINT)
    _guard(engine, "privatize", lambda: tracker.releasing, "the noisy gradient it writes into p.grad would not be "
           "charged in the ledger", "call optimizer.step() (the returned optimizer): it noises, charges, then steps")
    for name, (why, hint) in REFUSED.items():
        _guard(engine, name, lambda: False, why, hint)
    _guard_sums(engine, tracker)
    return tracker


def _guard_sums(engine: DPEngine, tracker: DrawTracker) -> None:
    """``engine.step_accumulator`` (a property: guarded on a subclass made for this engine) holds the
    open draw's clipped sums without noise: refused to the loop while a draw is open."""
    base = type(engine)

    def step_accumulator(self: DPEngine) -> Any:
        if tracker.rows is not None and not (tracker.busy or tracker.releasing):
            raise DpclipError("private.engine.step_accumulator read by the loop while a batch is drawn: it holds "
                              "the draw's clipped sums computed without noise (not covered by ε)",
                              REFUSED["debug_clipped"][1])
        return base.step_accumulator.fget(self)
    engine.__class__ = type(base.__name__, (base,), {"step_accumulator": property(step_accumulator),
                                                    "__doc__": base.__doc__, "__module__": base.__module__})


def _guard(engine: DPEngine, name: str, allowed: Callable[[], bool], why: str, hint: str) -> None:
    real = getattr(engine, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not allowed():
            raise DpclipError(f"private.engine.{name}() called by the loop: make_private's engine is driven by the "
                              f"loss and optimizer it returned, and {why}", hint)
        return real(*args, **kwargs)
    guarded.__doc__ = real.__doc__
    setattr(engine, name, guarded)
