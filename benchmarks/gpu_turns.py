"""Turns on one GPU for benchmark processes that run side by side (`sweep.py --jobs N`).

A sweep spends most of each model's minutes compiling (Inductor, nimble's kernel builds), which
needs the CPU, not the GPU. So several model processes run at once and take turns for whatever
they time: a process holds an exclusive lock on the file that `NIMBLE_BENCH_GPU_LOCK` names for
each timed stretch (its variants' measurements, nimble's load with its tuning), so nothing else
it or its neighbours time overlaps it on the GPU. Within a turn the process's calling thread runs
on cores kept for timing (the first RESERVED the process may use); outside one, and from the start
(`compile_cores`), every process stays off them, so a neighbour's compile workers do not slow a
call path that is being timed (torch.compile's, at batch 1, is bound by it). A neighbour's
untimed GPU work (an eager reference, torch.compile's warm-up) can still overlap a turn: the
medians keep out such short bursts.

Without `NIMBLE_BENCH_GPU_LOCK` (one process at a time) `turn` does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading

LOCK_ENV = "NIMBLE_BENCH_GPU_LOCK"
RESERVED = 2  # cores for the thread that times
ALLOWED = tuple(sorted(os.sched_getaffinity(0)))  # the cores this process could use when it started
_held = threading.local()  # this thread's turns, nested


def _cores() -> tuple[set[int], set[int]]:
    """(the cores kept for timing, the others) among those the process could use at its start; no
    split where there are too few to keep any apart."""
    allowed = list(ALLOWED)
    if len(allowed) <= 2 * RESERVED:
        return set(allowed), set(allowed)
    return set(allowed[:RESERVED]), set(allowed[RESERVED:])


def compile_cores() -> None:
    """Keep this process (and the threads and workers it starts from now on) off the timing cores;
    nothing without the lock."""
    if os.environ.get(LOCK_ENV):
        os.sched_setaffinity(0, _cores()[1])


@contextlib.contextmanager
def turn():
    """This process's turn on the GPU: the lock held and the calling thread on the timing cores.
    A turn within a turn is the same turn."""
    path = os.environ.get(LOCK_ENV)
    depth = getattr(_held, "depth", 0)
    if not path or depth:
        _held.depth = depth + 1
        try:
            yield
        finally:
            _held.depth = depth
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = os.sched_getaffinity(0)
        _held.depth = 1
        try:
            os.sched_setaffinity(0, _cores()[0])
            yield
        finally:
            _held.depth = 0
            os.sched_setaffinity(0, before)
            fcntl.flock(lock, fcntl.LOCK_UN)
