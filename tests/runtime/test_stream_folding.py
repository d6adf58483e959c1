"""Folding the planned streams onto fewer CUDA streams for capture (`streams.fold`) adds no
ordering the schedule lacks: each CUDA stream's ops follow one another in the schedule already."""

from hypothesis import given, settings

from nimble.frontend import load_module, lower
from nimble.pipeline import rewrite
from nimble.plan.schedule import assign_streams, schedule_dag
from nimble.runtime.streams import fold
from nimble.specs import input_specs

from ..conftest import SAMPLES
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


def test_inception_needs_fewer_cuda_streams_than_it_plans():
    graph = rewrite(lower(load_module(SAMPLES / "inception.pt"), input_specs(["1x3x64x64"]), "inception")).graph
    schedule = assign_streams(graph)
    cuda = assert_folds_without_new_order(schedule)
    assert len(set(cuda)) < schedule.num_streams


def test_results_are_released_after_their_last_reader_and_only_on_one_stream(tmp_path):
    """`placement.release_plan` (used on CUDA): each value once, at its last reader in issue
    order; never a graph output's storage; never storage that another CUDA stream also uses."""
    import nimble

    from ..cli.test_cli import invoke

    out = tmp_path / "i.nimble"
    assert invoke("compile", SAMPLES / "nasnet.pt", "-s", "1x3x64x64", "--device", "cpu", "-o", out).exit_code == 0
    exe = nimble.load(out, device="cpu")
    from nimble.runtime.placement import release_plan

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
