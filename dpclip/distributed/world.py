"""The ranks of one data-parallel run: torch.distributed's process group, as dpclip uses it.

A run started by torchrun (or ``dpclip train --nproc N``, which starts the same) has W ranks,
each a process with ``RANK``/``WORLD_SIZE`` in its environment (docs/distributed.md).
:func:`joined_world` joins the process group from those variables (gloo on CPU; with CUDA,
``cpu:gloo,cuda:nccl``) and leaves it at the end. :class:`World` is what the trainer asks:

- ``main``: rank 0, which alone writes the run directory (ledger, checkpoints, metrics) and
  shows progress;
- ``reducer``: the engine's sum over ranks (:class:`SumReducer`): rank 0 draws all the noise;
- small object collectives (:meth:`World.broadcast`, :meth:`World.gather`, ...) for setup,
  agreement checks, checkpoints and resume, and :meth:`World.on_main`, which runs a function
  on rank 0 and raises its :class:`DpclipError` on every rank.

A rank that dies (an error, ``kill -9``) closes its connections: the others' next collective
fails, and they stop with :class:`PeerStopped` instead of waiting; torchrun then ends the
group. Each rank's error goes to torchrun's error file (``TORCHELASTIC_ERROR_FILE``) with
its hint, where the launcher (:mod:`dpclip.distributed.launch`) reads it and prints the
first failing rank's (the ranks it started print nothing); under plain torchrun each rank
prints its own.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dpclip.errors import DpclipError
from dpclip.files import write_json_atomic
from dpclip.torch_compat import clear_dtensor_caches, import_dynamo

RESUME_HINT = ("the rank that failed first says why (its own error); continue the run with: "
               "dpclip train --resume RUN_DIR --nproc N")
# How long a rank waits in a collective for the others (they may be evaluating or checkpointing).
TIMEOUT_ENV = "DPCLIP_DIST_TIMEOUT_S"


class PeerStopped(DpclipError):
    """A collective failed because another rank stopped first (its error is the cause)."""


class NoAnswer(DpclipError):
    """A collective timed out: another rank did not reach it within ``DPCLIP_DIST_TIMEOUT_S``
    (stuck or slow, not stopped: no rank may have an error of its own to report)."""


class World:
    """This process's place in the run: ``rank`` of ``size`` (see module doc). ``size == 1``
    is the one-process run: every collective is then the identity and nothing is sent."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0, local_size: int = 1):
        self.rank, self.size, self.local_rank, self.local_size = rank, size, local_rank, local_size
        self.reducer = SumReducer(self) if size > 1 else None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (stop requests, checkpoint timers)."""
        if self.size == 1:
            return bool(flag)
        value = torch.tensor([1.0 if flag else 0.0], device=_device())
        run_collective(dist.all_reduce, value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def on_every_rank(self, check: Callable[[], Any]) -> Any:
        """``check()`` on this rank; if it raised a DpclipError on any rank, every rank raises it
        (the others name the rank): a refusal on one rank must not leave the others waiting."""
        try:
            out, refusal = check(), None
        except DpclipError as exc:
            out, refusal, raised = None, (exc.message, exc.hint), exc
        refusals = self.all_gather(refusal)
        if refusal is not None:
            raise raised
        rank, first = next(((r, f) for r, f in enumerate(refusals) if f is not None), (None, None))
        if first is not None:
            raise PeerStopped(f"rank {rank}: {first[0]}", first[1])
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        run_collective(dist.broadcast_object_list, box, src=0)
        return box[0]

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite each tensor, in place, with rank 0's (the weights every rank starts from)."""
        if self.size == 1:
            return
        for t in tensors:
            run_collective(dist.broadcast, t.data, src=0)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        run_collective(dist.all_gather_object, out, obj)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.main else None
        run_collective(dist.gather_object, obj, out, dst=0)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank r gets ``objs[r]`` of rank 0's list."""
        if self.size == 1:
            return objs[0]
        box: list[Any] = [None]
        run_collective(dist.scatter_object_list, box, objs if self.main else None, src=0)
        return box[0]

    def on_main(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on rank 0 only; its result on every rank. A :class:`DpclipError` it
        raises is raised on every rank with the same message and hint (so all ranks stop with
        the cause, not with a failed collective)."""
        if self.size == 1:
            return fn(*args)
        outcome: tuple[str, Any, Any] = ("ok", None, None)
        failure: BaseException | None = None
        if self.main:
            try:
                outcome = ("ok", fn(*args), None)
            except DpclipError as exc:
                outcome, failure = ("error", exc.message, exc.hint), exc
            except BaseException as exc:
                outcome, failure = ("crash", f"{type(exc).__name__}: {exc}", None), exc
        kind, value, hint = self.broadcast(outcome)
        if failure is not None:
            raise failure
        if kind == "error":
            raise DpclipError(value, hint)
        if kind == "crash":
            raise PeerStopped(f"rank 0 stopped: {value}", RESUME_HINT)
        return value

    def check_same(self, what: str, value: Any, hint: str) -> None:
        """Refuse, on every rank, when the ranks disagree on ``value`` (e.g. the recipe)."""
        values = self.all_gather(value)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise DpclipError(f"the ranks disagree on {what}: rank {differ[0]}'s differs from rank 0's", hint)


class SumReducer:
    """The engine's reducer (:mod:`dpclip.engine.reducer`) over torch.distributed: rank 0 draws
    the noise; sums are all-reduces of one flat buffer per dtype and device."""

    def __init__(self, world: World):
        self.draws_noise = world.main
        self.rank, self.size = world.rank, world.size

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            run_collective(dist.all_reduce, flat)
            offset = 0
            for t in group:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        run_collective(dist.all_reduce, out)
        return out

    def gather(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """All ranks' 1-d ``tensor`` in rank order, and this rank's offset in it: lengths are
        exchanged first, then parts padded to the longest (all_gather needs equal sizes)."""
        flat = tensor.detach().reshape(-1)
        length = torch.tensor([flat.numel()], device=flat.device, dtype=torch.long)
        lengths = [torch.zeros_like(length) for _ in range(self.size)]
        run_collective(dist.all_gather, lengths, length)
        sizes = [int(n.item()) for n in lengths]
        padded = torch.zeros(max(max(sizes), 1), device=flat.device, dtype=flat.dtype)
        padded[:flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        run_collective(dist.all_gather, parts, padded)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)]), sum(sizes[:self.rank])


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_collective(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A torch.distributed call whose failure (a peer gone) becomes :class:`PeerStopped`."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError, ConnectionError) as exc:
        raise (no_answer(exc) if timed_out(exc) else peer_stopped(exc)) from exc


def _first_words(exc: BaseException) -> str:
    # gloo's messages open with "[file.cc:line]": keep the words
    first = re.sub(r"\[[^\]]*\]\s*", "", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    return first.strip()[:200] or type(exc).__name__


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that waited out the group's timeout (gloo: "Timed out
    waiting 1800000ms for recv operation to complete"); the rank at the other end of that wait
    sees its pair closed, a peer's stop."""
    return isinstance(exc, (RuntimeError, ConnectionError)) and re.search(r"\btimed out\b", str(exc), re.I) is not None


def no_answer(exc: BaseException) -> NoAnswer:
    """The :class:`NoAnswer` of a collective ``exc`` that timed out: this rank's own error (the
    launcher names it before a stuck rank that the agent then ends with SIGTERM)."""
    return NoAnswer(f"another rank did not reach the same collective within {TIMEOUT_ENV} = "
                    f"{os.environ.get(TIMEOUT_ENV, '1800')} s "
                    f"({_first_words(exc)})",
                    f"a rank is stuck or slower than that (its data, an evaluation, a checkpoint); if it is only "
                    f"slow, raise {TIMEOUT_ENV} and resume the run")


def peer_stopped(exc: BaseException) -> PeerStopped:
    """The :class:`PeerStopped` of a failed collective ``exc``."""
    return PeerStopped(f"another rank stopped, so this one cannot go on ({_first_words(exc)})", RESUME_HINT)


# What a transport says when the rank at the other end is gone: collectives that dpclip does not
# call itself (FSDP's gathers and reduce-scatters inside a forward or backward) fail with these.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure because another rank stopped."""
    distributed_error = getattr(dist, "DistNetworkError", ())
    return (isinstance(exc, distributed_error) if distributed_error else False) or (
        isinstance(exc, (RuntimeError, ConnectionError)) and any(text in str(exc) for text in _PEER_GONE))


def launched() -> bool:
    """True in a process started by torchrun (or ``--nproc``) as one of several ranks."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextmanager
def joined_world() -> Iterator[World | None]:
    """The process group from torchrun's environment for the block (None: one process, no group).

    An exception leaving the block is written to torchrun's error file for this rank, with
    its hint, before the group is left."""
    if not launched():
        yield None
        return
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = "gloo"
    if torch.cuda.is_available():  # untested on GPU (docs/distributed.md): models train on CPU today
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    try:
        timeout = timedelta(seconds=timeout_seconds())
    except DpclipError as error:
        record_failure(error)
        raise
    _import_what_would_outlive_the_group()
    try:
        dist.init_process_group(backend, timeout=timeout)
    except Exception as exc:  # pragma: no cover - torchrun has already rendezvoused
        error = DpclipError(f"rank {rank} could not join the process group: {exc}",
                            "check the rendezvous flags (--rdzv-endpoint, --master-addr/--master-port) and "
                            "that every node reaches the first one")
        record_failure(error)
        raise error from exc
    try:
        yield World(rank, size, local_rank, local_size)
    except BaseException as exc:
        if not isinstance(exc, DpclipError) and (lost_a_peer(exc) or timed_out(exc)):  # torch's collective (FSDP)
            stopped = no_answer(exc) if timed_out(exc) else peer_stopped(exc)
            record_failure(stopped)
            raise stopped from exc
        record_failure(exc)
        raise
    finally:
        _drop_dtensor_caches()
        dist.destroy_process_group()


def timeout_seconds() -> float:
    """``DPCLIP_DIST_TIMEOUT_S`` (default 1800): a number of seconds > 0, or an error with a hint
    before this rank joins (was an unexpected ValueError, or a group that timed out at once)."""
    given = os.environ.get(TIMEOUT_ENV, "1800")
    try:
        seconds = float(given)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise DpclipError(f"{TIMEOUT_ENV}={given!r} is not a number of seconds > 0",
                          f"set {TIMEOUT_ENV} to how long a rank may wait for the others, e.g. 1800, or unset it")
    return seconds


def _drop_dtensor_caches() -> None:
    """Clear DTensor's caches (sharding propagation in Python and C++, redistribution planners
    and plans, mesh topologies) before the group goes: torch's private names, each looked up
    and skipped where this torch has no such cache (:func:`dpclip.torch_compat.clear_dtensor_caches`).

    Their entries keep the specs of the ops a sharded model ran (FSDP2, its optimizer state),
    and through each spec's device mesh the process group: ``destroy_process_group`` then
    leaves the group's gloo threads alive, and one can end the process with SIGABRT as Python
    exits, as in :func:`_import_what_would_outlive_the_group` (3 sharded runs in 4 before;
    tests/distributed/test_teardown.py)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    gc.collect()  # a sharded model left in reference cycles (FSDP's state and its module) holds the mesh too
    clear_dtensor_caches()
    gc.collect()  # what the cleared entries alone kept, in cycles


