"""The ``dpclip`` command's entry point: a Ctrl-C while the CLI's modules are still being imported
(dp_accounting, scipy, rich: a second or two) ends as one after them does, with ``error:`` and
``hint:`` and exit code 130, not a traceback through the import machinery."""

from __future__ import annotations

import sys

#: what a Ctrl-C before the command started says (the same words as :data:`dpclip.cli.main.INTERRUPTED_HINT`)
EARLY_INTERRUPT = ("error: interrupted\n"
                   "hint: nothing was left half written: run the command again (a training run that had started "
                   "resumes with `dpclip train --resume RUN_DIR`)\n")


def run() -> None:
    try:
        from dpclip.cli.main import main
    except KeyboardInterrupt:
        sys.stderr.write(EARLY_INTERRUPT)
        sys.exit(130)
    sys.exit(main())
