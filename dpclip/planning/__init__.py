"""Planning: a recipe (or command-line sizes) -> the privacy plan and statement a run will
follow. Below train/: ``dpclip account``, ``dpclip validate``, tune-cost and the training
loop all read the plan from here, so they cannot disagree (docs/design.md)."""