def _import_what_would_outlive_the_group() -> None:
    """Import ``torch._dynamo`` before the process group exists.

    Imported after ``init_process_group`` (``torch.distributed.pipelining`` imports it, and so
    does the trainer, which imports the pipeline), it keeps a reference to the default group
    that ``destroy_process_group`` cannot drop: the group's gloo threads then live on until
    the interpreter exits, and one that frees its last collective's tensors while Python
    finalizes takes the GIL there, which ends the thread inside C++ code that may not be
    unwound: std::terminate, SIGABRT (rank 1 of tests/distributed/test_pipeline.py's workers,
    2 runs in 28). Imported first, it holds no group, and the group's threads end in
    ``destroy_process_group`` (test: tests/distributed/test_teardown.py)."""
    import_dynamo()


def unexpected(exc: BaseException) -> tuple[str, str]:
    """The error and hint of an exception that is not a :class:`DpclipError` (as the CLI prints it)."""
    return f"unexpected {type(exc).__name__}: {exc}", "rerun with --debug for a traceback, and please report it"


def record_failure(exc: BaseException) -> bool:
    """Write this rank's error to torchrun's error file: the message torchrun shows, plus
    dpclip's message, hint and whether it only reports another rank's failure (the launcher
    names the rank that failed first). True when written (``exc.dpclip_recorded`` says so too)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    if isinstance(exc, DpclipError):
        message, hint = exc.message, exc.hint
    elif isinstance(exc, KeyboardInterrupt):
        message, hint = "interrupted", None
    else:
        message, hint = unexpected(exc)
    stamp = time.time_ns()  # torchrun's own field is whole seconds; ns tells close failures apart
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(stamp // 10**9)}},
            "dpclip": {"message": message, "hint": hint, "secondary": isinstance(exc, PeerStopped),
                       "interrupted": type(exc).__name__ == "InterruptedRun", "rank": int(os.environ["RANK"]),
                       "ns": stamp}}
    try:  # atomic: the agent may end this rank mid-write, and torchrun's reader fails on half a file
        write_json_atomic(path, data, durable=False)
    except OSError:  # pragma: no cover - the error itself is still printed by the rank
        return False
    exc.dpclip_recorded = True  # type: ignore[attr-defined]  # (errors_to_launcher records it once)
    return True
