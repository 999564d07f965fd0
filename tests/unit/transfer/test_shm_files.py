"""Slot files of a killed process are swept by the next one; a live owner's never are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from weightsync.transfer import shm_files
from weightsync.transfer.buffers import BucketSlots

# A process that allocates CPU slots under a directory, says so, and waits to be killed.
OWNER = """
import sys, time, torch
from weightsync.transfer.buffers import BucketSlots
slots = BucketSlots(2, 4096, torch.device("cpu"), sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


def _owner(shm: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(shm)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _files(shm: Path) -> set[str]:
    return {p.name for p in shm.iterdir() if p.name.startswith(shm_files.PREFIX)}


def test_the_files_of_a_killed_owner_are_swept_and_a_live_owners_are_kept(
    tmp_path: Path,
) -> None:
    live, killed = _owner(tmp_path), _owner(tmp_path)
    try:
        live_files = {n for n in _files(tmp_path) if n.startswith(f"weightsync-{live.pid}-")}
        killed_files = _files(tmp_path) - live_files
        assert len(live_files) == len(killed_files) == 2
        killed.send_signal(signal.SIGKILL)  # no chance to unlink anything
        killed.wait(timeout=10)
        assert _files(tmp_path) == live_files | killed_files
        # Within the grace after creation nothing is touched: a file may not be locked yet.
        assert shm_files.sweep_stale(str(tmp_path)) == []
        later = time.time() + shm_files.STALE_AFTER_SECONDS + 1
        assert sorted(shm_files.sweep_stale(str(tmp_path), now=later)) == sorted(killed_files)
        assert _files(tmp_path) == live_files
    finally:
        for proc in (live, killed):
            proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def test_closing_slots_unlinks_their_files_and_lets_go_of_the_locks(tmp_path: Path) -> None:
    slots = BucketSlots(2, 4096, torch.device("cpu"), str(tmp_path))
    names = _files(tmp_path)
    assert len(names) == 2
    later = time.time() + shm_files.STALE_AFTER_SECONDS + 1
    assert shm_files.sweep_stale(str(tmp_path), now=later) == []  # ours: locked
    held = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    slots.close()
    assert _files(tmp_path) == set()
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) == held - 2
