"""Nimble's multi-stream schedule: which stream runs each op, in what order, and which
cross-stream event waits keep it correct.

    1. dependency DAG (data edges + ordering edges)  ->  transitive reduction (ancestor bitsets)
    2. maximum matching in the reduction's bipartite graph (Hopcroft-Karp)
    3. each matched path is a chain; each chain gets a stream
    4. an event wait on exactly the reduction edges that cross streams

Two ops on one chain are always connected by a path, so independent ops never share a stream;
and every unmatched reduction edge crosses streams, so the waits number |E_red| - |matching|, the
minimum for any assignment with maximum concurrency (Kwon et al., NeurIPS 2020, section 4).

With a stream cap (`streams=N`), chains are merged; see `_merge_chains` for the rule. "auto" is
the paper's one stream per chain while that is at most AUTO_STREAMS streams; a graph with more
chains (a long chain of small forks has thousands) has them merged onto as many streams as its
widest level holds ops, at most AUTO_STREAMS: more streams than ops that can ever be ready at
one level only add waits. Ops are
issued in ASAP-level order (ties by op id), which is topological, so any merge stays correct;
waits are then pruned with vector clocks to those not already implied.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Graph
from .matching import hopcroft_karp

AUTO_STREAMS = 64  # auto's limit; CUDA runs at most 32 hardware queues at once


@dataclass(frozen=True)
class Schedule:
    stream: tuple[int, ...]  # stream of each op
    order: tuple[int, ...]  # op ids in issue order (a topological order)
    position: tuple[int, ...]  # index of each op in `order`
    waits: tuple[tuple[int, ...], ...]  # per op: ops on other streams it waits for
    reduction_edges: int  # edges of the transitive reduction
    matching: int  # size of the maximum matching (= ops - chains)
    critical_path: int  # ops on the longest dependency path
    max_width: int  # most ops on one ASAP level
    requested: str  # "auto" or the cap, as given
    # the capped candidates compile stores (`capped.py`): (cap, CUDA stream of each op), by cap
    capped: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def num_streams(self) -> int:
        return max(self.stream, default=-1) + 1

    @property
    def num_waits(self) -> int:
        return sum(len(w) for w in self.waits)


def assign_streams(graph: Graph, streams: str | int = "auto") -> Schedule:
    """The schedule of `graph`'s ops. `streams` is "auto" (one stream per chain), 1, or a cap N."""
    return schedule_dag([graph.deps(op) for op in graph.ops], streams)


def schedule_dag(preds: list[tuple[int, ...]] | list[list[int]], streams: str | int = "auto") -> Schedule:
    """The schedule of a DAG whose node v depends on preds[v]; every pred must be < v."""
    cap = _parse_cap(streams)
    n = len(preds)
    reduced = transitive_reduction(preds)
    succ: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(reduced):
        for u in ps:
            succ[u].append(v)
    match = hopcroft_karp(succ, n)
    chains = _chains(match)
    level = _asap(reduced)
    order = tuple(sorted(range(n), key=lambda v: (level[v], v)))
    position = [0] * n
    for i, v in enumerate(order):
        position[v] = i
    width: dict[int, int] = {}
    for lv in level:
        width[lv] = width.get(lv, 0) + 1
    max_width = max(width.values(), default=0)
    if cap is None and len(chains) > AUTO_STREAMS:
        cap = min(max_width, AUTO_STREAMS)

    if cap is None or cap >= len(chains):
        chain_of = [0] * n
        for c, chain in enumerate(chains):
            for v in chain:
                chain_of[v] = c
        stream = _number_streams(chain_of, order)
        waits = tuple(tuple(u for u in reduced[v] if stream[u] != stream[v]) for v in range(n))
    else:
        stream = _number_streams(_merge_chains(chains, reduced, succ, level, cap), order)
        waits = _pruned_waits(reduced, stream, order, position)

    return Schedule(
        stream=tuple(stream), order=order, position=tuple(position), waits=waits,
        reduction_edges=sum(len(ps) for ps in reduced), matching=sum(m >= 0 for m in match),
        critical_path=max(level, default=-1) + 1, max_width=max_width,
        requested=str(streams))


