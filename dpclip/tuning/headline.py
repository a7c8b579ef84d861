"""The headline ε of a run directory: what publishing the run costs.

For an ordinary run, its own ledger. For the run a ``tune-cost --run`` search selected,
the search's ledger (repeat-and-select: every trial, the selection and the score), which
the run's own ledger understates. Every place that shows a run's ε as the ε of the run
(``dpclip account RUN``, ``dpclip report``, the export's model card, the selected run's
TensorBoard) asks :func:`headline`, so none can show the run's own ε alone as its cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpclip.errors import DpclipError
from dpclip.train.rundir import spent
from dpclip.tuning.search import read_search, search_of_run


@dataclass(frozen=True)
class Headline:
    """``statement``/``ledger``: what publishing the run costs; ``run_*``: its own training alone."""

    statement: Any
    ledger: Any
    run_statement: Any
    run_ledger: Any
    search_dir: Path | None = None

    @property
    def epsilon(self) -> float:
        if self.search_dir is None and not self.run_ledger.steps:
            return 0.0  # nothing released yet
        return self.statement.epsilon

    @property
    def delta(self) -> float:
        return self.statement.delta

    def selected_by(self) -> dict[str, Any] | None:
        """For a run a search selected: the search, its ε and δ, and the run's ε alone; else None."""
        if self.search_dir is None:
            return None
        return {"search_dir": str(self.search_dir), "epsilon": self.statement.epsilon,
                "delta": self.statement.delta, "run_epsilon_alone": self.run_statement.epsilon}


def headline(run_dir: Path) -> Headline:
    """The headline ε of ``run_dir``: the ε of everything released with it, a search included.

    Raises for a trial the search did not select (not a release) and for a selected run
    whose search directory is gone (its own ledger alone would understate the cost)."""
    run_dir = Path(run_dir)
    search_dir = search_of_run(run_dir)
    run_ledger, run_statement = spent(run_dir)
    if search_dir is None:
        return Headline(run_statement, run_ledger, run_statement, run_ledger)
    search = read_search(search_dir)
    if search.selected_run is None or search.selected_run != run_dir.resolve():
        raise DpclipError(f"{run_dir} points to the search {search_dir}, which did not select it",
                          "the run directory or the search directory was modified: restore them; a trial that "
                          "was not selected is not a release")
    return Headline(search.statement, search.ledger, run_statement, run_ledger, search_dir)
