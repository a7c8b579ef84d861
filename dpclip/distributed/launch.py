"""``dpclip train RECIPE --nproc N``: N ranks on this machine through torch.distributed's own
launcher (the API torchrun is built on, :func:`torch.distributed.launcher.api.elastic_launch`).

Each rank runs ``python -m dpclip train ...`` with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``...), exactly as ``torchrun --nproc-per-node N -m dpclip train
...`` would start it; several machines use torchrun itself with its rendezvous flags
(docs/distributed.md). This module adds what a user of one machine needs around it: a free
rendezvous port (or a clear error for a port in use), the threads each rank may use, and,
when a rank fails, ONE ``error:``/``hint:`` naming the rank that failed first, its own
message, and the command that continues the run. The ranks it starts print no error of their
own (:func:`errors_to_launcher`): each writes it to torchrun's error file, where the launcher
reads it; a rank killed by a signal writes nothing, and the launcher names the signal. Under
plain torchrun, with no launcher of ours, each rank prints its own error.

Ctrl-C (or SIGTERM) reaches the launcher only: torchrun's agent starts each rank in its own
session, so a terminal's SIGINT does not reach the ranks directly. The agent forwards the
signal to every rank and waits (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default) before it
kills them; the ranks stop together at the next step boundary with a checkpoint, rank 0
leaves a note of where (:func:`announce_interrupted`), and the launcher prints that one
``error: interrupted ...`` with the resume command (exit 130).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpclip.distributed.world import launched, record_failure, unexpected
from dpclip.errors import DpclipError, InterruptedRun
from dpclip.files import write_json_atomic

# Rank 0 writes the run directory here as soon as it exists (for the launcher's resume hint).
RUN_DIR_ENV = "DPCLIP_LAUNCH_RUN_DIR_FILE"
MAX_NPROC = 512
# The signals torchrun's agent takes over in the launcher (its TORCHELASTIC_SIGNALS_TO_HANDLE).
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def check_port(port: int) -> None:
    """Refuse a rendezvous port another process holds (torchrun would fail obscurely)."""
    if not 1 <= port <= 65535:
        raise DpclipError(f"--master-port {port} is not a port number", "choose a port between 1024 and 65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError:
            raise DpclipError(f"port {port} is in use on this machine, so the ranks cannot meet there",
                              "pass another --master-port, or leave it out to let dpclip pick a free one") from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_threads(threads: int | str | None) -> int | str | None:
    """The threads of one rank: 'auto' splits what the load leaves free among this machine's ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local > 1 and threads in (None, "auto"):
        from dpclip.threads import auto_threads

        return max(1, auto_threads() // local)
    return threads


def launch(args: list[str], nproc: int, *, master_port: int | None = None, debug: bool = False) -> None:
    """Run ``python -m dpclip *args`` as ``nproc`` ranks on this machine and wait for them.

    Returns when every rank has finished; a failed rank raises one :class:`DpclipError`
    (module doc)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= MAX_NPROC:
        raise DpclipError(f"--nproc must be a whole number from 1 to {MAX_NPROC}, got {nproc!r}",
                          "e.g. --nproc 2 (one process per GPU, or per few cores on CPU)")
    if master_port is not None:
        check_port(master_port)
    # Lazy: only the launcher pays for torch.distributed's launcher.
    import sys

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not debug:  # the agent logs every failure at length; the ranks' own error lines say it better
        _quiet_agent_logs()
    port = master_port if master_port is not None else free_port()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"dpclip-{uuid.uuid4()}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                          monitor_interval=0.1)
    with tempfile.TemporaryDirectory(prefix="dpclip-launch-") as tmp:
        run_dir_file = Path(tmp) / "run_dir"
        previous = os.environ.get(RUN_DIR_ENV)
        os.environ[RUN_DIR_ENV] = str(run_dir_file)  # the ranks inherit the launcher's environment
        handlers = {name: signal.getsignal(getattr(signal, name)) for name in AGENT_SIGNALS if hasattr(signal, name)}
        try:
            elastic_launch(config, sys.executable)("-m", "dpclip", *args)
        except ChildFailedError as exc:
            run_dir = run_dir_file.read_text().strip() if run_dir_file.exists() else None
            raise failure_error(exc.failures, nproc, run_dir) from None
        except SignalException as exc:  # Ctrl-C or SIGTERM to this process; the agent has ended the ranks
            raise interrupted_error(run_dir_file, nproc, exc.sigval) from None
        finally:
            for name, handler in handlers.items():  # the agent's handlers outlive it otherwise
                signal.signal(getattr(signal, name), handler if handler is not None else signal.SIG_DFL)
            if previous is None:
                os.environ.pop(RUN_DIR_ENV, None)
            else:
                os.environ[RUN_DIR_ENV] = previous


def _quiet_agent_logs() -> None:
    """torchrun's modules set their loggers' levels one by one (LOGLEVEL, else WARNING), so a
    parent logger's level does not reach them: lower each one (called once the launcher's
    modules, and so their loggers, are imported)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


