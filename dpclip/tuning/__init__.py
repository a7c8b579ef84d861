"""Tuning cost: what a hyperparameter search costs in compute and in privacy (docs/tuning.md).

- :mod:`dpclip.tuning.space` expands the search space into validated recipes;
- :mod:`dpclip.tuning.timing` measures seconds per private step on this machine;
- :mod:`dpclip.tuning.privacy` gives the per-run σ under naive composition, Liu–Talwar
  random stopping and Papernot–Steinke repeat-and-select (math in
  :mod:`dpclip.accounting.tuning`);
- :mod:`dpclip.tuning.cost` ties space, timing and privacy together for ``dpclip tune-cost``;
- :mod:`dpclip.tuning.compare` builds on it: the same search for each clipping method;
- :mod:`dpclip.tuning.search` performs the search (repeat-and-select) and writes its ledger;
- :mod:`dpclip.tuning.report` runs ``dpclip tune-cost``'s options through them and returns the
  report the CLI renders.
"""
