"""Happens-before on a schedule, as vector clocks: op u completes before op v starts exactly when
v's clock has reached u's sequence number on u's stream. One pass over the issue order, keeping
only the clocks later ops still read, so it costs O(ops x streams) time and little memory. The
memory plan and the load-time check (`verify`) both use it."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .schedule import Schedule


class Clocks:
    """Answers "does op u complete before op v starts?" for queries grouped by v, in one pass
    over the issue order. `before(v)[s]` is the highest per-stream sequence number on stream `s`
    that is guaranteed complete when `v` starts (-1: none)."""

    def __init__(self, schedule: Schedule, max_streams: int | None = None):
        self.schedule = schedule
        n = len(schedule.order)
        self.streams = max(schedule.stream, default=-1) + 1
        if max_streams is not None and self.streams > max_streams:
            raise ValueError(f"the schedule uses {self.streams} streams, more than {max_streams}")
        self.seq = [0] * n
        counts = [0] * self.streams
        for v in schedule.order:
            self.seq[v] = counts[schedule.stream[v]]
            counts[schedule.stream[v]] += 1

    def walk(self):
        """For each op v in issue order, yield (v, before(v)). Only the clocks later ops still
        read are kept: each stream's last op, and waited-on ops until their last waiter. Clocks
        are lists for a few streams and numpy arrays for many."""
        s = self.schedule
        wide = self.streams > 32
        pending = defaultdict(int)
        for ws in s.waits:
            for u in ws:
                pending[u] += 1
        after: dict = {}  # clocks kept: last op per stream, and waited-on ops
        last_on: dict[int, int] = {}
        empty = np.full(self.streams, -1, dtype=np.int64) if wide else [-1] * self.streams
        for v in s.order:
            stream = s.stream[v]
            sources = ([after[last_on[stream]]] if stream in last_on else []) + [after[u] for u in s.waits[v]]
            if not sources:
                clock = empty.copy()
            elif len(sources) == 1:
                clock = sources[0].copy()
            elif wide:
                clock = np.maximum.reduce(sources)
            else:
                clock = list(map(max, *sources))
            for u in s.waits[v]:
                pending[u] -= 1
            yield v, clock
            done = clock.copy()
            done[stream] = self.seq[v]
            previous = last_on.get(stream)
            last_on[stream] = v
            after[v] = done
            if previous is not None and pending.get(previous, 0) == 0:
                after.pop(previous, None)
            for u in s.waits[v]:
                if pending[u] == 0 and last_on.get(s.stream[u]) != u:
                    after.pop(u, None)
