"""What a resume checks the data against: hashes of the data a run started with, in meta.json
(secret, like the members).

- the content fingerprint (``data.content_fingerprint``): the training and held-out rows
  themselves, so that a resumed run trains on the examples it started with;
- the people fingerprint (``data.users_fingerprint``, data with users only): who wrote each of
  those rows, as the people's numbers (0..U-1 in order of first appearance, so renaming a person
  everywhere changes nothing). A user column edited so that records change hands keeps the rows,
  the people and U, but moves the unit of privacy the run was charged for (docs/users.md).

The people fingerprint is kept apart from the content one so that runs from before it existed
still resume: such a run is not checked at that resume, and its fingerprint is recorded then and
checked at every later one.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from dpclip.errors import DpclipError
from dpclip.files import write_json_atomic

log = logging.getLogger(__name__)


def _digest(parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        for name in sorted(part):
            tensor = part[name].detach().cpu().contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def data_fingerprint(data) -> str:
    """Hash of the training and held-out examples themselves (the split fingerprint says
    only which rows are members): a resumed run must train on the data it started with."""
    return _digest((data.train, data.test))


def users_fingerprint(data) -> str | None:
    """Hash of who wrote each training and held-out row; None for data without users."""
    if data.train_users is None:
        return None
    people = {"train_users": data.train_users}
    if data.test_users is not None:
        people["test_users"] = data.test_users
    return _digest((people,))


def fingerprints(data) -> dict[str, str]:
    """meta.json's ``data`` fingerprints of ``data`` (the people's only for data with users)."""
    people = users_fingerprint(data)
    return {"content_fingerprint": data_fingerprint(data), **({} if people is None else {"users_fingerprint": people})}


def check_data(run, data) -> None:
    """On resume, the data must be the run's (a :class:`~dpclip.rundir.run.RunDir`): its rows
    (runs started before the content fingerprint was written are not checked) and who wrote
    each (recorded now for runs started before the people fingerprint, checked from then on)."""
    meta = run.meta()
    stored = meta.get("data") or {}
    if not isinstance(stored, dict):
        raise DpclipError(f"{run.meta_file} is damaged: its data record is not a JSON object",
                          "restore meta.json from a backup of the run directory")
    if stored.get("content_fingerprint") is not None and stored["content_fingerprint"] != data_fingerprint(data):
        raise DpclipError(f"the data of {run.path} changed since the run started (its content fingerprint differs)",
                          "restore the data files the run was started with (recipe.yaml names them), or start a "
                          "new run")
    people = users_fingerprint(data)
    if people is None:
        return
    if stored.get("users_fingerprint") is None:
        log.warning("%s's meta.json holds no fingerprint of who wrote each record (the run predates it): this "
                    "resume cannot check that the user column is the run's; it is recorded now and checked at "
                    "every later resume", run.path)
        meta["data"] = {**stored, "users_fingerprint": people}
        write_json_atomic(run.meta_file, meta)
    elif stored["users_fingerprint"] != people:
        raise DpclipError(f"who wrote which record of {run.path}'s data changed since the run started (its people "
                          "fingerprint differs): records moved between people, so the unit of privacy the run "
                          "was charged for would change mid-run",
                          "restore the column data.user_field names as it was when the run started (recipe.yaml "
                          "names the files), or start a new run")
