"""`passes/fuse_layer_norm_adds`: a layer norm takes in the residual join before it, and its
backward the add that gathers its input gradient, where the order of the graph allows; the step's
losses and gradients stay bit for bit those of the step without the pass."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import nimble
from nimble import passes, train
from nimble.frontend.builder import GraphBuilder
from nimble.ir import Graph, Ref, TensorSpec
from nimble.ops import add_norm, targets
from tests.models import TinyViT
from tests.runtime.test_train_step import batch

ADD, NORM, NORM_BACKWARD = "aten::add.Tensor", "aten::native_layer_norm.default", \
    "aten::native_layer_norm_backward.default"
WITHOUT = tuple(p for p in train.JOINT_PASSES if p is not passes.fuse_layer_norm_adds)
SPEC = TensorSpec((2, 3, 8), "float32")


def test_a_pre_norm_encoder_s_step_fuses_its_joins_and_gradient_adds_and_keeps_its_results():
    torch.manual_seed(0)
    net = TinyViT()
    other = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 16))
    before = nimble.TrainStep(other, F.cross_entropy, *batch(4, 16), graph_passes=WITHOUT)
    found = [op.target for op in step.graph.ops]
    # the join before the second norm (the first reads the broadcast position add), and the adds
    # that gather the residual stream's gradient at both norms
    assert found.count(add_norm.ADD_LAYER_NORM) == 1 and found.count(add_norm.LAYER_NORM_BACKWARD_ADD) == 2
    assert found.count(ADD) == [op.target for op in before.graph.ops].count(ADD) - 3
    for k in range(3):
        x, t = batch(4, 16, seed=k + 1)
        assert torch.equal(step(x, t), before(x, t))
        for p, q in zip(net.parameters(), other.parameters()):
            assert torch.equal(p.grad, q.grad)


class PostNorm(torch.nn.Module):
    """Two post-norm encoder layers (BERT's order: the norm after each residual join)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                                          for _ in range(2))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


def test_a_post_norm_encoder_s_step_keeps_its_results():
    """After the join, the norm alone reads it; its input gradient then feeds the branch and the
    join's other operand, so no gradient add is taken."""
    torch.manual_seed(0)
    net = PostNorm()
    other = copy.deepcopy(net)
    ids, t = torch.randint(0, 50, (4, 8)), torch.randint(0, 10, (4,))
    step = nimble.TrainStep(net, F.cross_entropy, ids, t, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    before = nimble.TrainStep(other, F.cross_entropy, ids, t, graph_passes=WITHOUT,
                              optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    found = [op.target for op in step.graph.ops]
    assert found.count(add_norm.ADD_LAYER_NORM) >= 1 and add_norm.LAYER_NORM_BACKWARD_ADD not in found
    for _ in range(3):
        ids, t = torch.randint(0, 50, (4, 8)), torch.randint(0, 10, (4,))
        assert torch.equal(step(ids, t), before(ids, t))
        for p, q in zip(net.parameters(), other.parameters()):
            assert torch.equal(p.grad, q.grad) and torch.equal(p, q)


def _emit(b: GraphBuilder, target: str, ins: list, line: int):
    """`target`'s results: one Ref, or a list of them."""
    results = b.emit(targets.resolve(target, training=True)._schema, target, ins, f"m.py:{line}")
    return results[0] if isinstance(results, list) and len(results) == 1 else results


def _forward(between: bool = False, alpha: int = 1, broadcast: bool = False) -> Graph:
    """s = x + r (alpha, r broadcast or not), a reader of s before the norm or not, the norm of s,
    then exp(s) and exp(the norm)."""
    b = GraphBuilder("m", training=True)
    x = b.add_input("x", SPEC)
    r = b.add_input("r", TensorSpec((1, 3, 8), "float32") if broadcast else SPEC)
    s = _emit(b, ADD, [x, r, alpha], 1)
    early = _emit(b, "aten::exp.default", [s], 2) if between else None
    y = _emit(b, NORM, [s, [8], None, None, 1e-5], 3)[0]
    outs = [_emit(b, "aten::exp.default", [s], 4), _emit(b, "aten::exp.default", [y], 5)]
    outs += [early] if early is not None else []
    return Graph(tuple(b.values), tuple(b.ops), (x.id, r.id), tuple(o.id for o in outs))


def test_a_join_goes_into_the_norm_only_where_nothing_reads_it_first_and_it_is_a_plain_add():
    fused = passes.fuse_layer_norm_adds(_forward())
    fused.lint()
    assert [op.target for op in fused.ops] == [add_norm.ADD_LAYER_NORM, "aten::exp.default", "aten::exp.default"]
    op = fused.ops[0]
    assert op.outputs[0] == fused.ops[1].args[0].id  # the join's result is still written, and read after
    for graph in (_forward(between=True), _forward(alpha=2), _forward(broadcast=True)):
        assert passes.fuse_layer_norm_adds(graph) is graph


def _backward(reader: str = "", other: str = "float32") -> Graph:
    """The norm's backward, then dx + r; `reader`: "dx" (dx read twice), "dw" (the weight's gradient
    read before the add)."""
    b = GraphBuilder("m", training=True)
    g, x = b.add_input("g", SPEC), b.add_input("x", SPEC)
    mean, rstd = b.add_input("mean", TensorSpec((2, 3, 1), "float32")), b.add_input("rstd", TensorSpec((2, 3, 1),
                                                                                                     "float32"))
    w, bias = b.add_input("w", TensorSpec((8,), "float32")), b.add_input("bias", TensorSpec((8,), "float32"))
    r = b.add_input("r", TensorSpec((2, 3, 8), other))
    dx, dw, db = _emit(b, NORM_BACKWARD, [g, x, [8], mean, rstd, w, bias, [True, True, True]], 1)
    outs = [_emit(b, "aten::exp.default", [dw], 2)] if reader == "dw" else []
    outs += [_emit(b, "aten::exp.default", [dx], 3)] if reader == "dx" else []
    outs += [_emit(b, ADD, [r, dx], 4), dw, db]
    inputs = (g, x, mean, rstd, w, bias, r)
    return Graph(tuple(b.values), tuple(b.ops), tuple(i.id for i in inputs), tuple(o.id for o in outs))


def test_a_gradient_add_goes_into_the_norm_s_backward_where_it_alone_reads_dx_and_the_gradients_wait():
    fused = passes.fuse_layer_norm_adds(_backward())
    fused.lint()
    assert [op.target for op in fused.ops] == [add_norm.LAYER_NORM_BACKWARD_ADD]
    assert fused.ops[0].args[7] == Ref(fused.inputs[-1])  # r, the add's other operand
    assert set(fused.outputs) == set(fused.ops[0].outputs)
    for graph in (_backward("dx"), _backward("dw"), _backward(other="bfloat16")):
        assert passes.fuse_layer_norm_adds(graph) is graph


def test_the_ops_compute_what_they_replace():
    g = torch.Generator().manual_seed(0)
    x, r, grad = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    w, bias = torch.randn(8, generator=g), torch.randn(8, generator=g)
    s, y, mean, rstd = add_norm.add_layer_norm(x, r.bfloat16(), [8], w, bias, 1e-5)
    assert torch.equal(s, x + r.bfloat16())
    assert all(torch.equal(a, e) for a, e in zip((y, mean, rstd), torch.native_layer_norm(s, [8], w, bias, 1e-5)))
    total, dw, db = add_norm.layer_norm_backward_add(grad, s, [8], mean, rstd, w, bias, r)
    want = torch.ops.aten.native_layer_norm_backward(grad, s, [8], mean, rstd, w, bias, [True, True, True])
    assert torch.equal(total, r + want[0]) and torch.equal(dw, want[1]) and torch.equal(db, want[2])
