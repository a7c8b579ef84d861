"""Command-line interface: Typer parsing and rich rendering only.

A command imports the layer it drives (training, tuning, auditing, and with them torch)
inside its own function, so that ``dpclip --help``, ``dpclip validate`` and typos answer
in a quarter of a second instead of the two seconds torch takes to import
(``tests/cli/test_root.py`` keeps torch out of ``import dpclip.cli.main``).
"""
