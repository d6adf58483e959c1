"""The memory plan: every activation at a fixed, 256-byte aligned offset in one arena, with reuse
that is safe when ops run concurrently on several streams.

A buffer is the storage of one root activation; views and in-place results share their root's
buffer, and their uses count as uses of it. Two buffers may share bytes only if every use of one
happens-before the producer of the other, where happens-before is what the GPU guarantees: issue
order on one stream plus event waits, transitively. Independence in the DAG is not enough.
Graph outputs get regions of their own for the whole replay.

The lower bound is the largest total of buffers that pairwise must be live at once (see
`_lower_bound`); no valid plan can use less. Placement (see `_search`) tries best fit in the
manner of TFLite's greedy-by-size first, then, while the arena is above the bound, a bounded,
seeded squeaky-wheel search over bottom-left placements.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import numpy as np

from ..ir import ACTIVATION, ITEMSIZE, Graph
from .flow import FlowNetwork
from .schedule import Schedule, transitive_reduction

ALIGNMENT = 256


@dataclass(frozen=True)
class MemoryPlan:
    offset: tuple[int | None, ...]  # per value: byte offset of its buffer in the arena (roots only)
    size: tuple[int, ...]  # per value: aligned bytes reserved (roots only, else 0)
    arena_bytes: int
    lower_bound_bytes: int
    no_reuse_bytes: int  # every buffer in a region of its own
    alignment: int = ALIGNMENT

    def offset_of(self, graph: Graph, value: int) -> int | None:
        """Arena offset of a value's first byte: its root's offset plus a view's storage offset.
        None for inputs, weights and their views, which live outside the arena."""
        v = graph.values[value]
        root = graph.root(value)
        if self.offset[root] is None:
            return None
        return self.offset[root] + v.spec.offset * ITEMSIZE[v.spec.dtype]


def plan(graph: Graph, schedule: Schedule) -> MemoryPlan:
    """Place every activation buffer of `graph` for execution under `schedule`."""
    # buffers in a topological order: a buffer can only follow one produced earlier
    roots = sorted((v.id for v in graph.values if v.kind == ACTIVATION and v.alias_of is None),
                   key=lambda r: (schedule.position[graph.values[r].producer], r))
    size = {r: _align(graph.values[r].spec.storage_nbytes) for r in roots}
    producer = {r: graph.values[r].producer for r in roots}
    uses = buffer_uses(graph, roots)
    outputs = {graph.root(o) for o in graph.outputs} & set(roots)
    ordered = _order(roots, uses, producer, outputs, happens_before(graph, schedule), len(graph.ops))
    free = ordered | ordered.T
    conflicts = {r: [roots[j] for j in np.flatnonzero(~free[i]) if j != i] for i, r in enumerate(roots)}
    span = {r: (uses[r].bit_length() - producer[r]) for r in roots}  # rough lifetime, in op ids
    bound = _lower_bound([size[r] for r in roots], ordered)
    offset = _search(roots, size, conflicts, producer, span, bound)
    arena = _top(offset, size)

    offsets: list[int | None] = [None] * len(graph.values)
    sizes = [0] * len(graph.values)
    for r in roots:
        offsets[r], sizes[r] = offset[r], size[r]
    return MemoryPlan(tuple(offsets), tuple(sizes), arena, bound, sum(size.values()))


def _order(roots, uses, producer, outputs, before, n_ops) -> np.ndarray:
    """ordered[i, j]: every use of buffer i happens-before buffer j's producer, so j may take
    i's bytes. Graph outputs are ordered with nothing. One matrix product over op bitsets."""
    def rows(masks: list[int]) -> np.ndarray:
        width = (n_ops + 7) // 8
        packed = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), np.uint8)
        bits = np.unpackbits(packed.reshape(len(masks), width), axis=1, bitorder="little")
        return bits[:, :n_ops].astype(np.float32)

    if not roots:
        return np.zeros((0, 0), dtype=bool)
    used = rows([uses[r] for r in roots])
    not_before = 1.0 - rows([before[producer[r]] for r in roots])
    ordered = (used @ not_before.T) == 0  # counts stay exact in float32 below 2**24 ops
    is_output = np.array([r in outputs for r in roots])
    ordered[is_output, :] = False
    ordered[:, is_output] = False
    np.fill_diagonal(ordered, False)
    return ordered


def happens_before(graph: Graph, schedule: Schedule) -> list[int]:
    """before[v]: bitset of the ops guaranteed complete when op v starts (stream order + waits)."""
    before = [0] * len(graph.ops)
    preds = _sync_preds(schedule)
    for v in schedule.order:
        for u in preds[v]:
            before[v] |= before[u] | 1 << u
    return before


def _sync_preds(schedule: Schedule) -> list[tuple[int, ...]]:
    """Per op, the ops it directly waits for: its stream predecessor and its event waits."""
    preds: list[tuple[int, ...]] = [()] * len(schedule.stream)
    last_on: dict[int, int] = {}
    for v in schedule.order:
        s = schedule.stream[v]
        preds[v] = schedule.waits[v] + ((last_on[s],) if s in last_on else ())
        last_on[s] = v
    return preds


