"""Capped stream candidates: the planned streams folded onto at most N CUDA streams.

`compile` stores, beside the planned schedule, the schedule folded onto at most `c` CUDA streams
for each cap `c` in CAPS that is below the CUDA streams the planned streams fold onto without a
cap (`Schedule.capped`). The memory plan is made once, for the planned schedule, and is safe
under every stored candidate: a fold keeps each planned stream whole on one CUDA stream and
issues the ops in the planned order with the planned waits, so it only adds ordering. The plan
checker proves it all the same, at compile and when an artifact is read (`check`), since a
stored candidate may come from an attacker. Load times the candidates (`runtime/tune/choices.py`) and
issues the chosen one; it never schedules again. Every op on one stream in issue order (the
"serial" candidate) needs nothing stored.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .schedule import Schedule

# The capped candidates compile stores: at most this many CUDA streams. A reader refuses a cap it
# does not know (`formats/codec.py`), so adding one means bumping the artifact's FORMAT_VERSION.
CAPS = (2,)


def fold(order: Sequence[int], stream_of: Sequence[int], waits: Sequence[Sequence[int]],
         cap: int | None = None) -> list[int]:
    """The CUDA stream each op is issued on, when the planned streams share as few CUDA streams as
    the schedule allows: a planned stream, at its first op, takes over a CUDA stream whose planned
    stream has issued its last op and whose last op already precedes this one (through the planned
    streams' order and waits), so capture records no ordering the schedule lacks and the captured
    graph keeps its parallelism. Fewer CUDA streams mean fewer per-stream segments in the graph's
    memory pool and fewer cuBLAS workspaces (one per stream that multiplies matrices).

    With `cap`, at most that many CUDA streams: a planned stream that finds none to take over
    once `cap` exist shares the one with the fewest planned streams still running (a finished one
    first), then the one whose last op was issued earliest. Sharing a stream only adds ordering,
    and every op still follows its waits' ops in issue order, so the memory plan, proved safe
    under the planned order, stays safe, and nothing can wait on an op issued after it."""
    last_on_planned: dict[int, int] = {}
    waiters: dict[int, int] = {}  # op -> how many ops wait on it
    for i in order:
        last_on_planned[stream_of[i]] = i
        for u in waits[i]:
            waiters[u] = waiters.get(u, 0) + 1
    before: dict[int, int] = {}  # op -> bitset of the ops that precede it, while a later op may read it
    previous: dict[int, int] = {}  # planned stream -> its latest op so far
    physical: dict[int, int] = {}  # planned stream -> CUDA stream
    tail: list[int] = []  # CUDA stream -> the last op issued on it
    running: list[int] = []  # CUDA stream -> how many of its planned streams have ops still to issue
    position = {op: k for k, op in enumerate(order)}
    out = [0] * len(stream_of)
    for i in order:
        planned = stream_of[i]
        preds = [*waits[i], *([previous[planned]] if planned in previous else [])]
        mask = 0
        for p in preds:
            mask |= before[p] | (1 << p)
        before[i] = mask
        if planned in previous and previous[planned] not in waiters:
            del before[previous[planned]]  # its stream has moved on and no one waits on it
        for u in waits[i]:
            waiters[u] -= 1
            if waiters[u] == 0:
                del waiters[u]
                if previous.get(stream_of[u]) != u:  # its own stream needs it no more either
                    before.pop(u, None)
        if planned not in physical:
            reuse = next((k for k, (n, last) in enumerate(zip(running, tail)) if not n and mask >> last & 1), None)
            if reuse is None and cap is not None and len(tail) >= cap:
                reuse = min(range(len(tail)), key=lambda k: (running[k], position[tail[k]]))
            if reuse is None:
                reuse = len(tail)
                tail.append(-1)
                running.append(0)
            physical[planned] = reuse
            running[reuse] += 1
        k = physical[planned]
        out[i], tail[k], previous[planned] = k, i, i
        if last_on_planned[planned] == i:
            running[k] -= 1
    return out


def with_candidates(schedule: Schedule) -> Schedule:
    """`schedule` with its capped candidates: a fold for each cap in CAPS below the CUDA streams
    the planned streams fold onto."""
    folded = len(set(fold(schedule.order, schedule.stream, schedule.waits)))
    return dataclasses.replace(schedule, capped=tuple(
        (cap, tuple(fold(schedule.order, schedule.stream, schedule.waits, cap))) for cap in CAPS if cap < folded))


def streams_under(schedule: Schedule, cap: int | None) -> list[int]:
    """The CUDA stream of each op under `cap` (None: as many as the planned streams need): the
    stored candidate for that cap, else the fold (an artifact written before candidates were
    stored, or a cap compile stored none for: the fold reaches it without merging)."""
    stored = dict(schedule.capped).get(cap) if cap is not None else None
    return list(stored) if stored is not None else fold(schedule.order, schedule.stream, schedule.waits, cap)


def as_schedule(schedule: Schedule, cuda: Sequence[int]) -> Schedule:
    """The schedule as capture issues it with each op on CUDA stream `cuda[op]`: the planned
    order, and the waits on ops of other CUDA streams (issue order keeps the rest)."""
    waits = tuple(tuple(u for u in ws if cuda[u] != cuda[i]) for i, ws in enumerate(schedule.waits))
    return dataclasses.replace(schedule, stream=tuple(cuda), waits=waits, capped=())


def check(schedule: Schedule) -> None:
    """Each stored candidate is a fold: a cap in CAPS, no more CUDA streams than that, and each
    planned stream whole on one CUDA stream. Raises ValueError naming the first breach. (That it
    keeps every dependency and the memory plan safe is `verify.check_plan`'s to prove, on
    `as_schedule`.)"""
    seen = set()
    for cap, cuda in schedule.capped:
        if cap not in CAPS or cap in seen:
            raise ValueError(f"a capped candidate for {cap} CUDA streams is not one this nimble stores "
                             f"(caps {', '.join(map(str, CAPS))}, once each)")
        seen.add(cap)
        if len(cuda) != len(schedule.stream) or any(not 0 <= s < cap for s in cuda):
            raise ValueError(f"the candidate capped at {cap} streams does not put each of the "
                             f"{len(schedule.stream)} ops on one of {cap} CUDA streams")
        whole: dict[int, int] = {}
        for op, planned in enumerate(schedule.stream):
            if whole.setdefault(planned, cuda[op]) != cuda[op]:
                raise ValueError(f"the candidate capped at {cap} streams splits planned stream {planned} "
                                 f"over CUDA streams {whole[planned]} and {cuda[op]} (op {op})")
