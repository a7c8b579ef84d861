"""docs/accounting-api.md names every field of the PlanResult it documents, and the call the
training loop records each step with (``event_at``), so that the page cannot fall behind a
new field (issue: participation_events and event_at were missing)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dpclip.accounting import PlanResult

PAGE = Path(__file__).resolve().parents[2] / "docs" / "accounting-api.md"


def plan_section() -> str:
    return re.search(r"^## Plan\n(.*?)(?=^## )", PAGE.read_text(encoding="utf-8"), re.S | re.M).group(1)


def test_the_plan_section_names_every_field_of_plan_result():
    section = plan_section()
    missing = [f.name for f in dataclasses.fields(PlanResult) if f"`{f.name}`" not in section]
    assert not missing, f"docs/accounting-api.md, Plan: name PlanResult's {missing}"


def test_the_plan_section_names_what_the_loop_records_each_step():
    assert hasattr(PlanResult, "event_at") and "`result.event_at(step)`" in plan_section()
    assert "`result.step_metadata`" in plan_section() and isinstance(PlanResult.step_metadata, property)
