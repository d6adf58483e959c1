"""Folding the planned streams onto fewer CUDA streams for capture (`plan/capped.fold`) adds no
ordering the schedule lacks: each CUDA stream's ops follow one another in the schedule already."""

import dataclasses
import random
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nimble.frontend import load_module, lower
from nimble.pipeline import rewrite
from nimble.plan.capped import fold
from nimble.plan.memory import plan
from nimble.plan.schedule import assign_streams, schedule_dag
from nimble.plan.verify import check_plan
from nimble.runtime.base import streams
from nimble.specs import input_specs

from ..conftest import SAMPLES
from ..plan.test_memory import random_graph
from ..plan.test_schedule import dags


def preceding(schedule) -> dict[int, int]:
    """op -> bitset of the ops the schedule orders before it (its stream's earlier ops and waits)."""
    before, previous = {}, {}
    for i in schedule.order:
        mask = 0
        for p in [*schedule.waits[i], *([previous[schedule.stream[i]]] if schedule.stream[i] in previous else [])]:
            mask |= before[p] | (1 << p)
        before[i], previous[schedule.stream[i]] = mask, i
    return before


def assert_folds_without_new_order(schedule) -> list[int]:
    cuda = fold(schedule.order, schedule.stream, schedule.waits)
    before, last = preceding(schedule), {}
    for i in schedule.order:
        if cuda[i] in last:
            assert before[i] >> last[cuda[i]] & 1, (i, last[cuda[i]])  # already ordered by the schedule
        last[cuda[i]] = i
    planned = {}
    for i in schedule.order:  # a planned stream stays on one CUDA stream
        assert planned.setdefault(schedule.stream[i], cuda[i]) == cuda[i]
    assert len(set(cuda)) <= schedule.num_streams
    return cuda


@settings(max_examples=150, deadline=None)
@given(dags)
def test_folding_never_orders_what_the_schedule_leaves_parallel(preds):
    assert_folds_without_new_order(schedule_dag(preds))


def folded_schedule(schedule, cap):
    """The schedule as capture issues it with `fold(..., cap)`: each op on its CUDA stream, the
    waits on ops of other CUDA streams kept (the executable drops the rest: issue order keeps them)."""
    cuda = fold(schedule.order, schedule.stream, schedule.waits, cap)
    waits = tuple(tuple(u for u in ws if cuda[u] != cuda[i]) for i, ws in enumerate(schedule.waits))
    return dataclasses.replace(schedule, stream=tuple(cuda), waits=waits)


@settings(max_examples=150, deadline=None)
@given(dags, st.integers(1, 3))
def test_a_stream_cap_is_kept_and_keeps_each_planned_stream_whole(preds, cap):
    schedule = schedule_dag(preds)
    cuda = fold(schedule.order, schedule.stream, schedule.waits, cap)
    assert len(set(cuda)) <= cap
    assert set(cuda) == set(range(len(set(cuda))))  # numbered from 0 without gaps
    planned = {}
    for i in schedule.order:
        assert planned.setdefault(schedule.stream[i], cuda[i]) == cuda[i]
    if len(set(fold(schedule.order, schedule.stream, schedule.waits))) <= cap:  # the cap is not reached:
        assert cuda == fold(schedule.order, schedule.stream, schedule.waits)  # folding as without it


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 120), st.integers(1, 4), st.integers(0, 2**32))
def test_the_memory_plan_of_the_planned_streams_is_safe_on_capped_streams(n, cap, seed):
    """The plan is made once, for the planned streams; the plan checker proves it safe as the
    capped streams run it, and proves the capped streams keep every dependency."""
    graph = random_graph(random.Random(seed), n)
    schedule = assign_streams(graph)
    memory = plan(graph, schedule)
    check_plan(graph, folded_schedule(schedule, cap), memory)


def test_the_nasnet_sample_plan_holds_on_two_cuda_streams():
    graph = rewrite(lower(load_module(SAMPLES / "nasnet.pt"), input_specs(["1x3x64x64"]), "nasnet")).graph
    schedule = assign_streams(graph)
    capped = folded_schedule(schedule, 2)
    assert len(set(capped.stream)) == 2 < len(set(fold(schedule.order, schedule.stream, schedule.waits)))
    check_plan(graph, capped, plan(graph, schedule))


def test_inception_needs_fewer_cuda_streams_than_it_plans():
    graph = rewrite(lower(load_module(SAMPLES / "inception.pt"), input_specs(["1x3x64x64"]), "inception")).graph
    schedule = assign_streams(graph)
    cuda = assert_folds_without_new_order(schedule)
    assert len(set(cuda)) < schedule.num_streams


