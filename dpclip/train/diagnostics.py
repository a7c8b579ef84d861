"""Hessian diagnostics of a run: which rows they are measured on, what a record holds, and
the recorder that writes ``diagnostics.jsonl`` every ``diagnostics.every_steps`` steps
(docs/hessian-diagnostics.md).

Privacy. Measured on public data, the diagnostics are functions of the weights (themselves
post-processing of the noisy steps) and of public rows: covered by ε, free. Measured on
the private training data they are exact, noiseless functions of it: refused unless the
user opts in (``diagnostics.private_not_covered: true``, or ``dpclip diagnose
--allow-private-not-covered-by-epsilon``), and then labelled "not covered by ε" in every
record, in the run's privacy statement (:func:`dpclip.planning.plan.not_covered`), in the
tables and in the plot titles. The probes and the measured batch come from a private
generator (:mod:`dpclip.rng`), never from the recipe's seed.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from dpclip import layout
from dpclip.data.public import load_public
from dpclip.diagnose import HessianDiagnostics, measure, typical_clip_factor
from dpclip.errors import DpclipError
from dpclip.files import read_jsonl
from dpclip.rng import private_generator
from dpclip.planning.plan import private_seed
from dpclip.rundir.metrics import append_record, is_step

DIAGNOSTICS_FILE = layout.DIAGNOSTICS
#: The fields of a record computed from the measured rows (the rest is the run's settings).
MEASURED = ("trace_h", "trace_h_stderr", "gthg", "trace_h_sigma", "grad_norm_sq", "mean_sample_grad_norm_sq",
            "clip_factor", "decelerator", "b_star_dp", "improvement", "improvement_non_private", "alpha_star")
PRIVATE_HINT = ("measure on public data (a 'public:' block in the recipe), or accept exact private diagnostics "
                "outside ε: diagnostics.private_not_covered: true in the recipe, or "
                "--allow-private-not-covered-by-epsilon for dpclip diagnose")


def public_rows_of(recipe, private_data, *, continual=None,
                   public_rows: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
    """The public training rows: ``public_rows`` when the caller has them, else the run's
    continual schedule's public data (``continual``), else loaded from the recipe's
    ``public:`` block through :func:`dpclip.data.public.load_public` (which carves
    ``data.public_fraction`` out of ``private_data`` and refuses public rows that are private
    ones: loading ``public:`` as plain data would read the whole private set when the public
    rows are carved out of it), else None."""
    if public_rows is not None:
        return public_rows
    if continual is not None and continual.public is not None:
        return continual.public.train
    if recipe.public is None:
        return None
    return load_public(recipe, private_data).train


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a run's diagnostics.jsonl (none when it has none), each with its step; a
    record without a step number is refused: the file is damaged (a line cut by a crash ends the
    records read, :func:`dpclip.files.read_jsonl`)."""
    records = read_jsonl(path)
    for number, record in enumerate(records, 1):
        if not is_step(record.get("step")):
            raise DpclipError(f"{path} line {number} has no step number: the file is damaged",
                              f"restore {DIAGNOSTICS_FILE} from a backup of the run directory, or delete the "
                              "damaged line")
    return records


def choose_rows(data: str, *, private_rows: dict[str, torch.Tensor], public_rows: dict[str, torch.Tensor] | None,
                allow_private: bool) -> dict[str, torch.Tensor]:
    """The rows to measure on, refusing private rows without the user's explicit consent."""
    if data == "private":
        if not allow_private:
            raise DpclipError("Hessian diagnostics on the private data are exact functions of it and are not "
                              "covered by ε; they need your explicit consent", PRIVATE_HINT)
        return private_rows
    if data != "public":
        raise DpclipError(f"diagnostics data must be 'public' or 'private', got {data!r}", None)
    if public_rows is None:
        raise DpclipError("no public data to measure the Hessian diagnostics on (the recipe has no 'public:' block)",
                          "add a public: block to the recipe, or measure on the private data with "
                          "--data private --allow-private-not-covered-by-epsilon (the results are not covered by ε)")
    return public_rows


