"""Atomic file writes: a crash leaves either the old file or the new one, never half of one.

Every file dpclip writes into a run, search or export directory is readable by its owner only
(:data:`OWNER_ONLY`), whatever the release manifest classes it as: the operator decides what to
publish (docs/accounting.md, "Threat model"). Atomic writes get it from ``mkstemp``; files written
by other libraries (safetensors, matplotlib, tensorboard) get it from :func:`owner_only`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


#: the mode of every file dpclip writes (the owner reads and writes; nobody else anything)
OWNER_ONLY = 0o600
#: the mode of every folder dpclip makes inside a run, search or export directory
OWNER_ONLY_DIR = 0o700


def missing_folders(path: str | Path) -> list[Path]:
    """``path`` and its parents that do not exist yet: what making ``path`` makes."""
    path = Path(path)
    return [p for p in [path, *path.parents] if not p.exists()]


def narrow(folders: list[Path]) -> None:
    """Make each of ``folders`` that exists now owner-only (those another library has just made)."""
    for folder in folders:
        if folder.is_dir():
            os.chmod(folder, OWNER_ONLY_DIR)


def made_private(path: str | Path) -> Path:
    """``path`` made with its missing parents, each folder made owner-only; a folder that exists
    keeps its mode (a user's ``--out DIR``, a save folder given: theirs). ``mkdir``'s mode alone
    gives the umask's ``rwxr-xr-x`` to the parents it makes."""
    path, missing = Path(path), missing_folders(path)
    path.mkdir(mode=OWNER_ONLY_DIR, parents=True, exist_ok=True)
    narrow(missing)
    return path


def private_dir(path: str | Path) -> Path:
    """``path`` made (with its missing parents) or kept as a folder only its owner can list or enter.

    For dpclip's own folders (a run's ``checkpoints/``, ``audit/``, a search's ``runs/``): one
    that already exists is narrowed to the owner too (:func:`made_private` for the rest)."""
    made_private(path)
    os.chmod(path, OWNER_ONLY_DIR)
    return Path(path)


def owner_only(path: str | Path) -> Path:
    """``path`` (a file, or every file under a folder) made readable by its owner only."""
    path = Path(path)
    for file in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
        os.chmod(file, OWNER_ONLY)
    return path


def append_line(path: str | Path, line: str) -> None:
    """Append one line (a JSON-lines record) to ``path``, flushed; a new file is created owner-only."""
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, OWNER_ONLY)
    with os.fdopen(handle, "a", encoding="utf-8") as stream:
        stream.write(line + "\n")
        stream.flush()


def write_bytes_atomic(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write to a temporary file, then rename it over ``path`` (:func:`write_with_atomic`).

    The rename is atomic against a crash of the process. ``durable`` also fsyncs the data
    before the rename, so that a power loss cannot leave an empty file either (a few ms)."""
    made_private(Path(path).parent)
    write_with_atomic(path, lambda tmp: tmp.write_bytes(data), durable)


#: tempfile.mkstemp's names for the atomic writers' prefix and suffix (8 random characters)
_TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9_]{8}\.tmp")


def remove_stale_temporaries(folder: str | Path) -> list[str]:
    """Delete the temporary files an atomic write killed before its rename left in ``folder``
    (``.NAME.XXXXXXXX.tmp``, as the writers here name them); their names. For a folder no other
    process writes to (a run directory under its lock)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if p.is_file() and _TEMPORARY.fullmatch(p.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


def write_with_atomic(path: str | Path, write: Callable[[Path], None], durable: bool = True) -> None:
    """``write(tmp)`` writes the file (``torch.save`` for one another library makes) at a temporary
    path beside ``path``, which is then fsynced (``durable``) and renamed over ``path``
    (owner-only): a write cut short (a kill, a full disk) leaves the previous file whole; ``durable``
    also syncs the folder after the rename, so that a power loss cannot undo it."""
    path = Path(path)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(tmp))
        if durable:
            with open(tmp, "rb") as stream:
                os.fsync(stream.fileno())
        os.chmod(tmp, OWNER_ONLY)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:   # the rename itself is an entry of the folder: on disk once the folder is synced
        sync(path.parent)


def sync(path: str | Path) -> None:
    """fsync a file, or a folder (the names in it: a rename's), so that a power loss keeps it."""
    folder = Path(path).is_dir()
    handle = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if folder else 0))
    try:
        os.fsync(handle)
    except OSError as exc:   # a file system that cannot sync a folder (some network ones): its renames are its own
        if not folder or exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(handle)


def write_text_atomic(path: str | Path, text: str, durable: bool = True) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), durable)


def write_json_atomic(path: str | Path, payload: Any, durable: bool = True) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False) + "\n", durable)


def replace_dir_atomic(staging: Path, final: Path) -> None:
    """Move a fully written staging folder into place. An old folder of that name is swapped with it
    in one rename where the system can (:func:`exchange_paths`): ``final`` is there at every moment,
    the old folder then the new one. Elsewhere the old one is parked as ``.NAME.old`` for the moment
    between two renames (where a resume finds it: :func:`dpclip.rundir.checkpoint.latest_checkpoint`),
    and removed."""
    if final.exists():
        if exchange_paths(staging, final):   # staging now holds the old folder
            shutil.rmtree(staging, ignore_errors=True)
            return
        trash = final.with_name(f".{final.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2   # <fcntl.h>, <linux/fs.h>


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic rename: Linux's ``renameat2(..., RENAME_EXCHANGE)``
    (glibc 2.28+; Python has no call for it). True when swapped; False where the system or the
    file system does not offer it, nothing changed then."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(b))


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file (metrics.jsonl, diagnostics.jsonl); a line cut by a
    crash ends the list, as does one that is not a JSON object or not UTF-8 (a damaged or
    hand-edited file: what follows it is not trusted either); a missing file has none."""
    return [record for _, record in jsonl_records(path)]


def jsonl_records(path: str | Path) -> list[tuple[str, dict]]:
    """(line, record) of each JSON object line of ``path`` up to the first line that is not one
    (:func:`read_jsonl`); a missing file, or a folder in its place, has none."""
    path = Path(path)
    if not path.is_file():
        return []
    records: list[tuple[str, dict]] = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            break
        if not isinstance(record, dict):
            break
        records.append((line, record))
    return records
