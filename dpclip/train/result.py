"""What a training run returns (:class:`TrainResult`) and what a caller implements to
watch it (:class:`TrainObserver`; the CLI's progress display is one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


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
    # How the key=value overrides moved σ (or ε) from the recipe file's plan; None if they did not.
    sigma_change: dict[str, Any] | None = None
    # Non-privacy fields a resume changed: {dotted field: [old, new]} (empty for a fresh run).
    resume_changes: dict[str, list[Any]] = field(default_factory=dict)
    # Wall time of this process's private steps: in memory only, never written (it follows
    # the realised batch sizes; tune-cost's fixed-cost measurement subtracts it).
    step_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir), "steps_done": self.steps_done, "steps_planned": self.steps_planned,
            "epsilon": self.epsilon, "epsilon_rdp": self.epsilon_rdp, "delta": self.delta,
            "stopped": self.stopped, "final_eval": self.final_eval, "noise": self.noise,
            "statement": self.statement, "sigma_change": self.sigma_change, "resume_changes": self.resume_changes,
            # final_eval is exact, on the private held-out split (empty when diagnostics are off).
            "not_covered_by_epsilon": ["final_eval"] if self.final_eval else [],
        }


class NullObserver:
    """The observer of a caller that watches nothing (and of every rank but 0)."""

    def on_start(self, info): pass
    def on_step(self, record): pass
    def on_eval(self, record): pass
    def on_end(self, result): pass
