"""Turns on one GPU for benchmark processes that run side by side (`sweep.py --jobs N`).

A sweep spends most of each model's minutes compiling (Inductor, nimble's kernel builds), which
needs the CPU, not the GPU. So several model processes run at once and take turns for whatever
they time: each timed stretch (a variant's figures; nimble's load, which times its candidates)
holds an exclusive lock on the file that `NIMBLE_BENCH_GPU_LOCK` names, and for as long as it
holds it every other process of the sweep is stopped (SIGSTOP to its process group, its compile
workers included; SIGCONT after), with SETTLE seconds for their queued GPU work to drain. Only
holding the lock was not enough: on the H200 (2026-12-01) a neighbour's compile and warm-up
calls, untimed, inflated torch.compile's figures by up to 25 % at batch 8 (convnext_tiny: 3.615
ms beside its kernels alone at 2.864), while nimble's, timed in one CUDA graph, held.

Each process of the sweep is started as the leader of a process group of its own (the parent's
`start_new_session`) and joins (`join`): a file named by its group in the folder beside the lock,
which `turn` reads to find its neighbours. The parent continues every group once a model ends, so a
process killed within its turn (a timeout) leaves none stopped.

Without `NIMBLE_BENCH_GPU_LOCK` (one process at a time) `join` and `turn` do nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from pathlib import Path

LOCK_ENV = "NIMBLE_BENCH_GPU_LOCK"
SETTLE = 0.2  # seconds for stopped neighbours' queued kernels to finish
_held = threading.local()  # this thread's turns, nested


def _members(lock: str) -> Path:
    return Path(lock + ".members")


def join() -> None:
    """Make this process (the leader of its own group) one that turns stop; nothing without the lock."""
    lock = os.environ.get(LOCK_ENV)
    if lock:
        folder = _members(lock)
        folder.mkdir(exist_ok=True)
        (folder / str(os.getpgrp())).touch()


def leave(lock: str, group: int) -> None:
    """`group` (a process group whose leader ended) no longer in the sweep, and what its leader
    left running (compile workers) killed."""
    (_members(lock) / str(group)).unlink(missing_ok=True)
    _signal(group, signal.SIGKILL)


def continue_all(lock: str) -> None:
    """Every member continued: what the parent does when a model ends, whatever its process did."""
    folder = _members(lock)
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.name.isdigit():
            _signal(int(entry.name), signal.SIGCONT)


def forget(lock: str) -> None:
    """The lock file and its members folder gone, once the run's processes have ended."""
    folder = _members(lock)
    for entry in folder.iterdir() if folder.is_dir() else ():
        entry.unlink(missing_ok=True)
    if folder.is_dir():
        folder.rmdir()
    Path(lock).unlink(missing_ok=True)


def _signal(group: int, sig) -> bool:
    try:
        os.killpg(group, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


@contextlib.contextmanager
def turn():
    """This process's turn on the GPU: the lock held and every other member stopped. A turn
    within a turn is the same turn."""
    lock = os.environ.get(LOCK_ENV)
    depth = getattr(_held, "depth", 0)
    if not lock or depth:
        _held.depth = depth + 1
        try:
            yield
        finally:
            _held.depth = depth
        return
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _held.depth = 1
        stopped = []
        try:
            mine = os.getpgrp()
            folder = _members(lock)
            for entry in folder.iterdir() if folder.is_dir() else ():
                if entry.name.isdigit() and int(entry.name) != mine and _signal(int(entry.name), signal.SIGSTOP):
                    stopped.append(int(entry.name))
            if stopped:
                time.sleep(SETTLE)
            yield
        finally:
            for group in stopped:
                _signal(group, signal.SIGCONT)
            _held.depth = 0
            fcntl.flock(held, fcntl.LOCK_UN)