def test_results_are_released_after_their_last_reader_and_only_on_one_stream(tmp_path):
    """`streams.release_plan` (used on CUDA): each value once, at its last reader in issue
    order; never a graph output's storage; never storage that another CUDA stream also uses."""
    import nimble

    from ..cli.test_cli import invoke

    out = tmp_path / "i.nimble"
    assert invoke("compile", SAMPLES / "nasnet.pt", "-s", "1x3x64x64", "--device", "cpu", "-o", out).exit_code == 0
    exe = nimble.load(out, device="cpu")
    from nimble.runtime.base.streams import release_plan

    g = exe.graph
    plan = release_plan(g, exe._order, exe._stream_of)
    position = {op: k for k, op in enumerate(exe._order)}
    released = [v for vs in plan.values() for v in vs]
    assert released and len(released) == len(set(released))
    outputs = {g.root(o) for o in g.outputs}
    users: dict[int, set[int]] = {}
    for op in g.ops:
        for v in [*op.outputs, *op.refs()]:
            users.setdefault(g.root(v), set()).add(exe._stream_of[op.id])
    for at, values in plan.items():
        for v in values:
            readers = [op.id for op in g.ops if v in op.refs()]
            assert at == max(readers, key=position.get, default=g.values[v].producer)
            assert g.root(v) not in outputs and len(users[g.root(v)]) == 1
    assert len(set(exe._stream_of)) > 1  # the nasnet sample runs on several CUDA streams
    kept_apart = [v for v in range(len(g.values)) if g.values[v].producer is not None and v not in released
                  and g.root(v) not in outputs]
    assert kept_apart  # values shared across streams stay to the end


def joined_release(g, s) -> int:
    """Check `streams.release_plan` with the schedule's waits against the schedule's own order
    (`preceding`); returns how many values it drops that the plan without waits keeps to the end."""
    without = streams.release_plan(g, s.order, s.stream)
    plan = streams.release_plan(g, s.order, s.stream, s.waits)
    released = [v for vs in plan.values() for v in vs]
    assert len(released) == len(set(released))
    assert {(op, v) for op, vs in without.items() for v in vs} <= {(op, v) for op, vs in plan.items() for v in vs}
    shared = {v for v in released if v not in {u for vs in without.values() for u in vs}}
    before, outputs = preceding(s), {g.root(o) for o in g.outputs}
    users: dict[int, set[int]] = {}
    for op in g.ops:
        for v in [*op.outputs, *op.refs()]:
            users.setdefault(g.root(v), set()).add(op.id)

    def after_all(op, root) -> bool:
        return all(u == op or before[op] >> u & 1 for u in users[root])

    for at, values in plan.items():
        for v in values:
            if v not in shared:
                continue
            root = g.root(v)
            maker = s.stream[g.values[root].producer]
            assert root not in outputs and s.stream[at] == maker and after_all(at, root)
            assert not any(after_all(op, root) for op in s.order[:s.position[at]] if s.stream[op] == maker)
    kept = [v for v in range(len(g.values)) if g.values[g.root(v)].producer is not None and v not in released
            and g.root(v) not in outputs]
    for v in kept:  # kept to the end only where no op of its maker's stream comes after every use
        root, maker = g.root(v), s.stream[g.values[g.root(v)].producer]
        assert not any(after_all(op, root) for op in s.order if s.stream[op] == maker)
    return len(shared)


def test_storage_shared_across_streams_is_dropped_once_its_stream_has_joined_every_use():
    """With the schedule's waits (a training step's runner passes them), storage used on several
    streams is dropped at the first op of the stream that made it which the schedule orders after
    every use of it; where no such op exists it stays to the end. Each value is dropped once, a
    graph output never. On random graphs, and on a training step's joint graph."""
    import torch.nn.functional as F

    import nimble

    from ..models import MobileNetV2Small

    dropped = 0
    for seed in range(40):
        graph = random_graph(random.Random(seed), 60)
        dropped += joined_release(graph, assign_streams(graph))
    assert dropped  # storage read on another stream than its maker's, dropped before the end
    torch.manual_seed(0)
    step = nimble.TrainStep(MobileNetV2Small(), F.cross_entropy, torch.randn(4, 3, 32, 32),
                            torch.randint(0, 10, (4,)), cuda_graphs=False)
    assert step.schedule.num_streams > 1
    joined_release(step.graph, step.schedule)


def test_a_graph_dump_writes_its_file_without_pytorch_s_debug_warning(tmp_path):
    """`streams.write_dot`: PyTorch warns on every CUDA graph dump, and `nimble bench` and a load's
    kernel counts dump unasked; the file is written and no such warning reaches the user, while
    any other warning still does."""
    import warnings

    class Graph:
        def debug_dump(self, path):
            warnings.warn(f"DEBUG: calling cudaGraphDebugDotPrint() with {path} (Triggered internally)", UserWarning)
            warnings.warn("something else", UserWarning)
            Path(path).write_text("digraph { KERNEL }")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        streams.write_dot(Graph(), tmp_path / "g.dot")
    assert [str(w.message) for w in caught] == ["something else"]
    assert streams.count_kernels(tmp_path / "g.dot") == 1


def test_every_graph_dump_in_nimble_goes_through_write_dot():
    """No other module calls `debug_dump` itself (it would print PyTorch's warning)."""
    root = Path(streams.__file__).resolve().parents[2]
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if ".debug_dump(" in p.read_text())
    assert callers == ["runtime/base/streams.py"]
