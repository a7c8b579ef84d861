"""The privacy ledger: every release of private data a run makes, and its ε so far.

docs/accounting-api.md: every use of private data that leaves the engine is a ``DpEvent`` recorded
here; if it is not in the ledger, it is a privacy bug. The ledger is saved as
``ledger.json`` in the run directory and inside every checkpoint, so a resumed run
continues it exactly.

Storage is run-length compressed: recording the same (event, metadata) as the last
entry only increases that entry's count, so 10⁵ identical steps are one entry. For
accounting, consecutive entries with the same event (whatever their metadata) form one
run, composed as ``SelfComposedDpEvent(event, n)``; the cost of ε therefore depends
on the number of distinct runs, not on the number of steps.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dp_accounting

from dpclip.accounting.accountants import AccountingResult, check_accountant, check_delta_value, account
from dpclip.accounting.events import event_from_dict, event_to_dict
from dpclip.errors import AccountingError

__all__ = ["Ledger", "LedgerEntry", "LEDGER_FORMAT"]

LEDGER_FORMAT = "dpclip.ledger/1"

# How many distinct ledger states keep their accounting result: the current one and a
# few "what if" states are enough for the record/epsilon_if pattern of a training loop.
_CACHE_SIZE = 8


@dataclass(frozen=True)
class LedgerEntry:
    """``count`` consecutive recordings of ``event`` with the same ``metadata``."""

    event: dp_accounting.DpEvent
    count: int
    metadata: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"event": event_to_dict(self.event), "count": self.count, "metadata": self.metadata}


def _event_key(event: dp_accounting.DpEvent) -> str:
    """Canonical text of an event: equal events have equal keys (used for runs and caches)."""
    return json.dumps(event_to_dict(event), sort_keys=True)


def _normalise_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A JSON round-trip copy, so a saved and reloaded ledger compares equal to the original."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise AccountingError(
            f"metadata must be a mapping, got {type(metadata).__name__}",
            "pass a dict such as PlanResult.step_metadata",
        )
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise AccountingError(
            f"metadata is not JSON-serialisable: {exc}",
            "use only strings, finite numbers, booleans, None, lists and dicts",
        ) from exc


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise AccountingError(f"count must be an integer >= 1, got {count!r}", "count is a number of steps")


def _finite_or_none(x: float) -> float | None:
    # JSON has no infinity; an infinite ε (a non-private release) is stored as null.
    return x if math.isfinite(x) else None


class Ledger:
    """Run-length compressed list of DpEvents with cached ε at a fixed δ.

    Args:
        delta: the δ at which ε is reported.
        accountant: "pld" (default; falls back to RDP with a reason when PLD fails) or "rdp".
    """

    def __init__(self, delta: float, accountant: str = "pld"):
        check_delta_value(delta)
        check_accountant(accountant)
        self.delta = float(delta)
        self.accountant = accountant
        self._entries: list[LedgerEntry] = []
        self._keys: list[str] = []  # _event_key of each entry's event
        self._results: OrderedDict[tuple, AccountingResult] = OrderedDict()
        self._rdp_room: dict[tuple, int] = {}

    # ----------------------------------------------------------------- recording

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    @property
    def steps(self) -> int:
        """Total number of recordings (the sum of the entries' counts)."""
        return sum(entry.count for entry in self._entries)

    def record(self, event: dp_accounting.DpEvent, count: int = 1, metadata: Mapping[str, Any] | None = None) -> None:
        """Append ``count`` occurrences of ``event`` (merged into the last entry when identical)."""
        if event is None:
            raise AccountingError(
                "this step has no DpEvent of its own: its noise is correlated with other steps' (DPEngine's "
                "noise_correlation), so composing one event per step is not its accounting",
                "sample with PoissonSampler(..., groups=G) and record solve(plan).event_at(step) of a PrivacyPlan "
                "with the same bands or buffers, as dpclip train does (docs/formulas.md, \"Banded matrix "
                "factorization\", \"BLT\")",
            )
        if not isinstance(event, dp_accounting.DpEvent):
            raise AccountingError(
                f"expected a DpEvent, got {type(event).__name__}",
                "record the dp_event of the engine's StepReport or PlanResult.step_event",
            )
        _check_count(count)
        key = _event_key(event)  # also checks the event can be saved
        meta = _normalise_metadata(metadata)
        if self._entries and self._keys[-1] == key and self._entries[-1].metadata == meta:
            last = self._entries[-1]
            self._entries[-1] = LedgerEntry(last.event, last.count + count, last.metadata)
        else:
            self._entries.append(LedgerEntry(event, count, meta))
            self._keys.append(key)

    # ---------------------------------------------------------------- accounting

    def _runs(self) -> list[tuple[str, dp_accounting.DpEvent, int]]:
        """Consecutive entries with the same event merged: (key, event, total count).

        ``NoOpDpEvent`` entries (the uncharged steps of a banded-MF cycle, docs/formulas.md)
        cost nothing and are left out, so the charged steps on either side form one run."""
        runs: list[tuple[str, dp_accounting.DpEvent, int]] = []
        for key, entry in zip(self._keys, self._entries):
            if isinstance(entry.event, dp_accounting.NoOpDpEvent):
                continue
            if runs and runs[-1][0] == key:
                runs[-1] = (key, runs[-1][1], runs[-1][2] + entry.count)
            else:
                runs.append((key, entry.event, entry.count))
        return runs

    @staticmethod
    def _with(runs: list, key: str, event: dp_accounting.DpEvent, count: int) -> list:
        """``runs`` after ``count`` more occurrences of ``event`` (merged if it continues the last run)."""
        if isinstance(event, dp_accounting.NoOpDpEvent):
            return runs
        if runs and runs[-1][0] == key:
            return runs[:-1] + [(key, runs[-1][1], runs[-1][2] + count)]
        return runs + [(key, event, count)]

    @staticmethod
    def _compose(runs: list) -> dp_accounting.DpEvent:
        parts = [dp_accounting.SelfComposedDpEvent(event, count) for _, event, count in runs]
        if not parts:
            return dp_accounting.NoOpDpEvent()
        if len(parts) == 1:
            return parts[0]
        return dp_accounting.ComposedDpEvent(parts)

    def _account(self, runs: list, accountant: str | None = None) -> AccountingResult:
        accountant = accountant or self.accountant
        signature = (accountant, tuple((key, count) for key, _, count in runs))
        if signature in self._results:
            self._results.move_to_end(signature)
            return self._results[signature]
        result = account(self._compose(runs), self.delta, accountant)
        self._results[signature] = result
        if len(self._results) > _CACHE_SIZE:
            self._results.popitem(last=False)
        return result

    def composed_event(self) -> dp_accounting.DpEvent:
        """Everything recorded, as one event: Composed of SelfComposed(event, n) per run."""
        return self._compose(self._runs())

    def result(self) -> AccountingResult:
        """ε so far with its accountant, RDP ε alongside and any PLD fallback reason (cached)."""
        return self._account(self._runs())

    def epsilon_at(self, delta: float) -> float:
        """ε of everything recorded, at another δ than the ledger's (its own accountant)."""
        check_delta_value(delta)
        return account(self._compose(self._runs()), float(delta), self.accountant).epsilon

    def epsilon(self) -> float:
        """ε spent so far at the ledger's δ (cached until the next record)."""
        return self.result().epsilon

    @property
    def fallback_reason(self) -> str | None:
        return self.result().fallback_reason

    def result_if(self, event: dp_accounting.DpEvent, count: int = 1) -> AccountingResult:
        """The accounting result the ledger would have after ``record(event, count)``."""
        _check_count(count)
        return self._account(self._with(self._runs(), _event_key(event), event, count))

    def epsilon_if(self, event: dp_accounting.DpEvent, count: int = 1) -> float:
        """ε after ``record(event, count)``, without recording.

        Built exactly as :meth:`epsilon` would build it after the record, and cached, so
        the usual loop ``if ledger.epsilon_if(e) <= cap: step; ledger.record(e)`` costs
        one accountant call per step, not two.
        """
        return self.result_if(event, count).epsilon

    def allows(self, event: dp_accounting.DpEvent, epsilon_cap: float, count: int = 1) -> bool:
        """Whether recording ``count`` more ``event``\\ s keeps ε <= ``epsilon_cap`` (budget cap).

        Same answer as ``epsilon_if(event, count) <= epsilon_cap``, but O(1) per step for
        most of a run: dpclip's reported ε is never above the RDP ε (PLD falls back to RDP
        when looser), so while the RDP ε after the step is within the cap the step is
        allowed. The number of further steps RDP allows is found once per run of
        identical events (a search over the count, monotone because RDP adds up); beyond
        it, the exact ε of the ledger's accountant decides.
        """
        _check_count(count)
        if not isinstance(epsilon_cap, (int, float)) or not epsilon_cap > 0:
            raise AccountingError(f"ε cap must be > 0, got {epsilon_cap!r}", "the cap is the recipe's target ε")
        if isinstance(event, dp_accounting.NoOpDpEvent):  # costs nothing: allowed if the ledger is within the cap
            return self.epsilon() <= epsilon_cap
        key = _event_key(event)
        runs = self._runs()
        if runs and runs[-1][0] == key:
            prefix, done = runs[:-1], runs[-1][2]
        else:
            prefix, done = runs, 0
        if done + count <= self._rdp_steps_within(prefix, key, event, float(epsilon_cap)):
            return True
        if self.accountant == "rdp":
            return False  # the RDP search above was already exact
        return self.epsilon_if(event, count) <= epsilon_cap

    def _rdp_steps_within(self, prefix: list, key: str, event: dp_accounting.DpEvent, cap: float) -> int:
        """Largest n with RDP ε(prefix + n × event) <= cap (capped at 2⁴⁰), cached."""
        cache_key = (tuple((k, c) for k, _, c in prefix), key, cap)
        if cache_key not in self._rdp_room:

            def fits(n: int) -> bool:
                runs = prefix + [(key, event, n)]
                return account(self._compose(runs), self.delta, "rdp").epsilon <= cap

            if not fits(1):
                room = 0
            else:
                good, bad = 1, 2
                while bad <= 2**40 and fits(bad):
                    good, bad = bad, bad * 2
                if bad > 2**40:
                    room = good
                else:
                    while bad - good > 1:  # invariant: fits(good) and not fits(bad)
                        mid = (good + bad) // 2
                        good, bad = (mid, bad) if fits(mid) else (good, mid)
                    room = good
            self._rdp_room[cache_key] = room
        return self._rdp_room[cache_key]

    # ------------------------------------------------------------- persistence

    def to_dict(self, with_epsilon: bool = True) -> dict[str, Any]:
        """JSON-safe dict: δ, accountant, entries, and (for readers) ε so far.

        The stored ε is informative only: :meth:`from_dict` recomputes it from the
        entries, so an edited number in a file can never become the reported ε.
        Infinite ε (a non-private release) is stored as null. ``with_epsilon=False`` leaves
        the ε fields out (computing them costs ~0.1 s; a training loop that saves its
        ledger every step does so without them).
        """
        out = {
            "format": LEDGER_FORMAT,
            "delta": self.delta,
            "accountant": self.accountant,
            "steps": self.steps,
        }
        if with_epsilon:
            result = self.result()
            out.update({
                "epsilon": _finite_or_none(result.epsilon),
                "epsilon_rdp": _finite_or_none(result.epsilon_rdp),
                "accountant_used": result.accountant,
                "fallback_reason": result.fallback_reason,
            })
        out["entries"] = [entry.to_dict() for entry in self._entries]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Ledger":
        """Rebuild a ledger written by :meth:`to_dict` (ε is recomputed, not trusted)."""
        hint = "the ledger file was written by another dpclip version or edited by hand"
        if not isinstance(d, Mapping) or d.get("format") != LEDGER_FORMAT:
            raise AccountingError(f"not a dpclip ledger (expected format {LEDGER_FORMAT!r})", hint)
        for name in ("delta", "accountant", "entries"):
            if name not in d:
                raise AccountingError(f"ledger is missing {name!r}", hint)
        ledger = cls(d["delta"], d["accountant"])
        if not isinstance(d["entries"], list):
            raise AccountingError("ledger entries must be a list", hint)
        for item in d["entries"]:
            if not isinstance(item, Mapping) or set(item) != {"event", "count", "metadata"}:
                raise AccountingError(f"malformed ledger entry: {item!r}", hint)
            event = event_from_dict(item["event"])
            _check_count(item["count"])
            # Appended directly (not via record) so the stored entry boundaries survive.
            ledger._entries.append(LedgerEntry(event, item["count"], _normalise_metadata(item["metadata"])))
            ledger._keys.append(_event_key(event))
        return ledger

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ledger):
            return NotImplemented
        return (self.delta, self.accountant, self._entries) == (other.delta, other.accountant, other._entries)

    def __repr__(self) -> str:
        return f"Ledger(delta={self.delta!r}, accountant={self.accountant!r}, steps={self.steps}, runs={len(self._runs())})"
