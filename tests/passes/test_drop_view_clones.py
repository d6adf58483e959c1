"""`passes/drop_view_clones`: a clone whose result only views read becomes, for each op that takes
one of them, the same view of the clone's source (nn.MultiheadAttention's packed projection, split
into query, key and value through a copy, in every layer of a transformer), where it is one."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

import nimble
from nimble import passes, train
from nimble.frontend.builder import GraphBuilder
from nimble.ir import Graph, TensorSpec
from nimble.passes.offsets import offsets, strided
from tests.models import TinyViT
from tests.runtime.test_train_step import batch, follows_eager

dvc = sys.modules["nimble.passes.drop_view_clones"]  # `nimble.passes.drop_view_clones` is the pass itself
CLONE = "aten::clone.default"
WITHOUT = tuple(p for p in train.JOINT_PASSES if p is not passes.drop_view_clones)


def test_attention_reads_the_packed_projection_through_views_and_the_step_gives_eager_s_gradients():
    torch.manual_seed(0)
    net = TinyViT()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 16))
    before = nimble.TrainStep(copy.deepcopy(net), F.cross_entropy, *batch(4, 16), graph_passes=WITHOUT)
    clones = [sum(op.target == CLONE for op in s.graph.ops) for s in (before, step)]
    # the packed projection's copy and the attention output's before the residual add go (torch
    # 2.13's trace has 4 clones, 2.14's 3); the two copies that a view then merges across the
    # batch (no strides fit) stay
    assert clones[1] == 2 < clones[0]
    graph = step.graph
    attention = next(op for op in graph.ops if "attention" in op.target)
    q, k, v = (graph.values[a.id] for a in attention.args[:3])
    assert q.alias_of is not None and q.alias_of == k.alias_of == v.alias_of  # one projection, viewed thrice
    assert [q.spec.offset, k.spec.offset, v.spec.offset] == [0, 32, 64]
    follows_eager(step, net, ref, [batch(4, 16, seed=k + 1) for k in range(3)], grad_tol=1e-6)


def _graph(*after, output_clone: bool = False) -> tuple[Graph, int]:
    """x (2, 3, 4) -> exp -> transpose(0, 1) -> clone -> `after`'s views -> exp: the graph and the
    clone's id; `output_clone`: the clone's result is also a graph output."""
    b = GraphBuilder("m", training=True)
    x = b.add_input("x", TensorSpec((2, 3, 4), "float32"))
    y = b.op("aten::transpose.int", [b.op("aten::exp.default", [x], "m.py:1"), 0, 1], "m.py:2")
    c = b.op(CLONE, [y, torch.contiguous_format], "m.py:3")  # .contiguous(), as MHA copies
    v = c
    for target, rest in after:
        v = b.op(target, [v, *rest], "m.py:4")
    out = b.op("aten::exp.default", [v], "m.py:5")
    outputs = (out.id, c.id) if output_clone else (out.id,)
    graph = Graph(tuple(b.values), tuple(b.ops), (x.id,), outputs)
    return graph, next(op.id for op in graph.ops if op.target == CLONE)


def _run(graph: Graph) -> torch.Tensor:
    from nimble.runtime.placed.reference import run_values

    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 10
    return run_values(graph, {}, [x], training=True)[graph.outputs[0]]


@pytest.mark.parametrize("after", [(), (("aten::select.int", [0, 1]),), (("aten::permute.default", [[2, 0, 1]]),),
                                   (("aten::unsqueeze.default", [1]), ("aten::squeeze.dim", [1]))])
def test_a_clone_that_views_take_as_strides_fit_goes_and_the_results_stay(after):
    graph, _ = _graph(*after)
    dropped = passes.drop_view_clones(graph)
    assert not any(op.target == CLONE for op in dropped.ops)
    torch.testing.assert_close(_run(dropped), _run(graph), rtol=0, atol=0)


def test_a_clone_stays_where_a_view_after_it_fits_no_strides_of_its_source_or_it_is_an_output():
    merged, _ = _graph(("aten::view.default", [[6, 4]]))  # (3, 2, 4) laid out (2, 3, 4): 3 and 2 do not merge
    assert passes.drop_view_clones(merged) is merged
    output, _ = _graph(output_clone=True)
    assert passes.drop_view_clones(output) is output


def _view(spec: TensorSpec, make) -> tuple:
    """The strided view that `make` takes of a value of `spec`, read back from its offsets."""
    return strided(make(offsets(spec, 0, torch.int32)), spec.numel)


@pytest.mark.parametrize("make", [
    lambda t: t.view(5, 7, 3, 2, 8).permute(2, 1, 3, 0, 4)[1],  # a packed projection's key: (B, H, L, D)
    lambda t: t.view(5, 7, 3, 2, 8).permute(2, 1, 3, 0, 4)[2],
    lambda t: t.t(),  # the whole of it, permuted
    lambda t: t.view(35, 3, 16)[:, 0].unsqueeze(1),  # a dimension of one
    lambda t: t[4:5, 16:24],  # a block in the middle
])
def test_the_steps_make_each_strided_view_from_the_source(make):
    spec = TensorSpec((35, 48), "float32")
    view = _view(spec, make)
    steps = dvc.view_steps(spec, view)
    assert steps is not None
    got = offsets(spec, 0, torch.int32)
    for target, rest in steps:
        got = dvc.replay(dvc.Op(0, target, (), (), ()), got, rest)
    assert torch.equal(got, make(offsets(spec, 0, torch.int32)))


def test_the_steps_refuse_views_whose_dimensions_overlap_or_start_inside_one():
    spec = TensorSpec((6, 8), "float32")
    assert dvc.view_steps(spec, ((6, 8), (8, 1), 0)) is not None
    assert dvc.view_steps(spec, ((6, 8), (1, 1), 0)) is None  # overlapping
    assert dvc.view_steps(spec, ((6, 4), (8, 0), 0)) is None  # a broadcast
    assert dvc.view_steps(spec, ((3, 8), (8, 1), 9)) is None  # starts inside a row: not a select of whole rows
    assert dvc.view_steps(spec, ((4, 3), (8, 3), 0)) is None  # rows of 3 at stride 3 do not nest in rows of 8
