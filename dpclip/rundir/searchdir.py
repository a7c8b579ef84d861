"""A search directory as the train layer reads it, and the headline ε of a run directory.

``dpclip tune-cost --run`` (dpclip/tuning/search.py) writes a search directory: its ledger
(one repeat-and-select entry), its summary and the selected run under ``runs/``, which gets
a ``search.json`` marker. Reading those back is here, below the tuning layer, because every
reader of a run's released files needs it: what publishing a run costs is, for the run a
search selected, the search's ε (every trial, the selection and the score), which the run's
own ledger understates. ``dpclip account RUN``, ``dpclip report``, the export's model card
and the audit report ask :func:`headline`, so none can show the run's own ε alone as its cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dp_accounting
from dp_accounting import dp_event

from dpclip import layout
from dpclip.accounting import GRADIENT_RELEASE, Ledger, PrivacyStatement, event_to_dict, training_event
from dpclip.accounting.plan import user_unit
from dpclip.errors import AccountingError, DpclipError
from dpclip.files import read_json
from dpclip.rundir.run import RunDir, load_run_recipe, spent

#: The version of the search directory's summary.json (also how a search directory is recognised).
SEARCH_FORMAT = 1


@dataclass
class SearchRecord:
    """A search directory as ``dpclip account`` reads it (ledger checked, statement built)."""

    search_dir: Path
    ledger: Any
    statement: Any
    summary: dict[str, Any]
    selected_run: Path | None


def is_search_dir(path: Path) -> bool:
    found = RunDir(path)
    if not found.ledger_file.is_file() or found.recipe_file.exists():
        return False
    try:
        return found.summary().get("search_format") == SEARCH_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def search_of_run(run_dir: Path) -> Path | None:
    """The search directory that selected ``run_dir``, or None for an ordinary run.

    The marker file says so; a run inside a search's ``runs/`` is treated as selected even
    without it, so deleting the marker cannot make the run's own ε the one reported."""
    run_dir = Path(run_dir)
    marker = RunDir(run_dir).search_marker
    if marker.exists():
        try:
            pointer = read_json(marker)["search_dir"]
        except (OSError, ValueError, KeyError, TypeError):
            raise DpclipError(f"{marker} is unreadable", "restore it from the search directory's backup; the "
                              "run's own ledger alone understates what publishing it costs") from None
        search_dir = (run_dir / pointer).resolve()
        if not is_search_dir(search_dir):
            raise DpclipError(f"{run_dir} was selected by the search {search_dir}, whose ledger is missing",
                              "restore the search directory: the run's own ledger alone understates what "
                              "publishing it costs")
        return search_dir
    if run_dir.resolve().parent.name == layout.SEARCH_RUNS and is_search_dir(run_dir.resolve().parent.parent):
        return run_dir.resolve().parent.parent
    return None


def _search_parts(event) -> tuple[float, float, int, float | None, float, float]:
    """(q, σ, steps, score noise, mean, shape) of a repeat-and-select event as the search writes it."""
    if not isinstance(event, dp_event.RepeatAndSelectDpEvent):
        raise ValueError("not a repeat-and-select event")
    inner, score_noise = event.event, None
    if isinstance(inner, dp_accounting.ComposedDpEvent):
        if len(inner.events) != 2 or not isinstance(inner.events[1], dp_accounting.GaussianDpEvent):
            raise ValueError("unexpected run event")
        inner, score_noise = inner.events[0], inner.events[1].noise_multiplier
    if not (isinstance(inner, dp_accounting.SelfComposedDpEvent)
            and isinstance(inner.event, dp_accounting.PoissonSampledDpEvent)
            and isinstance(inner.event.event, dp_accounting.GaussianDpEvent)):
        raise ValueError("unexpected training event")
    return (inner.event.sampling_probability, inner.event.event.noise_multiplier, inner.count, score_noise,
            event.mean, event.shape)


