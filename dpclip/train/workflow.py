"""The training workflow: recipe -> data, model, engine, ledger -> run directory.

One step: draw a Poisson batch, run its micro-batches through ``engine.backward``,
``engine.privatize()`` (clip, noise, DpEvent), check the budget cap, ``optimizer.step()``,
record the DpEvent in the ledger. Nothing else touches the private data, except the
diagnostics in metrics.jsonl (training loss, clip fractions, norm quantiles), which are
computed without noise, are not covered by ε, and are labelled so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dpclip.errors import DpclipError
from dpclip.recipe import Recipe, recipe_to_yaml
from dpclip.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dpclip.train.files import read_json, write_json_atomic, write_text_atomic
from dpclip.train.plan import count_groups, engine_clipping, private_seed
from dpclip.train.rundir import (
    _append_metrics, _check_canaries, _check_same_release, _meta, _privacy_diff, _read_ledger,
    _released_part, _released_records, check_ledger, load_run_recipe, new_run_dir,
    privacy_fingerprint, run_statement)


class TrainObserver(Protocol):
    """What the CLI implements to show progress (all optional)."""

    def on_start(self, info: dict[str, Any]) -> None: ...
    def on_step(self, record: dict[str, Any]) -> None: ...
    def on_eval(self, record: dict[str, Any]) -> None: ...
    def on_end(self, result: TrainResult) -> None: ...


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    steps_planned: int
    epsilon: float
    epsilon_rdp: float
    delta: float
    stopped: str                      # "completed" | "budget" | "interrupted" | "dry-run"
    final_eval: dict[str, float] = field(default_factory=dict)
    statement: list[str] = field(default_factory=list)
    noise: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir), "steps_done": self.steps_done, "steps_planned": self.steps_planned,
            "epsilon": self.epsilon, "epsilon_rdp": self.epsilon_rdp, "delta": self.delta,
            "stopped": self.stopped, "final_eval": self.final_eval, "noise": self.noise,
            "statement": self.statement,
            # final_eval is exact, on the private held-out split (empty when diagnostics are off).
            "not_covered_by_epsilon": ["final_eval"] if self.final_eval else [],
        }


def _build_optimizer(config, params) -> torch.optim.Optimizer:
    if config.kind == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay)
    if config.kind == "adam":
        return torch.optim.Adam(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay)


def lr_factor(schedule, step: int, total_steps: int) -> float:
    """Multiplier of the base lr at ``step`` (0-based): linear warmup, then constant/linear/cosine decay."""
    if schedule.warmup_steps and step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.kind == "constant":
        return 1.0
    span = max(total_steps - schedule.warmup_steps, 1)
    progress = min(max(step - schedule.warmup_steps, 0) / span, 1.0)
    final = schedule.final_lr_fraction
    if schedule.kind == "linear":
        return 1.0 - (1.0 - final) * progress
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _engine_clipping(recipe: Recipe, split) -> dict[str, Any]:
    """The clipping dict for DPEngine, with the statistic's σ from the budget split filled in."""
    return engine_clipping(recipe, split.sigma_aux)


class _Null:
    def on_start(self, info): pass
    def on_step(self, record): pass
    def on_eval(self, record): pass
    def on_end(self, result): pass