def buffer_uses(graph: Graph, roots) -> dict[int, int]:
    """Bitset of the ops that touch each buffer: its producer and every reader of it or its views."""
    uses = {r: 1 << graph.values[r].producer for r in roots}
    for op in graph.ops:
        for ref in op.refs():
            root = graph.root(ref)
            if root in uses:
                uses[root] |= 1 << op.id
    return uses


def _align(n: int) -> int:
    return max(ALIGNMENT, -(-n // ALIGNMENT) * ALIGNMENT)


# The search: a fixed amount of work, so a plan is reproducible and big graphs stay fast.
_CHAIN = 60  # placements per start order
_WORK = 3_000_000  # conflict-list entries walked in all (one placement walks each list once)
_BOOST = 0.25  # how far, at most, a buffer above the bound moves up the order (x buffer count)


def _search(roots, size, conflicts, producer, span, bound) -> dict[int, int]:
    """Offsets for every buffer, stopping as soon as the arena meets the lower bound.

    First, best fit (TFLite's greedy by size) in three orders: by size, by breadth (size x
    lifetime) and in production order. Where that leaves the arena above the bound, a
    squeaky-wheel search over bottom-left placements: the buffers that end above the bound move
    up the order by a random amount, and the order is placed again. It starts once from each of
    four orders, and is seeded, so the same graph always gets the same plan."""
    if not roots:
        return {}
    keys = (lambda r: (-size[r], producer[r], r), lambda r: (-size[r] * span[r], producer[r], r),
            lambda r: (producer[r], -size[r], r), lambda r: (-span[r], -size[r], r))
    starts = [sorted(roots, key=k) for k in keys]
    best = min((_place(o, size, conflicts) for o in starts[:3]), key=lambda off: _top(off, size))
    walked = sum(len(c) for c in conflicts.values()) + len(roots)
    chain = min(_CHAIN, _WORK // (walked * len(starts)))
    rng = random.Random(0)
    for start in starts:
        if _top(best, size) <= bound:
            break
        priority = {r: len(start) - i for i, r in enumerate(start)}
        for _ in range(chain):
            order = sorted(roots, key=lambda r: -priority[r])
            offset = _bottom_left(order, size, conflicts)
            if _top(offset, size) < _top(best, size):
                best = offset
            if _top(best, size) <= bound:
                break
            for r in roots:
                if offset[r] + size[r] > bound:
                    priority[r] += _BOOST * len(roots) * rng.random()
    return best


def _top(offset: dict[int, int], size: dict[int, int]) -> int:
    return max((offset[r] + size[r] for r in offset), default=0)


def _place(order: list[int], size: dict[int, int], conflicts: dict[int, list[int]]) -> dict[int, int]:
    """Offsets from placing buffers in `order`, each in the tightest gap among placed conflicts."""
    offset: dict[int, int] = {}
    for r in order:
        busy = [(offset[p], offset[p] + size[p]) for p in conflicts[r] if p in offset]
        offset[r] = _best_fit(busy, size[r])
    return offset


def _best_fit(busy: list[tuple[int, int]], need: int) -> int:
    """The start of the smallest gap of at least `need` bytes between busy ranges, else the end."""
    best, best_gap, cursor = None, None, 0
    for start, end in sorted(busy):
        gap = start - cursor
        if gap >= need and (best_gap is None or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, end)
    return cursor if best is None else best


def _bottom_left(order: list[int], size: dict[int, int], conflicts: dict[int, list[int]]) -> dict[int, int]:
    """Bottom-left packing: the next buffer placed is the one whose floor (the top of its placed
    conflicts) is lowest, ties going to the earliest in `order`; it sits on that floor."""
    rank = {r: i for i, r in enumerate(order)}
    floor = dict.fromkeys(order, 0)
    heap = [(0, rank[r], r) for r in order]
    offset: dict[int, int] = {}
    while heap:
        at, _, r = heapq.heappop(heap)
        if r in offset or at != floor[r]:
            continue  # placed already, or a stale entry: its floor has risen since
        offset[r] = at
        top = at + size[r]
        for c in conflicts[r]:
            if c not in offset and floor[c] < top:
                floor[c] = top
                heapq.heappush(heap, (top, rank[c], c))
    return offset


def _lower_bound(sizes: list[int], ordered: np.ndarray) -> int:
    """The heaviest set of buffers that pairwise must be live at once, i.e. the maximum-weight
    antichain of the buffer order. By weighted Dilworth it is the total size minus the most bytes
    that chains of that order can share: a max flow from each buffer's end to any later buffer's
    start, through the order's transitive reduction. Buffers come in a topological order."""
    n = len(sizes)
    reduced = transitive_reduction([tuple(np.flatnonzero(ordered[:k, k]).tolist()) for k in range(n)])
    src, sink = 2 * n, 2 * n + 1  # node 2k: buffer k's end; node 2k + 1: its start
    net = FlowNetwork(2 * n + 2)
    infinite = sum(sizes) + 1
    for k in range(n):
        net.add_edge(src, 2 * k, sizes[k])
        net.add_edge(2 * k + 1, sink, sizes[k])
        net.add_edge(2 * k + 1, 2 * k, infinite)  # a chain may pass through buffer k
        for i in reduced[k]:
            net.add_edge(2 * i, 2 * k + 1, infinite)
    return sum(sizes) - net.max_flow(src, sink)
