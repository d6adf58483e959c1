"""Structural checks of a schedule and a memory plan against their graph, for plans read from
disk: a plan that passes cannot race. `check_plan` raises ValueError naming the first breach.

It runs in O(n log n) time and O(n + streams^2) memory, so a stranger's file cannot turn
validation into a denial of service:

- happens-before comes from vector clocks (one entry per stream) computed in issue order, and
  only the clocks that later ops still need are kept;
- overlapping buffers are checked by a sweep over arena addresses that keeps the buffers live at
  the current address sorted by their producer's issue position. Being ordered (every use of one
  happens-before the other's producer) is transitive, so the buffers over any address are safe
  exactly when each pair of neighbours in that sorted list is; a sweep creates O(n) neighbour
  pairs in all.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from ..ir import ACTIVATION, Graph
from . import capped
from .clocks import Clocks
from .memory import ALIGNMENT, MemoryPlan
from .schedule import Schedule

MAX_STREAMS = 4096  # vector clocks cost streams^2 entries at worst


def check_plan(graph: Graph, schedule: Schedule, memory: MemoryPlan,
               held: dict[int, list[int]] | None = None, unplanned: frozenset[int] = frozenset()) -> None:
    """The schedule enforces every dependency, and the memory plan is safe under it: every
    activation buffer is placed and exactly as large as its tensor needs (aligned); nothing else
    has a buffer; overlapping buffers are ordered (every use of one happens-before the other's
    producer); graph outputs overlap nothing. One pass over the issue order checks both. `held`
    (op -> values) counts each listed value as used by that op too: the runtime proves with it
    that a plan holds the inputs of an op whose reads it moves to a later op. The activations in
    `unplanned` must have no buffer (`memory.plan`'s argument).

    The schedule's capped candidates (`capped.py`) are checked the same way, each as capture
    would issue it: the one memory plan must be safe under every one of them."""
    capped.check(schedule)
    for _, cuda in schedule.capped:
        check_plan(graph, capped.as_schedule(schedule, cuda), memory, held, unplanned)
    for v in range(len(graph.ops)):
        for u in schedule.waits[v]:
            if schedule.position[u] >= schedule.position[v]:
                raise ValueError(f"op {v} waits on op {u}, which is issued after it")
    clocks = Clocks(schedule, MAX_STREAMS)
    roots = [v.id for v in graph.values if v.kind == ACTIVATION and v.alias_of is None and v.id not in unplanned]
    is_root = set(roots)
    for v in graph.values:
        if memory.offset[v.id] is not None and v.id not in is_root:
            raise ValueError(f"value {v.id} has a buffer but is not an activation that owns its storage")
    for r in roots:
        need = max(ALIGNMENT, -(-graph.values[r].spec.storage_nbytes // ALIGNMENT) * ALIGNMENT)
        if memory.offset[r] is None or memory.size[r] != need:
            raise ValueError(f"activation {r} has no buffer, or one that is not the {need} bytes it needs")
    outputs = {graph.root(o) for o in graph.outputs}
    position = {r: schedule.position[graph.values[r].producer] for r in roots}
    pairs = _neighbours(roots, memory, position, outputs)
    last_use: dict[int, dict[int, int]] = {r: {} for r in roots}  # buffer -> stream -> highest sequence used
    for op in graph.ops:
        s, q = schedule.stream[op.id], clocks.seq[op.id]
        for ref in (*op.refs(), *op.outputs, *(held or {}).get(op.id, ())):
            per_stream = last_use.get(graph.root(ref))
            if per_stream is not None and per_stream.get(s, -1) < q:
                per_stream[s] = q
    by_later = defaultdict(list)  # producer of the later buffer -> the earlier buffers to check
    for a, b in pairs:
        by_later[graph.values[b].producer].append(a)
    producer = [v.producer for v in graph.values]
    stream_of, seq = schedule.stream, clocks.seq
    for v, clock in clocks.walk():
        op = graph.ops[v]
        for u in (*(producer[r] for r in op.refs()), *op.after):  # graph.deps, without building a set
            if u is not None and clock[stream_of[u]] < seq[u]:
                raise ValueError(f"op {v} may start before op {u}, which it depends on")
        for a in by_later.get(v, ()):
            if any(clock[s] < q for s, q in last_use[a].items()):
                b = next(b for x, b in pairs if x == a and graph.values[b].producer == v)
                raise ValueError(f"buffers of values {a} and {b} overlap but may be live at once")


def _neighbours(roots, memory: MemoryPlan, position: dict[int, int], outputs: set[int]) -> list[tuple[int, int]]:
    """The (earlier, later) buffer pairs that become neighbours, in producer order, among the
    buffers over some arena address. Raises at once if a graph output shares an address."""
    events = []
    for r in roots:
        start, end = memory.offset[r], memory.offset[r] + memory.size[r]
        events.append((start, 1, r))
        events.append((end, 0, r))  # at one address, ends come before starts: ranges are half-open
    events.sort()
    live: list[tuple[int, int]] = []  # (producer position, buffer), sorted
    pairs = []

    def pair(a: tuple[int, int], b: tuple[int, int]) -> None:
        if a[1] in outputs or b[1] in outputs:
            raise ValueError(f"buffers of values {a[1]} and {b[1]} overlap, and one is a graph output")
        pairs.append((a[1], b[1]))

    for _, starting, r in events:
        key = (position[r], r)
        i = bisect.bisect_left(live, key)
        if starting:
            if i > 0:
                pair(live[i - 1], key)
            if i < len(live):
                pair(key, live[i])
            live.insert(i, key)
        else:
            del live[i]
            if 0 < i < len(live):
                pair(live[i - 1], live[i])
    return pairs