def transitive_reduction(preds) -> list[tuple[int, ...]]:
    """For each node, its predecessors in the minimum equivalent graph of the DAG.

    anc[v] is a bitset (a Python int) of v's ancestors. Taking v's preds from the latest down, a
    pred already among the ancestors of a later-kept pred is implied by it, so it is dropped."""
    anc: list[int] = []
    reduced: list[tuple[int, ...]] = []
    for v, ps in enumerate(preds):
        covered, keep = 0, []
        for p in sorted(set(ps), reverse=True):
            if p >= v:
                raise ValueError(f"node {v} depends on node {p}, which does not come before it")
            if not covered >> p & 1:
                keep.append(p)
                covered |= anc[p] | 1 << p
        anc.append(covered)
        reduced.append(tuple(sorted(keep)))
    return reduced


def _parse_cap(streams: str | int) -> int | None:
    if streams == "auto":
        return None
    try:
        cap = int(streams)
    except (TypeError, ValueError):
        cap = 0
    if cap < 1:
        raise ValueError(f"streams must be 'auto' or a positive integer, not {streams!r}")
    return cap


def _chains(match: list[int]) -> list[list[int]]:
    """The paths of the matching: follow match[] from every node that no one is matched to."""
    has_pred = [False] * len(match)
    for v in match:
        if v >= 0:
            has_pred[v] = True
    chains = []
    for head in range(len(match)):
        if not has_pred[head]:
            chain, v = [], head
            while v >= 0:
                chain.append(v)
                v = match[v]
            chains.append(chain)
    return chains


def _asap(reduced) -> list[int]:
    """Longest path (in ops) from any source to each node; a longest path uses reduction edges only."""
    level = [0] * len(reduced)
    for v, ps in enumerate(reduced):
        if ps:
            level[v] = 1 + max(level[p] for p in ps)
    return level


def _number_streams(group: list[int], order) -> list[int]:
    """Renumber groups as streams 0, 1, ... in the order their first op is issued."""
    ids: dict[int, int] = {}
    for v in order:
        ids.setdefault(group[v], len(ids))
    return [ids[g] for g in group]


def _merge_chains(chains, reduced, succ, level, cap: int) -> list[int]:
    """Put the chains on `cap` streams, losing as little parallelism as possible.

    The rule: compute each op's slack (ALAP level - ASAP level; 0 on a critical path). Place
    chains in order of least slack, then longest, then earliest head. Each chain goes to the
    stream where the fewest already-placed ops sit on the same ASAP levels as its own ops (those
    are the ops it would now run behind); ties go to the lowest stream. Critical chains are
    therefore placed first, onto streams of their own, and chains that would run at the same
    time spread across streams instead of queueing on one."""
    n = len(reduced)
    depth = max(level, default=0)
    alap = [depth] * n
    for v in range(n - 1, -1, -1):
        if succ[v]:
            alap[v] = min(alap[s] for s in succ[v]) - 1
    slack = [alap[v] - level[v] for v in range(n)]
    ranked = sorted(range(len(chains)), key=lambda c: (min(slack[v] for v in chains[c]), -len(chains[c]), chains[c][0]))
    occupancy: list[dict[int, int]] = [{} for _ in range(cap)]
    group = [0] * n
    for c in ranked:
        chain = chains[c]
        best = min(range(cap), key=lambda s: (sum(occupancy[s].get(level[v], 0) for v in chain), s))
        for v in chain:
            group[v] = best
            occupancy[best][level[v]] = occupancy[best].get(level[v], 0) + 1
    return group


def _pruned_waits(reduced, stream, order, position) -> tuple[tuple[int, ...], ...]:
    """Waits for cross-stream reduction edges not already implied by stream order and earlier
    waits, found with vector clocks: clock[s][t] is the last position on stream t known to be
    complete before the next op on stream s starts."""
    num = max(stream) + 1
    clock = [[-1] * num for _ in range(num)]
    done: list[list[int] | None] = [None] * len(reduced)
    waits: list[tuple[int, ...]] = [()] * len(reduced)
    for v in order:
        s = stream[v]
        mine = clock[s]
        chosen = []
        for u in sorted(reduced[v], key=lambda u: -position[u]):
            t = stream[u]
            if t != s and mine[t] < position[u]:
                chosen.append(u)
                mine[:] = [max(a, b) for a, b in zip(mine, done[u])]
        mine[s] = position[v]
        done[v] = list(mine)
        waits[v] = tuple(sorted(chosen))
    return tuple(waits)
