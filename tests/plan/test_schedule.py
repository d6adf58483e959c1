"""The schedule's guarantees, checked on random DAGs against networkx as an independent reference."""

import random

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimble.frontend import load_module, lower
from nimble.pipeline import rewrite
from nimble.ir import TensorSpec
from nimble.plan.matching import hopcroft_karp
from nimble.plan.schedule import AUTO_STREAMS, assign_streams, schedule_dag, transitive_reduction

from ..conftest import SAMPLES


def random_dag(n: int, density: float, locality: int, seed: int) -> list[list[int]]:
    """Node v depends on a few earlier nodes, mostly recent ones (like a network's layers)."""
    rng = random.Random(seed)
    preds = []
    for v in range(n):
        k = min(v, rng.choice([0, 1, 1, 1, 2, 2, 3]) if rng.random() < density else 1)
        lo = max(0, v - locality)
        preds.append(sorted({rng.randrange(lo, v) for _ in range(k)}) if v else [])
    return preds


dags = st.builds(random_dag, n=st.integers(1, 300), density=st.floats(0.2, 1.0),
                 locality=st.integers(1, 60), seed=st.integers(0, 2**32))


def nx_graph(preds) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(len(preds)))
    g.add_edges_from((u, v) for v, ps in enumerate(preds) for u in ps)
    return g


def sync_graph(schedule) -> nx.DiGraph:
    """Happens-before as CUDA sees it: stream order plus event waits."""
    g = nx.DiGraph()
    g.add_nodes_from(range(len(schedule.stream)))
    last: dict[int, int] = {}
    for v in schedule.order:
        s = schedule.stream[v]
        if s in last:
            g.add_edge(last[s], v)
        last[s] = v
        g.add_edges_from((u, v) for u in schedule.waits[v])
    return g


def assert_enforced(preds, schedule):
    """(c): every dependency follows from stream order and a chain of waits."""
    assert sorted(schedule.order) == list(range(len(preds)))
    for v, ps in enumerate(preds):
        for u in ps:
            assert schedule.position[u] < schedule.position[v], "issue order is not topological"
    hb = sync_graph(schedule)
    closure = nx.transitive_closure_dag(hb)
    for v, ps in enumerate(preds):
        for u in ps:
            assert closure.has_edge(u, v), f"dependency {u}->{v} is not enforced"


@settings(max_examples=60, deadline=None)
@given(dags)
def test_reduction_matches_networkx(preds):
    ours = {(u, v) for v, ps in enumerate(transitive_reduction(preds)) for u in ps}
    assert ours == set(nx.transitive_reduction(nx_graph(preds)).edges)


@settings(max_examples=60, deadline=None)
@given(dags)
def test_auto_schedule_guarantees(preds):
    s = schedule_dag(preds, "auto")
    g = nx_graph(preds)
    closure = nx.transitive_closure_dag(g)
    chains = len(preds) - s.matching
    if chains > AUTO_STREAMS:  # auto merges the chains onto the widest level's count of streams
        assert s.num_streams <= min(s.max_width, AUTO_STREAMS)
        assert_enforced(preds, s)
        return
    # (a) ops on one stream are pairwise ordered by a path: checking issue-order neighbours suffices
    last: dict[int, int] = {}
    for v in s.order:
        if s.stream[v] in last:
            assert closure.has_edge(last[s.stream[v]], v), "independent ops share a stream"
        last[s.stream[v]] = v
    # (b) waits = |E(reduction)| - |maximum matching|, from networkx
    red = nx.transitive_reduction(g)
    bip = nx.Graph()
    left = [("L", u) for u in range(len(preds))]
    bip.add_nodes_from(left)
    bip.add_nodes_from(("R", v) for v in range(len(preds)))
    bip.add_edges_from((("L", u), ("R", v)) for u, v in red.edges)
    matching = len(nx.bipartite.hopcroft_karp_matching(bip, top_nodes=left)) // 2
    assert s.num_waits == red.number_of_edges() - matching
    assert s.num_streams == len(preds) - matching
    # (c)
    assert_enforced(preds, s)
    # (d)
    assert schedule_dag(preds, "auto") == s
    # and each wait is on a reduction edge that crosses streams
    for v, ws in enumerate(s.waits):
        for u in ws:
            assert red.has_edge(u, v) and s.stream[u] != s.stream[v]


