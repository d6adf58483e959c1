"""The memory plan: every activation at a fixed, 256-byte aligned offset in one arena, with reuse
that is safe when ops run concurrently on several streams.

A buffer is the storage of one root activation; views and in-place results share their root's
buffer, and their uses count as uses of it. A matrix product's inputs also count as used by the
one op that reads its result (`held_inputs`). Two buffers may share bytes only if every use of one
happens-before the producer of the other, where happens-before is what the GPU guarantees: issue
order on one stream plus event waits, transitively. Independence in the DAG is not enough.
Graph outputs get regions of their own for the whole replay.

Which buffers conflict (may be live at once) comes from one sweep over the issue order with
vector clocks (`clocks.py`); see `_sweep`. It costs O(ops x streams + conflicting pairs): no
buffers-by-ops matrices.

The lower bound is the largest total of buffers that pairwise must be live at once; no valid
plan can use less. It is exact (`_exact_bound`, a max flow) wherever that max flow finishes within
EXACT_WORK edge visits (50,000-op chains take a few million); otherwise it is the proven
`live-set` bound of `_sweep`, which is exact on one stream. `MemoryPlan.lower_bound` says which.
Placement (see `_search`) tries best fit in the manner of TFLite's greedy-by-size first, then,
while the arena is above the bound, a bounded, seeded squeaky-wheel search over bottom-left
placements.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from ..ir import ACTIVATION, ITEMSIZE, Graph, Ref
from ..ops import fusion
from .clocks import Clocks
from .flow import FlowNetwork
from .schedule import Schedule

ALIGNMENT = 256
EXACT_WORK = 40_000_000  # edge visits the exact bound's max flow may spend before the live-set bound stands in
EXACT, LIVE_SET = "exact", "live-set"


@dataclass(frozen=True)
class MemoryPlan:
    offset: tuple[int | None, ...]  # per value: byte offset of its buffer in the arena (roots only)
    size: tuple[int, ...]  # per value: aligned bytes reserved (roots only, else 0)
    arena_bytes: int
    lower_bound_bytes: int
    no_reuse_bytes: int  # every buffer in a region of its own
    alignment: int = ALIGNMENT
    lower_bound: str = EXACT  # how lower_bound_bytes was computed: EXACT or LIVE_SET

    def offset_of(self, graph: Graph, value: int) -> int | None:
        """Arena offset of a value's first byte: its root's offset plus a view's storage offset.
        None for inputs, weights and their views, which live outside the arena."""
        v = graph.values[value]
        root = graph.root(value)
        if self.offset[root] is None:
            return None
        return self.offset[root] + v.spec.offset * ITEMSIZE[v.spec.dtype]


def plan(graph: Graph, schedule: Schedule, unplanned: frozenset[int] = frozenset()) -> MemoryPlan:
    """Place every activation buffer of `graph` for execution under `schedule`, but those of the
    values in `unplanned` (which a runtime leaves to torch's allocator: a training step's results
    of ops that cannot write into a given buffer, `runtime/joint.loose`)."""
    # buffers in a topological order: a buffer can only follow one produced earlier
    roots = sorted((v.id for v in graph.values if v.kind == ACTIVATION and v.alias_of is None
                    and v.id not in unplanned),
                   key=lambda r: (schedule.position[graph.values[r].producer], r))
    size = {r: _align(graph.values[r].spec.storage_nbytes) for r in roots}
    producer = {r: graph.values[r].producer for r in roots}
    outputs = {graph.root(o) for o in graph.outputs} & set(roots)
    sweep = _sweep(graph, schedule, roots, size, outputs)
    span = {r: sweep.last_user[r] + 1 - producer[r] for r in roots}  # rough lifetime, in op ids
    bound, kind = _exact_bound(schedule, roots, size, producer, outputs, sweep.first_after), EXACT
    if bound is None:  # the max flow ran out of its budget
        bound, kind = sweep.live_bound, LIVE_SET
    offset = _search(roots, size, sweep.conflicts, producer, span, bound)
    arena = _top(offset, size)

    offsets: list[int | None] = [None] * len(graph.values)
    sizes = [0] * len(graph.values)
    for r in roots:
        offsets[r], sizes[r] = offset[r], size[r]
    return MemoryPlan(tuple(offsets), tuple(sizes), arena, bound, sum(size.values()), ALIGNMENT, kind)


@dataclass
class _Sweep:
    conflicts: dict[int, list[int]]  # buffer -> the buffers that may be live at the same time
    last_user: dict[int, int]  # buffer -> the highest op id that touches it
    first_after: dict[int, list[int]]  # buffer -> per stream, the first producer after all its uses
    live_bound: int  # the live-set lower bound


def _sweep(graph: Graph, schedule: Schedule, roots: list[int], size: dict[int, int], outputs: set[int]) -> _Sweep:
    """Conflicts between buffers, in one pass over the issue order.

    Buffer i "retires" on stream t at the first producer on t whose clock has seen every use of
    i; from then on, every buffer produced on t may take i's bytes. Clocks only grow along a
    stream, so retiring is for good. At each producer v on stream t, the buffers produced before
    v that have not retired on t are exactly those that conflict with v's outputs (a buffer
    produced later can never be ordered before one produced earlier). Graph outputs never
    retire: they conflict with every buffer and are added at the end.

    The live-set bound: at producer v, v's outputs plus the conflicting buffers whose producers
    happen-before v pairwise conflict (each has a use that v has not seen), and the graph outputs
    conflict with all; the heaviest such set over every v is a lower bound. On one stream it is
    the classic peak of live bytes, which is exact."""
    clocks = Clocks(schedule)
    seq, stream_of = clocks.seq, schedule.stream
    is_root = set(roots)
    last_use: dict[int, dict[int, int]] = {r: {} for r in roots}  # buffer -> stream -> last sequence used
    last_user = {r: graph.values[r].producer for r in roots}
    held = held_inputs(graph)
    for op in graph.ops:
        s, q = stream_of[op.id], seq[op.id]
        for ref in (*op.refs(), *op.outputs, *held.get(op.id, ())):
            r = graph.root(ref)
            if r in is_root:
                uses = last_use[r]
                if uses.get(s, -1) < q:
                    uses[s] = q
                if last_user[r] < op.id:
                    last_user[r] = op.id
    made: dict[int, list[int]] = {}  # producer op -> the non-output buffers it makes
    for r in roots:
        if r not in outputs:
            made.setdefault(graph.values[r].producer, []).append(r)
    produced: list[int] = []  # non-output buffers, in issue order of their producers
    seen_upto = [0] * clocks.streams  # per stream: how much of `produced` its active list has taken in
    active: list[list[int]] = [[] for _ in range(clocks.streams)]
    conflicts: dict[int, list[int]] = {r: [] for r in roots}
    first_after: dict[int, list[int]] = {r: [] for r in roots}
    live = 0
    for v, clock in clocks.walk():
        mine = made.get(v)
        if mine is None:
            continue
        t = stream_of[v]
        pending = active[t]
        pending.extend(produced[seen_upto[t]:])
        seen_upto[t] = len(produced)
        kept, weight = [], 0
        for i in pending:
            if all(clock[s] >= q for s, q in last_use[i].items()):
                first_after[i].append(v)
            else:
                kept.append(i)
                p = graph.values[i].producer
                if clock[stream_of[p]] >= seq[p]:
                    weight += size[i]
        active[t] = kept
        for j in mine:
            conflicts[j].extend(kept)
            conflicts[j].extend(k for k in mine if k != j)
            weight += size[j]
        for i in kept:
            conflicts[i].extend(mine)
        live = max(live, weight)
        produced.extend(mine)
    for o in outputs:
        conflicts[o] = [r for r in roots if r != o]
        for r in roots:
            if r not in outputs:
                conflicts[r].append(o)
    return _Sweep(conflicts, last_user, first_after, live + sum(size[o] for o in outputs))


# the products whose inputs are held (`held_inputs`): those `runtime/kernels/gemm.py` may pair with the op after them
PRODUCTS = ("aten::linear.default", "aten::addmm.default", "aten::mm.default", "aten::matmul.default")


def held_inputs(graph: Graph) -> dict[int, list[int]]:
    """op -> the values it holds, though it does not read them:

    - a matrix product's inputs, held by the one op that reads the product's result (directly or
      through views). The runtime may run the two as one kernel (`runtime.pairs.product_pairs`,
      and `scatter_pairs` where that op copies the product's views), whose tiles write that op's
      result while other tiles still read the product's inputs, so the result must not take
      their bytes;
    - an elementwise fused op's inputs, held by the 1x1 convolution that alone reads its result
      (`read_later`): the runtime may skip the elementwise op and apply its body as the
      convolution's kernel loads its input (`runtime.pointwise_conv`), so those inputs are read
      when the convolution runs."""
    readers = graph.readers()
    held: dict[int, list[int]] = {}
    for reader, producer in read_later(graph, readers).items():
        held.setdefault(reader, []).extend(graph.ops[producer].refs())
    for op in graph.ops:
        if op.target not in PRODUCTS or len(op.outputs) != 1:
            continue
        seconds = [k for k in readers.get(graph.root(op.outputs[0]), ())
                   if not all(graph.values[o].alias_of is not None for o in graph.ops[k].outputs)]  # views aside
        if len(seconds) == 1:
            held.setdefault(seconds[0], []).extend(op.refs())
    return held


def _exact_bound(schedule: Schedule, roots, size, producer, outputs, first_after) -> int | None:
    """The heaviest set of buffers that pairwise must be live at once: the maximum-weight
    antichain of the order "every use of i happens-before j's producer". By weighted Dilworth it
    is the total size minus the most bytes that chains of that order can share, a max flow from
    each buffer's end to any later buffer's start.

    The network stays sparse: buffer i's end leads to the first producer on each stream after
    all of i's uses (`first_after`), the ops lead to each other along the schedule's sync edges
    (stream order and event waits, whose closure is happens-before), and each producer leads to
    its buffers' starts. So i's end reaches j's start exactly when i is ordered before j."""
    n_ops = len(schedule.stream)
    n = len(roots)
    src, sink = 2 * n + n_ops, 2 * n + n_ops + 1  # node 2k: buffer k's end; 2k + 1: its start; 2n + v: op v
    net = FlowNetwork(2 * n + n_ops + 2)
    infinite = sum(size.values()) + 1
    for k, r in enumerate(roots):
        net.add_edge(src, 2 * k, size[r])
        net.add_edge(2 * k + 1, sink, size[r])
        if r in outputs:
            continue  # ordered with nothing
        net.add_edge(2 * k + 1, 2 * k, infinite)  # a chain may pass through buffer k
        net.add_edge(2 * n + producer[r], 2 * k + 1, infinite)
        for v in first_after[r]:
            net.add_edge(2 * k, 2 * n + v, infinite)
    last_on: dict[int, int] = {}
    for v in schedule.order:
        s = schedule.stream[v]
        for u in schedule.waits[v] + ((last_on[s],) if s in last_on else ()):
            net.add_edge(2 * n + u, 2 * n + v, infinite)
        last_on[s] = v
    flow = net.max_flow(src, sink, EXACT_WORK)
    return None if flow is None else sum(size.values()) - flow


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


def read_later(graph: Graph, readers: dict[int, set[int]] | None = None) -> dict[int, int]:
    """1x1 convolution op -> the elementwise op whose result it reads: for each fused op led by a
    2-D convolution with a 1x1 filter, stride 1, no padding and one group, whose input is the
    4-D floating result of a fused op that is elementwise (a cat may lead it: densenet's batch
    norm and ReLU over every feature map before), where that result is read by this op alone,
    once, as its convolution's input, and is no graph output and no view's base."""
    readers = graph.readers() if readers is None else readers
    outputs = {graph.root(o) for o in graph.outputs}
    viewed = {v.alias_of for v in graph.values if v.alias_of is not None}
    found: dict[int, int] = {}
    for op in graph.ops:
        if not fusion.is_fused(op) or not fusion.leads_with_convolution(fusion.body_of(op)):
            continue
        body = fusion.body_of(op)
        p = fusion.conv_params(body[0][0], body[0][1])
        if p is None or not isinstance(p["input"], Ref) or not isinstance(p["weight"], Ref) or p["groups"] != 1 \
                or tuple(p["stride"]) != (1, 1) or tuple(p["padding"]) != (0, 0):
            continue
        x = p["input"].id
        w = graph.values[p["weight"].id].spec.shape
        producer = graph.values[x].producer
        if len(w) != 4 or tuple(w[2:]) != (1, 1) or producer is None or graph.values[x].alias_of is not None \
                or x in outputs or x in viewed or readers.get(x) != {op.id} or list(op.refs()).count(x) != 1:
            continue
        first = graph.ops[producer]
        if not fusion.is_fused(first) or fusion.leads_with_convolution(fusion.body_of(first)) \
                or len(first.outputs) != 1 or len(graph.values[x].spec.shape) != 4 \
                or graph.values[x].spec.dtype not in fusion.FLOATS:
            continue
        found[op.id] = producer
    return found
