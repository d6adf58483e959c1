"""`passes/group_casts`: a mixed-precision step's casts of weights and of gradients, grouped."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import nimble
from nimble import passes, train
from nimble.frontend.builder import GraphBuilder
from nimble.ir import Graph, TensorSpec
from nimble.ops import casts
from nimble.ir import dense_layout
from nimble.runtime.joint import cast_group_into
from tests.models import TinyViT
from tests.passes.test_fuse_layer_norm_adds import _emit
from tests.runtime.test_train_step import batch

CAST = "aten::_to_copy.default"
WITHOUT = tuple(p for p in train.JOINT_PASSES if p is not passes.group_casts)


def test_a_bf16_step_casts_its_gradients_in_groups_and_keeps_its_results():
    torch.manual_seed(0)
    net = TinyViT()
    other = copy.deepcopy(net)

    def sgd(module):
        return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 16), precision="bf16", optimizer=sgd(net))
    before = nimble.TrainStep(other, F.cross_entropy, *batch(4, 16), precision="bf16", graph_passes=WITHOUT,
                              optimizer=sgd(other))
    graph = step.graph
    groups = [op for op in graph.ops if op.target == casts.CAST_GROUP]
    assert groups and all(dict(op.kwargs)["dtype"].name == "float32" for op in groups)
    outputs = set(graph.outputs)
    assert not any(op.target == CAST and op.outputs[0] in outputs for op in graph.ops)  # no gradient's cast alone
    # the weights' casts stay where they were: each in the forward beside what reads it
    assert any(op.target == CAST and op.args[0].id in graph.inputs for op in graph.ops)
    taken = sum(len(op.outputs) for op in groups)
    assert taken == sum(1 for op in before.graph.ops if op.target == CAST) \
        - sum(1 for op in graph.ops if op.target == CAST)
    for k in range(3):
        x, t = batch(4, 16, seed=k + 1)
        assert torch.equal(step(x, t), before(x, t))
        for p, q in zip(net.parameters(), other.parameters()):
            assert torch.equal(p.grad, q.grad) and torch.equal(p, q)


def _gradients(shapes, read: int | None = None, formatted: int | None = None) -> Graph:
    """exp of each bfloat16 input, cast to float32 as an output; `read`: that cast is also read by
    an op; `formatted`: that cast asks for a memory format (contiguous)."""
    b = GraphBuilder("m", training=True)
    xs = [b.add_input(f"x{k}", TensorSpec(s, "bfloat16")) for k, s in enumerate(shapes)]
    outs = []
    for k, x in enumerate(xs):
        fmt = torch.contiguous_format if k == formatted else None
        outs.append(_emit(b, CAST, [_emit(b, "aten::exp.default", [x], k), torch.float32, None, None, None, False,
                                    fmt], 10 + k))
    if read is not None:
        outs.append(_emit(b, "aten::exp.default", [outs[read]], 99))
    return Graph(tuple(b.values), tuple(b.ops), tuple(x.id for x in xs), tuple(o.id for o in outs))


def test_gradient_casts_group_in_runs_of_group_bytes_where_the_last_of_each_was():
    big = (passes.group_casts.__globals__["GROUP_BYTES"] // 4 // 2,)  # two of these fill a group
    graph = _gradients([(8,), big, big, (4,), (6,)])
    grouped = passes.group_casts(graph)
    grouped.lint()
    found = [(op.target, len(op.outputs)) for op in grouped.ops]
    # [8, big] then [big, 4, 6]: each group where its last cast was, after the exp it reads
    assert found == [("aten::exp.default", 1), ("aten::exp.default", 1), (casts.CAST_GROUP, 2),
                     ("aten::exp.default", 1), ("aten::exp.default", 1), ("aten::exp.default", 1),
                     (casts.CAST_GROUP, 3)]
    assert set(grouped.outputs) == {v for op in grouped.ops if op.target == casts.CAST_GROUP for v in op.outputs}


def test_a_cast_that_an_op_reads_or_that_asks_for_a_memory_format_stays_alone():
    graph = _gradients([(8,), (4,), (6,)], read=0, formatted=1)
    assert passes.group_casts(graph) is graph  # one plain cast left: no group
    grouped = passes.group_casts(_gradients([(8,), (4,), (6,), (2,)], read=0, formatted=1))
    assert [op.target for op in grouped.ops].count(CAST) == 2
    assert [len(op.outputs) for op in grouped.ops if op.target == casts.CAST_GROUP] == [2]


def test_the_op_computes_each_cast():
    xs = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16)]
    got = casts.cast_group(xs, torch.float16)
    assert all(torch.equal(g, x.to(torch.float16)) for g, x in zip(got, xs))


def test_a_step_copies_a_group_into_its_buffers_twins_together_and_the_rest_alone():
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(6, 4, generator=g).to(torch.bfloat16).t(),  # a weight's gradient, and its buffer alike
               torch.randn(5, generator=g).to(torch.bfloat16),
               torch.randn(3, 4, generator=g).to(torch.bfloat16).t()]  # into a row-major buffer: alone
    buffers = [torch.empty(6, 4).t(), torch.empty(5), torch.empty(4, 3)]
    outs = cast_group_into(sources, torch.float32, **{f"out{k}": b for k, b in enumerate(buffers)})
    assert all(o is b for o, b in zip(outs, buffers))
    assert all(torch.equal(b, s.float()) for s, b in zip(sources, buffers))
    assert buffers[0].stride() == (1, 4) and buffers[2].is_contiguous()  # each written in its own layout


def test_dense_knows_a_layout_that_fills_its_memory():
    def dense(t):
        return dense_layout(t.shape, t.stride())

    assert dense(torch.zeros(4, 6)) and dense(torch.zeros(6, 4).t()) and dense(torch.zeros(4, 1, 6)[:, 0])
    assert dense(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert not dense(torch.zeros(4, 6)[:, :3]) and not dense(torch.zeros(8, 4)[::2])
    assert not dense(torch.zeros(3, 1).expand(3, 4))