@contextmanager
def errors_to_launcher() -> Iterator[None]:
    """Around a rank's whole command: an error leaving it is in torchrun's error file (written
    here when :func:`~dpclip.distributed.world.joined_world` did not, e.g. a recipe refused
    before the group existed), and in a rank that ``dpclip train --nproc`` started it is quiet
    (the CLI exits with its code and prints nothing): the launcher prints the first failing
    rank's error once (:func:`failure_error`). One process, or plain torchrun: as raised."""
    if not launched():
        yield
        return
    try:
        yield
    except (Exception, KeyboardInterrupt) as exc:
        recorded = getattr(exc, "dpclip_recorded", False) or record_failure(exc)
        if not recorded or not os.environ.get(RUN_DIR_ENV):
            raise
        if isinstance(exc, DpclipError):
            exc.quiet = True
            raise
        if isinstance(exc, KeyboardInterrupt):
            error: DpclipError = InterruptedRun("interrupted")
        else:
            error = DpclipError(*unexpected(exc))
            error.exit_code = 1  # the CLI's for an unexpected error (a traceback with --debug: `from exc`)
        error.quiet = True
        raise error from exc


def _interrupted_file() -> Path | None:
    target = os.environ.get(RUN_DIR_ENV)
    return Path(target).with_name("interrupted.json") if target else None


def announce_interrupted(message: str, hint: str | None) -> bool:
    """Rank 0 of a run started by ``--nproc``: leave the launcher the interruption's message
    (where the ranks stopped, how to resume). False when no launcher of ours waits for it."""
    path = _interrupted_file()
    if path is None:
        return False
    write_json_atomic(path, {"message": message, "hint": hint}, durable=False)  # the launcher reads it
    return True


def interrupted_error(run_dir_file: Path, nproc: int, sigval: Any = None) -> InterruptedRun:
    """The launcher's one error after a Ctrl-C or SIGTERM: rank 0's note when the ranks
    stopped at a step boundary, else (killed first, or stopped before the run directory
    existed) how to continue from the last checkpoint."""
    note = run_dir_file.with_name("interrupted.json")
    if note.exists():
        data = json.loads(note.read_text(encoding="utf-8"))
        return InterruptedRun(str(data["message"]), data.get("hint"))
    name = getattr(sigval, "name", None) or "a signal"
    if run_dir_file.exists():
        run_dir = run_dir_file.read_text().strip()
        return InterruptedRun(f"interrupted by {name} before the ranks reached a step boundary",
                              f"the run continues from its last checkpoint with: dpclip train --resume {run_dir} "
                              f"--nproc {nproc}")
    return InterruptedRun(f"interrupted by {name} before the run directory was made", "nothing was trained")