def read_search(search_dir: Path) -> SearchRecord:
    """The search's ledger (one repeat-and-select entry, checked against its selected run)
    and the statement of what it spent."""
    search = RunDir(search_dir)
    search_dir, path = search.path, search.ledger_file
    hint = "the search directory was modified: restore it from a backup"
    try:
        ledger = Ledger.from_dict(read_json(path))
        summary = search.summary()
    except (OSError, ValueError, KeyError, TypeError, AccountingError) as exc:
        raise DpclipError(f"{search_dir} is not a readable dpclip search ({exc})", hint) from None
    entries = ledger.entries
    try:
        if ledger.accountant != "rdp" or len(entries) != 1 or entries[0].count != 1:
            raise ValueError("a search ledger holds one repeat-and-select entry (RDP)")
        q, sigma, steps, score_noise, mean, shape = _search_parts(entries[0].event)
    except ValueError as exc:
        raise DpclipError(f"{path} is not a search ledger: {exc}", hint) from None
    metadata = entries[0].metadata or {}

    selected, run_recipe, run_statement = None, None, None
    if summary.get("selected_run_dir"):
        selected = (search_dir / summary["selected_run_dir"]).resolve()
        if selected.parent != search.search_runs.resolve():
            raise DpclipError(f"{Path(search_dir) / layout.SUMMARY} names {summary['selected_run_dir']!r}, which is not "
                              "one of its runs", hint)
        run_ledger, run_statement = spent(selected)  # checked against the run's own recipe
        if event_to_dict(run_ledger.composed_event()) != event_to_dict(training_event(q, sigma, steps)):
            raise DpclipError(f"{path} does not describe the training of its selected run {selected}", hint)
        run_recipe = load_run_recipe(selected)
    seeded = bool(metadata.get("seeded_randomness") or summary.get("seeded_randomness")
                  or (run_recipe is not None and run_recipe.privacy.unsafe_seeded_randomness))
    # the loader's setting; the ledger names what ran ("cyclic", "cyclic-poisson": Poisson-accounted groups)
    written = "shuffle" if metadata.get("sampling") == "shuffle" else "poisson"
    sampling = run_recipe.training.sampling if run_recipe is not None else written
    statement = _statement(ledger, q, sigma, steps, score_noise, mean, shape, seeded, sampling, run_recipe,
                           run_statement, metadata)
    return SearchRecord(search_dir, ledger, statement, summary, selected)


#: What a private selection score is, by privacy unit (each of sensitivity 1).
SCORE_MEANING = {
    "example": "(correct held-out predictions + N(0, score_noise²)) / held-out size",
    "user": "(Σ over held-out people of each one's accuracy + N(0, score_noise²)) / held-out people",
}


def _statement(ledger, q, sigma, steps, score_noise, mean, shape, seeded, sampling, run_recipe, run_statement,
               metadata):
    result = ledger.result()
    # Banded MF: the event is ⌈T/b⌉ participations at q·b; the statement states q, the T steps and the b groups.
    bands = run_statement.bands if run_statement is not None else int(metadata.get("bands") or 1)
    if bands > 1:
        q = run_statement.sample_rate if run_statement is not None else metadata.get("sample_rate", q / bands)
        steps = run_statement.steps if run_statement is not None else int(metadata.get("steps_per_run") or steps)
    law = "logarithmic" if shape == 0 else "geometric" if shape == 1 else f"truncated negative binomial η = {shape:g}"
    batches = (f"steps over {bands} cyclic Poisson groups (banded MF; see mechanism)" if bands > 1
               else "Poisson-sampled steps" if sampling == "poisson"
               else "steps on fixed-size shuffled batches, accounted as if Poisson-sampled (see the caveat)")
    releases = [
        f"the best of K trial runs (repeat-and-select, Papernot & Steinke 2022): K ~ {law} with E[K] = {mean:g}, "
        f"secret; only the selected run and its score are released; each run: {steps} {batches}",
        *(run_statement.releases if run_statement is not None else [GRADIENT_RELEASE]),
    ]
    uncovered = list(run_statement.not_covered) if run_statement is not None else []
    users = (run_recipe.privacy.unit if run_recipe is not None else metadata.get("unit")) == "user"
    if score_noise is not None:
        releases.append(f"selection score, charged to every trial: {SCORE_MEANING['user' if users else 'example']} "
                        f"(noise std {score_noise:g}, sensitivity 1)")
    else:
        uncovered.append("selection score: exact held-out accuracy, the held-out split being public data by the "
                         "recipe's claim (tuning.score: public)")
    return PrivacyStatement(
        epsilon=result.epsilon, delta=ledger.delta, accountant=result.accountant, conversion=result.conversion,
        sample_rate=q, steps=steps, noise_multiplier=sigma, bands=bands,
        gradient_noise_multiplier=run_statement.gradient_noise_multiplier if run_statement is not None else sigma,
        sigma_aux=run_statement.sigma_aux if run_statement is not None else None, sampling=sampling, releases=releases,
        fallback_reason=result.fallback_reason, seeded_randomness=seeded, not_covered=uncovered,
        world_size=run_statement.world_size if run_statement is not None else 1,
        **({"unit": run_statement.unit, "neighbouring": run_statement.neighbouring} if run_statement is not None
           else user_unit(None, metadata.get("max_examples_per_user")) if users else {}))


def search_statement_lines(search_dir: Path) -> list[str]:
    return read_search(search_dir).statement.lines()


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
    stopped = search.summary.get("stopped")
    if stopped != "completed":
        raise DpclipError(f"{run_dir} is a trial of the search {search_dir}, which did not finish (stopped: {stopped}"
                          + (": killed, or still running)" if stopped == "running" else ")"),
                          "an unfinished search releases nothing, none of its trials included (the best of fewer "
                          "trials is not what its ledger charges); its charge stands: a new `tune-cost --run` is "
                          "a new search, charged again")
    if search.selected_run is None or search.selected_run != run_dir.resolve():
        raise DpclipError(f"{run_dir} points to the search {search_dir}, which did not select it",
                          "the run directory or the search directory was modified: restore them; a trial that "
                          "was not selected is not a release")
    return Headline(search.statement, search.ledger, run_statement, run_ledger, search_dir)