def draw_rows(rows: dict[str, torch.Tensor], size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``size`` rows (all of them if fewer) drawn without replacement with ``generator``."""
    total = len(next(iter(rows.values())))
    chosen = torch.randperm(total, generator=generator, device=generator.device)[:min(size, total)].cpu()
    return {name: tensor[chosen] for name, tensor in rows.items()}


def clip_threshold(engine) -> float:
    """C of the formulas: the clipped sum's sensitivity sqrt(Σ_k C_k²) now (adaptive policies move it)."""
    return float(engine.policy.sensitivity_thresholds().double().norm())


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: such a value is written as null (the formulas say when they occur)."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


def evaluate(diag: HessianDiagnostics, *, sigma: float, batch_size: int, clip_fn: str, threshold: float,
             gamma: float = 0.0, public_batch_size: int | None = None) -> dict[str, Any]:
    """The paper's quantities at the run's σ, B and c (docs/hessian-diagnostics.md): the decelerator,
    B*_DP, ΔL*(B) private and non-private (eqs. (6), (7)), α* when there is public data."""
    c = typical_clip_factor(diag, clip_fn, threshold, gamma)
    return {
        "gradient_noise_multiplier": sigma, "batch_size_dp": batch_size, "clip_fn": clip_fn, "threshold": threshold,
        "clip_factor": c,
        "decelerator": diag.decelerator(sigma, batch_size, c),
        "b_star_dp": diag.b_star_dp(sigma, c),
        "improvement": diag.improvement(batch_size, sigma, c),
        "improvement_non_private": diag.improvement(batch_size, 0.0, 1.0),
        "public_batch_size": public_batch_size,
        "alpha_star": None if public_batch_size is None else diag.alpha_star(public_batch_size, batch_size, sigma, c),
    }


def make_record(step: int, diag: HessianDiagnostics, formulas: dict[str, Any], data: str) -> dict[str, Any]:
    """One line of diagnostics.jsonl: the measurement, the formulas, and its privacy label."""
    record: dict[str, Any] = {"step": step, "data": data, "covered_by_epsilon": data == "public"}
    record.update(diag.to_dict())
    record.update(formulas)
    if data == "private":
        record["not_covered_by_epsilon"] = list(MEASURED)
    return {key: _finite(value) for key, value in record.items()}


def measure_model(model, loss_fn, rows, engine, *, probes: int, per_sample: int,
                  generator: torch.Generator) -> HessianDiagnostics:
    """:func:`dpclip.diagnose.measure` in eval mode (dropout would give every Hessian-vector
    product another objective), outside the engine's book-keeping; the mode is restored."""
    was_training = model.training
    model.eval()
    try:
        if engine is None:
            return measure(model, loss_fn, rows, probes=probes, per_sample=per_sample, generator=generator)
        with engine.paused():
            return measure(model, loss_fn, rows, probes=probes, per_sample=per_sample, generator=generator)
    finally:
        model.train(was_training)


class DiagnosticsRecorder:
    """Measures every ``diagnostics.every_steps`` steps and appends the record to
    ``RUN_DIR/diagnostics.jsonl``; :meth:`finish` draws hessian_over_training.png."""

    def __init__(self, recipe, model, loss_fn, engine, rows: dict[str, torch.Tensor], *, data: str, sigma: float,
                 public_batch_size: int | None):
        self.recipe, self.model, self.loss_fn, self.engine = recipe, model, loss_fn, engine
        self.rows, self.data, self.sigma, self.public_batch_size = rows, data, sigma, public_batch_size
        self.spec = recipe.diagnostics
        # Private randomness (which rows, which probes): OS entropy unless the recipe opts in to seeding.
        self.generator = private_generator(private_seed(recipe), "hessian-diagnostics")
        self._last_step: int | None = None

    def measure(self) -> tuple[HessianDiagnostics, dict[str, Any]]:
        recipe = self.recipe
        batch = draw_rows(self.rows, recipe.training.batch_size, self.generator)
        diag = measure_model(self.model, self.loss_fn, batch, self.engine, probes=self.spec.probes,
                             per_sample=self.spec.per_sample, generator=self.generator)
        formulas = evaluate(diag, sigma=self.sigma, batch_size=recipe.training.batch_size,
                            clip_fn=recipe.clipping.fn, threshold=clip_threshold(self.engine),
                            gamma=recipe.clipping.gamma, public_batch_size=self.public_batch_size)
        return diag, formulas

    def maybe_record(self, step: int, run_dir: Path, on_private=nullcontext) -> None:
        """Measure and append a record when ``step`` is a multiple of every_steps; a step the
        file already holds (a resumed run redoing steps after its checkpoint) is not measured again.
        The measurement (the model on private rows) runs inside ``on_private()``, the write outside."""
        if step % self.spec.every_steps:
            return
        path = Path(run_dir) / DIAGNOSTICS_FILE
        if self._last_step is None:
            # a damaged line is passed over here, not refused: an error here would stop the run
            # with nothing computed; dpclip diagnose names it
            self._last_step = max((r["step"] for r in read_jsonl(path) if is_step(r.get("step"))), default=0)
        if step <= self._last_step:
            return
        with on_private():
            diag, formulas = self.measure()
        append_record(path, make_record(step, diag, formulas, self.data))
        self._last_step = step

    def finish(self, run_dir: Path) -> None:
        """hessian_over_training.png from the run's diagnostics.jsonl."""
        from dpclip.train.diagnostics_plots import HESSIAN_PLOT, plot_hessian_over_training

        records = [r for r in read_jsonl(Path(run_dir) / DIAGNOSTICS_FILE) if is_step(r.get("step"))]
        if records:
            plot_hessian_over_training(records, Path(run_dir) / HESSIAN_PLOT)


class Off:
    """The recorder of a recipe without diagnostics: does nothing."""

    def maybe_record(self, step: int, run_dir: Path, on_private=nullcontext) -> None:
        pass

    def finish(self, run_dir: Path) -> None:
        pass


def public_batch_size(recipe, public_rows) -> int | None:
    """B₀ of α* (eq. (10)): ``continual.public_batch_size``, else the private B;
    None without public data."""
    if public_rows is None:
        return None
    continual = recipe.continual
    return continual.public_batch_size if continual is not None else recipe.training.batch_size


def recorder_for(recipe, *, model, loss_fn, engine, private_data, sigma: float,
                 public_rows: dict[str, torch.Tensor] | None = None):
    """The recorder of a run (σ of the gradient, engine, data known), or a no-op without
    ``diagnostics.every_steps``. ``public_rows``: the public training rows, when the run has
    them loaded (its continual schedule's); otherwise they are loaded from ``recipe.public``."""
    spec = recipe.diagnostics
    if not spec.every_steps:
        return Off()
    public = public_rows_of(recipe, private_data, public_rows=public_rows)  # α* needs it even on private rows
    rows = choose_rows(spec.data, private_rows=private_data.train, public_rows=public,
                       allow_private=spec.private_not_covered)
    return DiagnosticsRecorder(recipe, model, loss_fn, engine, rows, data=spec.data, sigma=sigma,
                               public_batch_size=public_batch_size(recipe, public))