def announce_run_dir(run_dir: Path) -> None:
    """Rank 0: tell the launcher (if any) which run directory this run writes."""
    target = os.environ.get(RUN_DIR_ENV)
    if target:
        Path(target).write_text(str(run_dir))


def _reported(failure: Any) -> dict[str, Any] | None:
    data = getattr(failure, "error_file_data", None)
    return data.get("dpclip") if isinstance(data, dict) else None


def _killed_by(failure: Any) -> str | None:
    exitcode = getattr(failure, "exitcode", None)
    return failure.signal_name() if isinstance(exitcode, int) and exitcode < 0 else None


def _failure_order(failure: Any, info: dict[str, Any] | None) -> int:
    """How surely a rank's failure is where the launch went wrong (lower is surer).

    Once one rank fails, torchrun's agent sends SIGTERM to the others and records them too: a
    rank then dies of that SIGTERM (between steps, where the signal keeps its default) or
    stops at a step boundary and reports an interruption. Neither may hide the rank that
    failed, e.g. one killed by SIGKILL that could report nothing (a kill -9 or the OOM killer)."""
    if info is not None and not info.get("interrupted"):
        return 0  # the rank's own error
    if info is None and _killed_by(failure) != "SIGTERM":
        return 1  # killed by another signal, or exited without a report
    if info is not None:
        return 2  # stopped at a step boundary: a SIGTERM sent to it (or the agent's)
    return 3  # died of a SIGTERM: most likely the agent ending the survivors


def _same_on_every_rank(failures: dict[int, Any], nproc: int, info: dict[str, Any]) -> bool:
    """Whether every rank stopped with this error of its own (not another rank's)."""
    said = (info["message"], info.get("hint"))
    reports = [_reported(f) for f in failures.values()]
    return len(failures) == nproc and all(r is not None and not r.get("secondary") and (r["message"], r.get("hint"))
                                          == said for r in reports)


def failure_error(failures: dict[int, Any], nproc: int, run_dir: str | None) -> DpclipError:
    """One error for a failed launch: the rank that failed first (a rank's own error or a
    signal beats the others' "another rank stopped" and the SIGTERM with which torchrun's
    agent ends the survivors, :func:`_failure_order`), its message and hint, and how to resume."""
    resume = f"dpclip train --resume {run_dir} --nproc {nproc}" if run_dir else None
    ranked = []
    for rank, failure in failures.items():
        info = _reported(failure)
        if info is not None and info.get("secondary"):
            continue
        ranked.append((_failure_order(failure, info), info["ns"] if info else 0, rank, failure, info))
    secondary_only = not ranked
    if secondary_only:  # only "another rank stopped" reports: name the lowest rank
        ranked = [(4, 0, rank, f, _reported(f)) for rank, f in failures.items()]
    _, _, rank, failure, info = min(ranked, key=lambda item: item[:3])
    if info is not None and info.get("interrupted"):  # e.g. SIGTERM to one rank: all stopped at a step boundary
        return InterruptedRun(info["message"], f"continue with: {resume}" if resume else info.get("hint"))
    if info is not None:
        everywhere = _same_on_every_rank(failures, nproc, info)  # e.g. a refused recipe: no rank to name
        message = info["message"] if everywhere else f"rank {rank} stopped: {info['message']}"
        # a peer's own hint points at the failing rank's error, which no rank reported here
        hint = "no rank reported an error of its own" if secondary_only else info.get("hint") or ""
    else:
        signal_name = _killed_by(failure)
        how = (f"was killed by {signal_name}" if signal_name is not None
               else f"exited with code {getattr(failure, 'exitcode', None)}")
        message = f"rank {rank} {how} before it could report an error"
        hint = "out of memory and a kill -9 look like this; check the system log"
    if resume and "--resume" not in hint:
        hint = (hint + "; " if hint else "") + f"the run continues with: {resume}"
    return DpclipError(message, hint or None)

