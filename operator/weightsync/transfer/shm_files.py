"""Shared-memory files of CPU bucket slots and arenas, and the sweep of those whose
owner died.

A slot lives in a file under a memory-backed directory (`/dev/shm`) that the engine maps
by name. Its owner unlinks it when done, but a killed process cannot: in a pod of its own
the files go with the pod's `/dev/shm`, while in Colocated pods (`hostIPC`) `/dev/shm` is
the node's, and a killed agent's slots stayed there until the node rebooted. Names
cannot tell a dead owner from a live one (in hostIPC pods every agent is pid 1 of its
container), so the owner holds a `flock` on each file for as long as it keeps it; the
kernel drops the lock when the process dies, however it dies. Whoever allocates slots
first removes the files nobody holds a lock on any longer (`sweep_stale`), after a grace
that covers the moment between a file's creation and its lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "weightsync-"
# A file is created, then locked at once; one older than this without a lock is stale.
STALE_AFTER_SECONDS = 60.0
_swept: set[str] = set()  # the directories this process has swept


def create(shm_dir: str, index: int) -> tuple[Path, int]:
    """A new slot file under `shm_dir` and its descriptor, locked for this process's
    life (`release` ends both)."""
    if shm_dir not in _swept:
        _swept.add(shm_dir)
        sweep_stale(shm_dir)
    path = Path(shm_dir) / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-{index}"
    # 0o660: the engine container shares the pod's fsGroup, not necessarily our uid.
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o660)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
    return path, fd


def release(path: Path, fd: int) -> None:
    """Unlink the name and drop the lock; processes that mapped it keep their mapping."""
    path.unlink(missing_ok=True)
    os.close(fd)


def sweep_stale(shm_dir: str, *, now: float | None = None) -> list[str]:
    """Remove the slot files under `shm_dir` whose owner is gone; their names."""
    removed: list[str] = []
    now = time.time() if now is None else now
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone already, or another user's
            continue
        try:
            if now - os.fstat(fd).st_mtime < STALE_AFTER_SECONDS:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its owner lives
            os.unlink(path)  # raises for another user's file in a sticky directory
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d slot files of processes gone from %s", len(removed), shm_dir)
    return removed