def train(recipe: Recipe | None = None, *, resume: Path | None = None, dry_run: bool = False,
          observer: TrainObserver | None = None, data=None, run_dir: Path | None = None) -> TrainResult:
    """Train ``recipe`` privately (or resume the run in ``resume``); see the module doc.

    Two keyword arguments serve ``dpclip audit-mia``'s shadow models (LiRA), which train
    the same recipe on a chosen subset of examples: ``data`` (a PrivateData) replaces
    what ``recipe.data`` would load, and ``run_dir`` is the exact directory of a new run
    instead of a fresh ``output_dir/name-TIMESTAMP``. Pass the same ``data`` to resume.
    """
    from dpclip.accounting import Ledger, solve
    from dpclip.data import PoissonSampler, ShuffleSampler, load_data, micro_batches, select
    from dpclip.engine import DPEngine, build_groups, trainable_params
    from dpclip.models import build_model, evaluate
    from dpclip.train.plan import privacy_plan

    observer = observer or _Null()
    if resume is not None:
        resume = Path(resume)
        stored = load_run_recipe(resume)
        meta = read_json(resume / "meta.json")
        if meta.get("privacy_fingerprint") != privacy_fingerprint(stored):
            raise DpclipError(f"the privacy fields of {resume / 'recipe.yaml'} were edited after the run started",
                              "the ledger would no longer describe the run; restore recipe.yaml or start a new run")
        if recipe is not None:
            changed = _privacy_diff(stored, recipe)
            if changed:
                raise DpclipError(f"cannot resume: the recipe changes privacy fields {', '.join(changed)} "
                                  "of the run", "resume with the run's own recipe: dpclip train --resume RUN_DIR")
        recipe = stored
    if recipe is None:
        raise DpclipError("nothing to train", "pass a recipe file, or --resume RUN_DIR")

    # The global RNG drives only what is not private (dropout); noise and batches have their own
    # generators from OS entropy (dpclip.rng).
    torch.manual_seed(recipe.seed)
    if data is None:
        data = load_data(recipe.data, seed=recipe.seed)
    model, loss_fn = build_model(recipe.model, data, seed=recipe.seed)
    training = recipe.training
    micro_batch_size = training.micro_batch_size or training.batch_size
    threshold = recipe.clipping.threshold
    # A top-fraction tail rule ranks the whole logical batch, which therefore must reach the
    # engine in one backward, however large the Poisson draw is.
    whole_batch = threshold.kind == "discriminative" and threshold.tail_rule == "top_fraction"

    # A statistic's sensitivity grows with the number of groups, which depends on the model.
    num_groups = count_groups(recipe, model)
    # N is the number of ordinary training examples, counted before any canary goes in
    # (see dpclip.data.canaries: q = B/N applies to canaries too, as `dpclip account` says).
    plan = privacy_plan(recipe, data.num_train, groups=num_groups)
    ordinary = data
    canaries = None
    if recipe.audit.canaries is not None:
        from dpclip.data.canaries import make_canaries, with_canaries

        canaries = make_canaries(data, recipe.audit.canaries, recipe.seed)
        data = with_canaries(data, canaries)
    solved = solve(plan)
    split = solved.split
    # Private randomness (noise, batches) comes from OS entropy unless the recipe opts in.
    seed_of_noise = private_seed(recipe)
    engine = DPEngine(model, _engine_clipping(recipe, split), noise_multiplier=split.sigma_gradient,
                      expected_batch_size=training.batch_size, seed=seed_of_noise, sample_rate=plan.sample_rate)
    optimizer = _build_optimizer(training.optimizer, [p for p in model.parameters() if p.requires_grad])
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    if training.sampling == "poisson":
        sampler = PoissonSampler(data.num_train, plan.sample_rate, plan.steps, seed=seed_of_noise)
    else:
        sampler = ShuffleSampler(data.num_train, training.batch_size, plan.steps, seed=seed_of_noise)
    ledger = Ledger(plan.delta, plan.accountant)
    epsilon_cap = recipe.privacy.epsilon
    diagnostics = recipe.privacy.exact_diagnostics

    info = {
        "name": recipe.name, "steps": plan.steps, "sample_rate": plan.sample_rate,
        "num_train": ordinary.num_train, "num_test": data.num_test,
        "canaries_included": None if canaries is None else int(canaries.included.sum()),
        "groups": engine.group_names, "sigma_total": split.sigma_total,
        "sigma_gradient": split.sigma_gradient, "sigma_aux": split.sigma_aux, "planned_epsilon": solved.epsilon,
        "delta": plan.delta, "accountant": plan.accountant, "epsilon_cap": epsilon_cap,
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "seeded_randomness": recipe.privacy.unsafe_seeded_randomness, "exact_diagnostics": diagnostics,
    }
    if dry_run:
        observer.on_start({**info, "run_dir": None, "dry_run": True})
        engine.detach()
        result = TrainResult(Path("-"), 0, plan.steps, solved.epsilon, solved.epsilon_rdp, plan.delta, "dry-run",
                             statement=solved.statement.lines(), noise=solved.step_metadata)
        observer.on_end(result)
        return result

    def save(step: int) -> None:
        # The ledger goes to disk before the checkpoint that depends on it is made current.
        write_ledger(step)
        state = {
            "step": step, "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
            "engine": engine.state_dict(), "torch_rng": torch.get_rng_state(), "ledger": ledger.to_dict(),
        }
        save_checkpoint(run_dir, step, model, state, keep=recipe.checkpoint.keep)

    # ledger.json counts every release that has left the process; after a crash it may be
    # ahead of the checkpoint we resume from, and it never moves back.
    released_steps = 0

    def write_ledger(step: int, every_step: bool = False) -> None:
        # Every step: no fsync (the rename is atomic against a killed process, the crash
        # that matters) and no ε (~0.1 s to compute); at checkpoints and the end: both.
        if ledger.steps >= released_steps:
            write_json_atomic(run_dir / "ledger.json", ledger.to_dict(with_epsilon=not every_step),
                              durable=not every_step)

    start_step = 0
    replay: dict[int, dict[str, Any]] = {}
    if resume is not None:
        run_dir = resume
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise DpclipError(f"{run_dir} has no checkpoint to resume from",
                              "the run stopped before its first step was saved; start a new run")
        state = load_checkpoint(checkpoint, model)
        start_step = int(state["step"])
        ledger = Ledger.from_dict(state["ledger"])
        check_ledger(ledger, solved.step_event, start_step, where=checkpoint / "state.json")
        released = _read_ledger(run_dir / "ledger.json") if (run_dir / "ledger.json").exists() else ledger
        check_ledger(released, solved.step_event, range(start_step, plan.steps + 1), where=run_dir / "ledger.json")
        released_steps = released.steps
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        engine.load_state_dict(state["engine"])
        torch.set_rng_state(state["torch_rng"])
        # Steps after the checkpoint that already left the process are redone with the
        # checkpoint's generator states, so they must release exactly what they did.
        replay = _released_records(run_dir / "metrics.jsonl", start_step)
        if canaries is not None:
            _check_canaries(run_dir, canaries)
    else:
        if run_dir is None:
            run_dir = new_run_dir(recipe)
        run_dir = Path(run_dir)
        if (run_dir / "recipe.yaml").exists():
            raise DpclipError(f"{run_dir} already holds a run", "resume it with --resume, or choose a new folder")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "recipe.yaml", recipe_to_yaml(recipe))
        write_json_atomic(run_dir / "meta.json", _meta(recipe, ordinary, info))
        if canaries is not None:
            from dpclip.data.canaries import write_canary_secret

            write_canary_secret(run_dir, canaries)
        (run_dir / "metrics.jsonl").touch()
        # Step 0 is checkpointed (with the generators' states) so that a crash before the
        # first regular checkpoint resumes into the same noise and batches.
        save(0)
    write_ledger(start_step)

    step_metadata = solved.step_metadata
    observer.on_start({**info, "run_dir": str(run_dir), "start_step": start_step, "dry_run": False})

    def emit(record: dict[str, Any], kind: str) -> None:
        """Write a record and show it, unless it replays one that already left the process."""
        previous = replay.get((kind, record["step"]))
        if previous is not None:
            if _released_part(previous) != _released_part(record):
                raise DpclipError(
                    f"resuming did not reproduce step {record['step']} as first run (its released "
                    "statistics differ), so continuing would release them twice",
                    "resume with the same dpclip and torch versions, device and thread count as the run "
                    "started with, or start a new run")
            return
        _append_metrics(run_dir / "metrics.jsonl", record)
        (observer.on_step if kind == "step" else observer.on_eval)(record)

    def run_eval(step: int) -> dict[str, float]:
        if not diagnostics:  # exact held-out metrics are not covered by ε: off with the diagnostics
            return {}
        metrics = evaluate(model, loss_fn, data.test, data.task, batch_size=recipe.eval.batch_size)
        emit({"step": step, "eval": metrics, "not_covered_by_epsilon": ["eval"]}, "eval")
        return metrics

    stopped, step, final_eval = "completed", start_step, {}
    epsilon_every = max(1, plan.steps // 50)  # ε with the ledger's accountant costs ~0.1 s: not every step
    model.train()
    with _deferred_interrupt() as interrupt:
        try:
            batches = iter(sampler)
            while step < plan.steps:
                if interrupt.requested:  # Ctrl-C is honoured between steps only, never inside one
                    stopped = "interrupted"
                    break
                # The cap is checked before the batch is touched, with the plan's event, which
                # is asserted below to be the event the engine actually releases.
                if epsilon_cap is not None and not ledger.allows(solved.step_event, epsilon_cap):
                    stopped = "budget"
                    break
                indices = next(batches)
                factor = lr_factor(training.schedule, step, plan.steps)
                for group, base in zip(optimizer.param_groups, base_lrs):
                    group["lr"] = base * factor
                loss_sum, started = 0.0, time.perf_counter()
                for chunk in micro_batches(indices, max(len(indices), 1) if whole_batch else micro_batch_size):
                    losses = loss_fn(model, select(data.train, chunk))
                    loss_sum += float(losses.detach().sum())
                    engine.backward(losses)
                report = engine.privatize()
                _check_same_release(report.dp_event, solved.step_event)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ledger.record(solved.step_event, metadata=step_metadata)
                step += 1
                # Charged before anything of this step leaves the process (a crash between
                # the two leaves the ledger ahead, never behind).
                write_ledger(step, every_step=True)
                live = step == plan.steps or step % epsilon_every == 0
                record = _step_record(step, report, ledger.epsilon() if live else None, loss_sum, len(indices),
                                      training.batch_size, optimizer.param_groups[0]["lr"],
                                      time.perf_counter() - started, recipe.clipping.fn, diagnostics)
                emit(record, "step")
                if recipe.eval.every_steps and step % recipe.eval.every_steps == 0 and step < plan.steps:
                    run_eval(step)
                if recipe.checkpoint.every_steps and step % recipe.checkpoint.every_steps == 0:
                    save(step)
        finally:
            engine.detach()
    if stopped != "interrupted":
        final_eval = run_eval(step)
    save(step)
    accounting = ledger.result()
    statement = run_statement(recipe, ledger)
    result = TrainResult(run_dir, step, plan.steps, accounting.epsilon, accounting.epsilon_rdp, plan.delta, stopped,
                         final_eval, statement.lines(), step_metadata)
    write_json_atomic(run_dir / "summary.json", result.to_dict())
    from dpclip.train.plots import plot_thresholds

    plot_thresholds(run_dir / "metrics.jsonl", run_dir / "thresholds.png", engine.group_names)
    observer.on_end(result)
    return result


class _deferred_interrupt:
    """Turn Ctrl-C into a flag the loop reads between steps, so a step is never half done
    (a gradient applied but not yet in the ledger). A second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _step_record(step, report, epsilon, loss_sum, batch_len, expected_batch, lr, seconds, clip_fn,
                 diagnostics: bool = True) -> dict[str, Any]:
    summary = report.to_dict()
    record = {
        "step": step,
        "epsilon": epsilon,
        "lr": lr,
        "seconds": round(seconds, 4),
        "thresholds": summary["thresholds"],
        "noise_std": summary["noise_std_grad"],
        "policy": summary["policy_summary"] or None,
    }
    if diagnostics:
        # Computed WITHOUT noise from the private batch: not covered by ε, and marked so.
        record["diagnostics"] = {
            "train_loss": loss_sum / expected_batch,
            "batch_size": batch_len,
            "clip_fraction": None if clip_fn == "auto" else summary["clip_fraction"],
            "norm_median": summary["norm_quantiles"].get("median"),
            "nonfinite": summary["nonfinite"],  # samples dropped for a non-finite norm, per group
        }
        record["not_covered_by_epsilon"] = ["diagnostics"]
    return record


