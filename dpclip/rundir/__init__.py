"""Run-directory I/O: a run's files (meta, ledger, checkpoints) and a search's folder, read and
written atomically. Every file name comes from :mod:`dpclip.layout` (docs/design.md)."""