@settings(max_examples=60, deadline=None)
@given(dags, st.integers(1, 8))
def test_capped_schedules_are_correct_and_keep_no_redundant_wait(preds, cap):
    s = schedule_dag(preds, cap)
    assert s.num_streams <= cap
    assert_enforced(preds, s)
    assert schedule_dag(preds, cap) == s
    if cap == 1:
        assert s.num_waits == 0 and set(s.stream) <= {0}
    hb = sync_graph(s)
    for v, ws in enumerate(s.waits):  # every wait is needed: without it, u no longer precedes v
        for u in ws:
            hb.remove_edge(u, v)
            assert not nx.has_path(hb, u, v), f"wait {u}->{v} is redundant"
            hb.add_edge(u, v)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.floats(0, 0.5), st.integers(0, 2**32))
def test_hopcroft_karp_finds_a_maximum_matching(n_left, n_right, p, seed):
    rng = random.Random(seed)
    adj = [[v for v in range(n_right) if rng.random() < p] for _ in range(n_left)]
    match = hopcroft_karp(adj, n_right)
    used = [v for v in match if v >= 0]
    assert len(used) == len(set(used))
    assert all(v in adj[u] for u, v in enumerate(match) if v >= 0)
    g = nx.Graph()
    g.add_nodes_from(("L", u) for u in range(n_left))
    g.add_nodes_from(("R", v) for v in range(n_right))
    g.add_edges_from((("L", u), ("R", v)) for u in range(n_left) for v in adj[u])
    best = len(nx.bipartite.hopcroft_karp_matching(g, top_nodes=[("L", u) for u in range(n_left)])) // 2
    assert len(used) == best


def test_a_node_depending_on_a_later_node_is_rejected():
    with pytest.raises(ValueError, match="does not come before"):
        schedule_dag([[1], []])


@pytest.mark.parametrize("bad", [0, -2, "two", "1.5"])
def test_bad_stream_counts_are_rejected(bad):
    with pytest.raises(ValueError, match="streams must be"):
        schedule_dag([[], [0]], bad)


def test_inception_blocks_run_their_four_branches_on_four_streams():
    graph = rewrite(lower(load_module(SAMPLES / "inception.pt"), [TensorSpec((1, 3, 224, 224), "float32")])).graph
    s = assign_streams(graph)
    for cat in (op for op in graph.ops if op.target == "aten::cat.default"):
        branch_streams = {s.stream[graph.values[r].producer] for r in cat.refs()}
        assert len(branch_streams) == 4
    assert_enforced([graph.deps(op) for op in graph.ops], s)


def test_a_pure_chain_needs_one_stream_and_no_waits():
    graph = rewrite(lower(load_module(SAMPLES / "mobilenet.pt"), [TensorSpec((1, 3, 224, 224), "float32")])).graph
    s = assign_streams(graph)
    assert s.num_streams == 1 and s.num_waits == 0


def test_auto_caps_a_long_chain_of_forks_by_its_width():
    """200 three-way forks and joins: hundreds of chains, but never more than 3 ops ready at
    one level, so auto gives 3 streams, and every dependency still holds."""
    preds: list[list[int]] = [[]]
    for _ in range(200):
        join = len(preds) - 1
        preds += [[join], [join], [join]]
        preds.append([len(preds) - 3, len(preds) - 2, len(preds) - 1])
    s = schedule_dag(preds, "auto")
    assert len(preds) - s.matching > AUTO_STREAMS
    assert s.max_width == 3 and s.num_streams == 3
    assert_enforced(preds, s)
