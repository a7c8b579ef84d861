"""``dpclip diagnose RECIPE|RUN_DIR``: the Hessian diagnostics of a model, on their own
(docs/hessian-diagnostics.md).

A recipe is set up as training would set it up (:func:`dpclip.train.parts.assemble`: data,
model at its initial weights, the σ its ε gives, the engine's thresholds)
and measured at initialisation; a run directory is set up from its own recipe, its latest
checkpoint's weights and thresholds are loaded, and it is measured there. Nothing is
trained and no run directory is written except the two plots (on public data into the run
directory, or ``--out``). On private data the results are labelled "not covered by ε"
(:mod:`dpclip.train.diagnostics`) and written outside any run directory (``./diagnose-NAME/``
or ``--out``): a run's files are released beside its statement, which does not list them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dpclip.diagnose import HessianDiagnostics
from dpclip.errors import DpclipError
from dpclip.files import made_private
from dpclip.recipe import load_recipe
from dpclip.rng import private_generator
from dpclip.accounting import Ledger
from dpclip.rundir.enclosing import enclosing_run
from dpclip.rundir.checkpoint import latest_checkpoint, load_checkpoint, missing_checkpoint_hint
from dpclip.train.diagnostics import (DIAGNOSTICS_FILE, choose_rows, clip_threshold, draw_rows, evaluate,
                                      make_record, measure_model, public_batch_size, public_rows_of, read_records)
from dpclip.train.diagnostics_plots import (HESSIAN_PLOT, IMPROVEMENT_PLOT, plot_hessian_over_training,
                                            plot_improvement)
from dpclip.planning.plan import private_seed
from dpclip.train.parts import assemble
from dpclip.train.run_parts import RunParts
from dpclip.rundir.run import RunDir
from dpclip.train.state import RunState, restore
from dpclip.train.workflow import resolve_recipe


@dataclass
class DiagnoseResult:
    """What ``dpclip diagnose`` measured and wrote."""

    name: str
    source: str                     # "recipe" (initial weights) or "run" (its latest checkpoint)
    step: int
    diagnostics: HessianDiagnostics
    record: dict[str, Any]          # as a line of diagnostics.jsonl: measurement, formulas, label
    noise_multiplier: float
    out_dir: Path
    plots: list[str] = field(default_factory=list)
    history: int = 0                # records of the run's diagnostics.jsonl drawn beside this one

    @property
    def private(self) -> bool:
        return self.record["data"] == "private"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "step": self.step, **self.record,
                "noise_multiplier": self.noise_multiplier, "out_dir": str(self.out_dir), "plots": self.plots,
                "history": self.history}


def diagnose(target: str | Path, overrides: list[str] | None = None, *, probes: int | None = None,
             per_sample: int | None = None, batch_size: int | None = None, data: str | None = None,
             allow_private: bool = False, out: str | Path | None = None,
             public_rows: dict[str, torch.Tensor] | None = None) -> DiagnoseResult:
    """Measure the diagnostics of a recipe (at initialisation) or a run (at its latest checkpoint).

    ``probes``, ``per_sample`` and ``data`` default to the recipe's ``diagnostics:`` block,
    ``batch_size`` (rows measured on) to its ``training.batch_size``. Private data needs
    ``allow_private`` or the recipe's ``diagnostics.private_not_covered: true``.
    ``public_rows``: public training rows the caller has loaded (else ``recipe.public``)."""
    target = Path(target)
    parts, source, step = _set_up(target, overrides or [])
    try:
        recipe = parts.setting.recipe
        spec = recipe.diagnostics
        data = data or spec.data
        out_dir = _out_dir(target, source, recipe.name, out, private=data == "private")
        public = public_rows_of(recipe, parts.feed.ordinary, continual=parts.feed.continual, public_rows=public_rows)
        rows = choose_rows(data, private_rows=parts.feed.ordinary.train, public_rows=public,
                           allow_private=allow_private or spec.private_not_covered)
        size = batch_size or recipe.training.batch_size
        if size < 2:
            raise DpclipError(f"--batch-size must be at least 2, got {size}", "e.g. --batch-size 64")
        # Which rows and which probes: private randomness, never the recipe's seed (dpclip.rng).
        generator = private_generator(private_seed(recipe), "hessian-diagnostics")
        learner = parts.learner
        diag = measure_model(learner.model, learner.loss_fn, draw_rows(rows, size, generator), learner.engine,
                             probes=probes or spec.probes, per_sample=per_sample or spec.per_sample,
                             generator=generator)
        formulas = evaluate(diag, sigma=parts.split.gradient_noise_multiplier, batch_size=recipe.training.batch_size,
                            clip_fn=recipe.clipping.fn, threshold=clip_threshold(parts.learner.engine),
                            gamma=recipe.clipping.gamma, public_batch_size=public_batch_size(recipe, public))
    finally:
        parts.learner.engine.detach()
    record = make_record(step, diag, formulas, data)
    made_private(out_dir)   # a folder it makes is owner-only, as a run's
    history = read_records(target / DIAGNOSTICS_FILE) if source == "run" else []
    # The run's records beside this measurement, which replaces a record of the same step.
    history = [r for r in history if r.get("step") != step]
    plot_hessian_over_training(history + [record], out_dir / HESSIAN_PLOT)
    plot_improvement(diag, out_dir / IMPROVEMENT_PLOT, sigma=formulas["gradient_noise_multiplier"],
                     clip_factor=formulas["clip_factor"], batch_size=recipe.training.batch_size,
                     private=data == "private")
    return DiagnoseResult(recipe.name, source, step, diag, record, parts.split.noise_multiplier, out_dir,
                          [str(out_dir / HESSIAN_PLOT), str(out_dir / IMPROVEMENT_PLOT)], len(history))


def _out_dir(target: Path, source: str, name: str, out: str | Path | None, *, private: bool) -> Path:
    """Where the plots go: ``out``, else the run directory (public data) or ``./diagnose-NAME/``.

    A measurement on private data is never written into a run directory: the run's files are
    what ``dpclip export`` and ``dpclip report`` release beside the run's privacy statement,
    which lists what the run itself released outside ε, not what a later command measured."""
    if out is None and not private:
        return target if source == "run" else Path(f"diagnose-{name}")
    given, out = out is not None, Path(f"diagnose-{name}" if out is None else out)
    if out.exists() and not out.is_dir():   # was "unexpected FileExistsError"
        raise DpclipError(f"--out {out} is a file", "--out takes a folder for the plots, e.g. --out diagnose-plots")
    run = enclosing_run(out)
    if given and not private and run is not None and not (source == "run" and run == out.resolve() == target.resolve()):
        # another run's (or a run's sub-folder): its own plots would be replaced by another measurement's
        raise DpclipError(f"--out {out} is inside the run directory {run}, whose files these plots must not replace",
                          "write them outside the run, or leave --out out to draw a run's own plots in its directory")
    if private:   # the default too: run from inside a run directory, ./diagnose-NAME is in it
        if run is not None:
            raise DpclipError(f"{'--out ' if given else ''}{out} is inside the run directory {run}: diagnostics "
                              "measured on private data are not written into a run (its privacy statement would "
                              "not list them)", "write them elsewhere: --out DIR outside the run, or run the "
                              "command from outside it")
    return out


def _set_up(target: Path, overrides: list[str]) -> tuple[RunParts, str, int]:
    """(the run's parts, "recipe" or "run", the step of its weights)."""
    if target.is_dir():
        if overrides:
            raise DpclipError("key=value overrides apply to a recipe, not to a run directory",
                              "diagnose the run as it was trained, or pass its recipe file with the overrides")
        run = RunDir(target)
        run.recipe()  # the error for a folder that is not a run
        recipe = resolve_recipe(None, target)[0]
        if recipe.training.parallel == "fsdp":  # measured in one process, on the whole model
            recipe = recipe.model_copy(update={"training": recipe.training.model_copy(update={"parallel": "data"})})
        parts = assemble(recipe, resuming=True, run_dir=run.path)
        try:
            checkpoint = latest_checkpoint(run.path)
            if checkpoint is None:
                raise DpclipError(f"{run.path} has no checkpoint to measure", missing_checkpoint_hint(run.path))
            state = RunState(Ledger(parts.setting.plan.delta, parts.setting.plan.accountant))
            # The weights and the thresholds the run had reached (and the rest of its state).
            restore(parts, state, load_checkpoint(checkpoint, parts.learner.model))
        except BaseException:
            parts.learner.engine.detach()
            raise
        return parts, "run", state.step
    return assemble(load_recipe(target, overrides)), "recipe", 0
