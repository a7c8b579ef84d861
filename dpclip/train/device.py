"""``training.device``: where a run's model, batches, gradients and noise live (docs/training.md, "Device");
and, for ``--resume``, the device and thread count a run was trained with.

``cpu`` (the default), ``cuda``, ``cuda:N`` or ``auto`` (``cuda`` when torch sees a CUDA
device, else ``cpu``). The device is resolved once, before the run directory exists, so a
recipe asking for a GPU the machine does not have stops with an ``error:`` and a ``hint:``
and writes nothing. A run keeps its device: the checkpoints hold the noise generator's state
of that device, and a resume replays the steps after the last checkpoint bit for bit
(docs/training.md, "Checkpoints and resuming"), so ``--resume`` refuses another kind of device.

Training on several processes (``--nproc``) runs on the CPU so far: its GPU path (NCCL) has
never been run, so ``cuda`` is refused there and ``auto`` means ``cpu``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpclip.errors import DpclipError
from dpclip.rundir.run import RunDir

CPU_ONLY_HINT = "set training.device=cpu (or auto, which takes a GPU only where one process trains)"


def resolve_device(spec: str, world_size: int = 1, trained_on: str | None = None) -> torch.device:
    """The torch device of the recipe's ``training.device`` (module doc), or a DpclipError.
    ``trained_on``: the device a resumed run recorded (``"cpu"`` for a run from before the
    setting); the resume must be on its kind (:func:`check_resume_device`)."""
    if trained_on is not None and torch.device(trained_on).type == "cuda" and not torch.cuda.is_available():
        raise DpclipError(f"the run trained on {trained_on}, and torch sees no CUDA device on this machine",
                          "resume it (or diagnose it) where torch sees a GPU: its checkpoints hold that "
                          "device's noise generator, and the steps after the last one must replay exactly")
    device = _resolve(spec, world_size)
    if trained_on is not None:
        check_resume_device(trained_on, device)
    return device


def _resolve(spec: str, world_size: int) -> torch.device:
    if spec == "auto":
        spec = "cuda" if world_size == 1 and torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if world_size > 1:
        raise DpclipError(f"training.device is {spec}, and training on {world_size} processes runs on the CPU "
                          "only so far (its GPU path, NCCL, has never been run)",
                          "train on one process on the GPU, or " + CPU_ONLY_HINT)
    if not torch.cuda.is_available():
        raise DpclipError(f"training.device is {spec}, but torch sees no CUDA device on this machine",
                          "install a CUDA build of torch on a machine with an NVIDIA GPU, or " + CPU_ONLY_HINT)
    device = torch.device(spec)
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise DpclipError(f"training.device is {spec}, but this machine has {count} CUDA device"
                          f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})",
                          "choose one of them, or set training.device=cuda for the current one")
    return torch.device("cuda", index)


def check_resume_device(recorded: str | None, device: torch.device) -> None:
    """Refuse to resume a run on another kind of device than it trained on (module doc).
    ``recorded``: the device in the run's meta.json (None: a run from before the setting, on the CPU)."""
    before = torch.device(recorded or "cpu")
    if before.type != device.type:
        raise DpclipError(f"the run trained on {before}, and this resume would train on {device}",
                          f"resume on {before.type} (training.device={before.type}): its checkpoint holds that "
                          "device's noise generator, and the steps after it must replay exactly as first run")


def _recorded(run_dir: Path, key: str):
    """meta.json's ``plan[key]``: None for a folder without meta.json (the resume refuses it
    anyway) and for a run from before the key was recorded."""
    run = RunDir(run_dir)
    plan = run.meta().get("plan") if run.meta_file.exists() else None   # meta(): a damaged file is an error
    return plan.get(key) if isinstance(plan, dict) else None


def recorded_device(run_dir: Path) -> str:
    """The device the run trained on (``"cpu"`` for a run from before ``training.device``)."""
    device = _recorded(run_dir, "device")
    return device if isinstance(device, str) else "cpu"


def recorded_threads(run_dir: Path) -> int | None:
    """The torch thread count the run started with, None when not recorded: ``--resume``
    uses it so that replayed steps reduce in the same order (dpclip.threads)."""
    threads = _recorded(run_dir, "threads")
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1 else None


__all__ = ["check_resume_device", "recorded_device", "recorded_threads", "resolve_device"]
