"""`nimble.TrainStep` on the CPU: the joint forward-backward graph and its plan, each of 100 steps
against eager PyTorch on a ResNet-18 and a MobileNetV2-style net, fused optimizers, random ops,
and one-line errors. (Data parallel: test_train_step_parallel.py.)"""

from __future__ import annotations

import copy

import nimble
import pytest
import torch
import torch.nn.functional as F
from nimble.errors import ModelError, ShapeError, UnsupportedError, UsageError
from nimble.ir import ACTIVATION, INPUT, Graph, Op, Ref, TensorSpec, Value
from nimble.runtime.assemble.choice import channels_last_values, viewed
from nimble.runtime.joint import SAME_STRIDES, loose
from nimble.train import CONVOLUTIONAL, STEP_STREAMS, _convolutions
from nimble.runtime.placed.placement import copies
from torch import nn

from tests.models import DataDependentIf, MobileNetV2Small, ResNet18, StochasticNet, TinyConvNeXt, TinyEncoder, TinyViT


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before batch norm: its gradient would be rounding noise alone, which Adam scales up to
        # full steps (in eager against eager too)
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class Pair(nn.Module):
    """A module that returns a tensor and a number."""

    def forward(self, x):
        return x * self.scale, 3

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))


def batch(n: int = 4, size: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def follows_eager(step, net, ref, batches, loss_tol: float = 1e-6, grad_tol: float = 1e-5,
                  layout=torch.contiguous_format) -> None:
    """Each batch's step against eager (`ref`, given `net`'s weights before it, its images in
    `layout`): the loss within `loss_tol` and all gradients, as one vector, within `grad_tol`."""
    for x, t in batches:
        ref.load_state_dict(net.state_dict())
        ref.zero_grad(set_to_none=True)
        expected = F.cross_entropy(ref(x.contiguous(memory_format=layout)), t)
        expected.backward()
        loss = step(x, t)
        assert abs(float(loss) - float(expected.detach())) <= loss_tol * abs(float(expected.detach()))
        assert relative(torch.cat([p.grad.reshape(-1) for p in net.parameters()]),
                        torch.cat([p.grad.reshape(-1) for p in ref.parameters()])) <= grad_tol


def test_the_joint_graph_holds_the_forward_the_loss_and_the_backward_under_one_memory_plan():
    torch.manual_seed(0)
    net = Small()
    step = nimble.TrainStep(net, F.cross_entropy, *batch())
    targets = {op.target for op in step.graph.ops}
    assert "aten::convolution_backward.default" in targets  # the backward is ops of the graph
    assert "aten::_native_batch_norm_legit_functional.default" in targets
    assert "nimble::fused" in targets  # fusion saw it: the batch norm backward's pointwise ops, say
    plan = step.memory_plan
    assert 0 < plan.lower_bound_bytes <= plan.arena_bytes < plan.no_reuse_bytes  # buffers reused across the step
    step(*batch(seed=1))
    arena = step.runner.arena
    assert arena.numel() == plan.arena_bytes
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    # a gradient is a planned buffer (a view of the step's one arena) where its op writes in place
    # (the linear layer's, a view of mm's result); convolution_backward's and batch norm's
    # backward's (whose out= overloads would compute, then copy) are bound as computed, never copied in
    unplanned = loose(step.graph, step.runner.placed)
    where = []
    for (kind, p), vid in zip(step._outputs, step.graph.outputs):
        if kind == "gradient":
            planned = step.graph.root(vid) not in unplanned
            assert (start <= p.grad.data_ptr() < end) is planned
            where.append((step.graph.ops[step.graph.values[vid].producer].target, planned))
    assert ("aten::t.default", True) in where
    assert ("aten::native_batch_norm_backward.default", False) in where
    assert ("aten::convolution_backward.default", False) in where
    # every parameter gets a gradient, every buffer its update, and there is one loss
    kinds = [kind for kind, _ in step._outputs]
    assert kinds.count("gradient") == len(list(net.parameters()))
    assert kinds.count("buffer") == len(list(net.buffers())) and kinds.count("loss") == 1


def test_no_op_of_a_step_computes_then_copies_into_its_buffer():
    """An out= overload that torch generates (compute into new memory, then copy into `out`) is
    never used: relu writes its buffer by clamp_min's out= kernel, a batch norm backward's results
    are bound as computed. The relu's result is then a view of the arena, and the step still
    matches eager's loss."""
    torch.manual_seed(0)
    net = Small()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch())
    used = [p.out_fn for p in step.runner.placed if p.out_fn is not None]
    assert used and not any(copies(f) for f in used)
    assert copies(torch.ops.aten.relu.out) and not copies(torch.ops.aten.add.out)  # the test itself
    kinds = {p.op.target: p for p in step.runner.placed}
    assert kinds["aten::relu.default"].substitute is not None
    relu = next(op for op in step.graph.ops if op.target == "aten::relu.default")
    assert relu.outputs[0] in step.runner.views and relu.outputs[0] not in step.runner.unplanned
    loss = step(*batch(seed=1))
    x, y = batch(seed=1)
    assert relative(loss, F.cross_entropy(ref(x), y)) < 1e-5


@pytest.mark.parametrize("make, size", [(lambda: ResNet18(classes=10), 32), (MobileNetV2Small, 32)],
                         ids=["resnet18", "mobilenet_v2_small"])
def test_each_of_100_steps_gives_eager_s_loss_gradients_and_running_statistics(make, size):
    """Each step starts the eager module from nimble's parameters and buffers (training is chaotic:
    a difference of 1e-7 in the weights grew to 18 % in the loss within 10 steps of eager against
    eager), then the two are held to float32 rounding: loss and every gradient within 1e-4
    (relative), running statistics within 1e-5, and the step counts equal."""
    torch.manual_seed(0)
    net = make()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, size), optimizer=opt)
    for k in range(100):
        x, t = batch(4, size, seed=k + 1)
        ref.load_state_dict(net.state_dict())
        ref.zero_grad(set_to_none=True)
        expected = F.cross_entropy(ref(x), t)
        expected.backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        loss = step(x, t)  # its gradients are left in .grad, then the optimizer steps
        assert abs(float(loss) - float(expected.detach())) <= 1e-4 * abs(float(expected.detach())), k
        # all gradients as one vector within 1e-4; each one within 1e-4 of the largest's size (a
        # gradient that sums terms which nearly cancel, to 1e-6, keeps float32's rounding of them)
        scale = max(float(g.abs().max()) for g in grads.values())
        for n, p in net.named_parameters():
            assert float((p.grad - grads[n]).abs().max()) <= 1e-4 * scale, (k, n)
        assert relative(torch.cat([p.grad.reshape(-1) for p in net.parameters()]),
                        torch.cat([grads[n].reshape(-1) for n, _ in net.named_parameters()])) <= 1e-4, k
        for (n, b), r in zip(net.named_buffers(), ref.buffers()):
            if b.is_floating_point():
                assert torch.allclose(b, r, atol=1e-5, rtol=1e-5), (k, n)
            else:
                assert torch.equal(b, r), (k, n)


@pytest.mark.parametrize("make", [lambda: ResNet18(classes=10), MobileNetV2Small], ids=["resnet18", "mobilenet_v2_small"])
def test_a_channels_last_step_gives_eager_s_loss_and_gradients(make):
    """layout="channels_last": the step's planned 4-D maps are NHWC over their planned bytes, its
    input is laid out so, and 10 steps still give the loss, gradients (each in its parameter's own
    layout) and running statistics of eager in channels_last (whose convolutions sum in the same
    order). "auto" keeps contiguous maps on the CPU."""
    torch.manual_seed(0)
    net = make()
    ref = copy.deepcopy(net).to(memory_format=torch.channels_last)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 32), layout="channels_last")
    maps = [t for t in step.runner.views.values() if t.dim() == 4 and t.shape[2] * t.shape[3] > 1]
    assert maps and all(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() for t in maps)
    assert step.layout == "channels_last"
    for k in range(10):
        x, t = batch(4, 32, seed=k + 1)
        ref.load_state_dict(net.state_dict())
        ref.zero_grad(set_to_none=True)
        expected = F.cross_entropy(ref(x.contiguous(memory_format=torch.channels_last)), t)
        expected.backward()
        loss = step(x, t)
        assert abs(float(loss) - float(expected)) <= 1e-4 * abs(float(expected)), k
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        for (n, p), r in zip(net.named_parameters(), ref.parameters()):
            assert p.grad.stride() == p.stride(), (k, n)
            assert float((p.grad - r.grad).abs().max()) <= 1e-4 * scale, (k, n)
        for (n, b), r in zip(net.named_buffers(), ref.buffers()):
            assert torch.allclose(b.float(), r.float(), atol=1e-5, rtol=1e-5), (k, n)
        with torch.no_grad():  # the next step from where eager's optimizer would be
            for p in net.parameters():
                p -= 0.01 * p.grad
    assert nimble.TrainStep(make(), F.cross_entropy, *batch(4, 32)).layout == "contiguous"
    with pytest.raises(UsageError, match="layout 'nhwc': use one of auto, contiguous, channels_last"):
        nimble.TrainStep(make(), F.cross_entropy, *batch(4, 32), layout="nhwc")


def test_prepare_runs_with_the_cycle_collector_paused_and_leaves_it_as_it_was():
    import gc

    seen = []

    def loss(out, target):
        seen.append(gc.isenabled())  # called while the step's trace runs
        return F.cross_entropy(out, target)

    assert gc.isenabled()
    nimble.TrainStep(TinyViT(), loss, *batch(4, 16))
    assert seen and not any(seen) and gc.isenabled()


def test_auto_takes_channels_last_for_a_convolutional_net_and_not_for_a_patch_embedding():
    """On CUDA "auto" lays a step out channels_last from `CONVOLUTIONAL` convolutions: a conv net
    has many, a vision transformer one (its patch embedding, after which its maps are (B, L, C)
    or (B, H, W, C) with C read along)."""
    vit = nimble.TrainStep(TinyViT(), F.cross_entropy, *batch(4, 16))
    resnet = nimble.TrainStep(ResNet18(classes=10), F.cross_entropy, *batch(4, 32))
    assert _convolutions(vit.graph) == 1 < CONVOLUTIONAL <= _convolutions(resnet.graph)
    assert vit.layout == resnet.layout == "contiguous"  # on the CPU, always


class Flattening(nn.Module):
    """A VGG-style head (a pooled map of 2x2 flattened into a linear layer: the pooling's result is
    bound as computed, and a view reshapes it) beside a branch that flattens the image itself."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc, self.skip = nn.Linear(8 * 2 * 2, 10), nn.Linear(3 * 8 * 8, 10)

    def forward(self, x):
        pooled = F.adaptive_avg_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(pooled, 1)) + self.skip(x.view(x.shape[0], -1))


def test_a_channels_last_step_keeps_what_a_view_reshapes_contiguous():
    """channels_last maps, but a result bound as computed that a view reshapes gets the strides
    the trace gave it (here contiguous) where it is computed, and an input that a view reshapes
    stays contiguous: a view of an NHWC map to (N, C*H*W) has no strides that fit (VGG and
    AlexNet failed so on their first step). The steps give eager's loss and gradients. (The
    transformer's test below covers a result traced with other strides: attention's.)"""
    torch.manual_seed(0)
    net = Flattening()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 8), layout="channels_last")
    assert step._formats[0] == torch.contiguous_format  # the image is viewed
    assert any(t.dim() == 4 and not t.is_contiguous() for t in step.runner.views.values())
    for k in range(3):
        x, t = batch(4, 8, seed=k + 1)
        ref.load_state_dict(net.state_dict())
        ref.zero_grad(set_to_none=True)
        expected = F.cross_entropy(ref(x), t)
        expected.backward()
        loss = step(x, t)
        assert abs(float(loss) - float(expected)) <= 1e-5 * abs(float(expected)), k
        for (n, p), r in zip(net.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6), (k, n)


def test_a_result_keeps_its_own_strides_where_every_view_of_it_takes_them():
    """`joint._views_hold`: a result bound as computed is copied into the trace's strides only
    where some view of it does not take its own (cuDNN's attention gradients, laid out as their
    inputs, need no copy where the trace's view chain is permutes and views that fit them)."""
    from dataclasses import replace

    from nimble.frontend.builder import GraphBuilder
    from nimble.ir import Graph, TensorSpec
    from nimble.runtime.joint import _view_trees, _views_hold

    def tree(*steps):
        b = GraphBuilder("m", training=True)
        x = b.add_input("x", TensorSpec((2, 3, 4, 5), "float32"))
        y = b.op("aten::exp.default", [x], "m.py:1")
        v = y
        for target, rest in steps:
            v = b.op(target, [v, *rest], "m.py:2")
        graph = Graph(tuple(b.values), tuple(b.ops), (x.id,), (v.id,))
        return y.id, _view_trees(graph).get(y.id, ())

    permuted = torch.empty(2, 4, 3, 5).transpose(1, 2)  # (2, 3, 4, 5), laid out (2, 4, 3, 5)
    value, views = tree(("aten::permute.default", [[0, 2, 1, 3]]), ("aten::view.default", [[2, 2, 2, 3, 5]]))
    assert len(views) == 2 and _views_hold(permuted, value, views)  # a split fits any strides
    value, views = tree(("aten::view.default", [[2, 12, 5]]))  # needs dims 1 and 2 dense together
    assert not _views_hold(permuted, value, views) and _views_hold(torch.empty(2, 3, 4, 5), value, views)
    # a view outside LOGICAL_VIEWS (as_strided reads strides): the trace's kept, whatever the strides
    assert not _views_hold(torch.empty(2, 3, 4, 5), value, (replace(views[0], target="aten::as_strided.default"),))


def test_a_transformer_s_steps_give_eager_s_loss_and_gradients():
    """Embedding, attention, layer norm and a GELU MLP: their backward ops (embedding's dense
    gradient, attention's, layer norm's) in the joint graph, 20 steps against eager."""
    torch.manual_seed(0)
    net = TinyEncoder()
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(21)]
    step = nimble.TrainStep(net, F.cross_entropy, *data[0],
                            optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True))
    targets = {op.target for op in step.graph.ops}
    # layer norm's backward gathers the residual stream's gradient (`passes/fuse_layer_norm_adds`)
    assert {"aten::embedding_dense_backward.default", "nimble::layer_norm_backward_add"} <= targets
    for ids, t in data[1:]:
        ref.load_state_dict(net.state_dict())
        ref.zero_grad(set_to_none=True)
        expected = F.cross_entropy(ref(ids), t)
        expected.backward()
        loss = step(ids, t)
        assert abs(float(loss) - float(expected.detach())) <= 1e-5 * abs(float(expected.detach()))
        assert relative(torch.cat([p.grad.reshape(-1) for p in net.parameters()]),
                        torch.cat([p.grad.reshape(-1) for p in ref.parameters()])) <= 1e-5


@pytest.mark.parametrize("clones", ["kept", "as views"])
def test_a_vision_transformer_s_channels_last_step_gives_eager_s_loss_and_gradients(clones):
    """A patch convolution makes it a net with 4-D maps, laid out channels_last as on CUDA. The
    backward reshapes the clone of attention's input gradient with `_unsafe_view`, which the step
    takes as a view (no buffer, no copy), so the clone keeps the trace's strides (laid out
    channels_last it could not be viewed: vit_b_16's step failed so on an H200). With
    `drop_view_clones` (the default) those clones are views of the gradient itself."""
    from nimble import passes, train

    torch.manual_seed(0)
    net = TinyViT()
    ref = copy.deepcopy(net)
    joint = train.JOINT_PASSES if clones == "as views" else \
        tuple(p for p in train.JOINT_PASSES if p is not passes.drop_view_clones)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 16), layout="channels_last", graph_passes=joint)
    g = step.graph
    assert "aten::_unsafe_view.default" not in {op.target for op in g.ops}
    four = [op.outputs[0] for op in g.ops if op.target == "aten::clone.default"
            and len(g.values[op.outputs[0]].spec.shape) == 4]
    if clones == "kept":
        assert four and all(v in viewed(g, SAME_STRIDES) for v in four)
    else:
        assert not four
    follows_eager(step, net, ref, [batch(4, 16, seed=k + 1) for k in range(5)], loss_tol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_convnext_s_step_takes_the_restrides_of_its_pooling_as_views_and_gives_eager_s_gradients(layout):
    """Average pooling to 1x1 of a map with channels-last strides restrides its mean
    (`as_strided`), and torch's joint trace writes that restride's backward as an
    `as_strided_scatter` into zeros: both lay their size densely over their input, so the step
    takes them as a view and a reshape (ConvNeXt was refused at `as_strided`)."""
    torch.manual_seed(0)
    net = TinyConvNeXt()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 16), layout=layout)
    assert not any("as_strided" in op.target for op in step.graph.ops)
    follows_eager(step, net, ref, [batch(4, 16, seed=k + 1) for k in range(3)])


class SoftmaxMaps(nn.Module):
    """Softmax and log-softmax over the last dimension of 4-D maps, as Swin's attention scores are,
    and a GELU of one, as MaxViT's, between convolutions."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 10, 1)

    def forward(self, x):
        y = torch.softmax(self.a(x), -1) * 3.0
        return self.b(F.gelu(torch.log_softmax(y, -1) + 1.0)).mean((2, 3))


def test_softmax_and_gelu_maps_in_a_channels_last_step_give_eager_s_gradients():
    """Softmax's, log-softmax's and exact GELU's out= kernels and the softmaxes' backwards write a
    contiguous map's result as if the buffer they are given were contiguous (0.6 to 3.9 off into a
    channels_last one, torch 2.13's CPU): a channels_last step writes through them only where the
    strides agree, and otherwise computes and copies in (`LAYOUT_BOUND`)."""
    from nimble.runtime.placed.placement import LAYOUT_BOUND

    torch.manual_seed(0)
    net = SoftmaxMaps()
    ref = copy.deepcopy(net).to(memory_format=torch.channels_last)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(), layout="channels_last")
    bound = {op.target for op in step.graph.ops if "softmax" in op.target or op.target == "aten::gelu.default"}
    assert len(bound) == 5 and bound <= set(LAYOUT_BOUND)
    follows_eager(step, net, ref, [batch(seed=k + 1) for k in range(3)], layout=torch.channels_last)


class Picks(nn.Module):
    """A projection taken apart with select along a dimension of 3, as nn.MultiheadAttention's
    packed input projection is: at every index, or at two of them."""

    def __init__(self, every: bool):
        super().__init__()
        self.proj, self.head, self.every = nn.Linear(8, 24), nn.Linear(8, 10), every

    def forward(self, x):
        t = self.proj(x.flatten(1)[:, :8]).unflatten(-1, (3, 8)).movedim(-2, 0)
        picked = [t[k] * (k + 1) for k in ((0, 1, 2) if self.every else (0, 2))]
        return self.head(sum(picked[1:], picked[0]).relu())


@pytest.mark.parametrize("every", [True, False], ids=["every-index", "two-of-three"])
def test_the_gradients_of_a_tensor_taken_apart_at_every_index_are_stacked_not_summed_from_zeros(every):
    """autograd sums one select_backward per piece (each a map of zeros the size of the whole, one
    slice filled); where the pieces cover the dimension the step stacks their gradients instead
    (`passes/stack_select_gradients`); where they do not, the sum stays. Eager's gradients either way."""
    torch.manual_seed(0)
    net = Picks(every)
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch())
    targets = [op.target for op in step.graph.ops]
    assert targets.count("aten::stack.default") == (1 if every else 0)
    assert targets.count("aten::select_backward.default") == (0 if every else 2)
    follows_eager(step, net, ref, [batch(seed=k + 1) for k in range(3)], grad_tol=1e-6)


def test_a_buffer_that_an_unsafe_view_reads_is_taken_for_a_viewed_one():
    """Where `_unsafe_view` stays one (its input's strides allow no view), its input keeps the
    trace's strides all the same: channels_last could make it unviewable."""
    spec = TensorSpec((2, 4, 3, 3), "float32")
    values = (Value(0, INPUT, spec, "x"), Value(1, ACTIVATION, spec, "y", producer=0),
              Value(2, ACTIVATION, TensorSpec((8, 9), "float32"), "z", producer=1))
    ops = (Op(0, "aten::relu.default", (Ref(0),), (), (1,)),
           Op(1, "aten::_unsafe_view.default", (Ref(1), (8, 9)), (), (2,)))
    g = Graph(values, ops, (0,), (2,))
    assert viewed(g) == {1} and 1 not in channels_last_values(g)
    plain = Graph(values[:2], ops[:1], (0,), (1,))
    assert viewed(plain) == set() and channels_last_values(plain) == {1}


@pytest.mark.parametrize("make", [lambda: ResNet18(classes=10), MobileNetV2Small], ids=["resnet18", "mobilenet_v2_small"])
def test_bf16_steps_give_what_eager_autocast_gives_with_float32_weights_and_gradients(make):
    """precision="bf16" is torch.autocast's recipe: each step against eager under
    `torch.autocast(dtype=torch.bfloat16)` from the same weights gives the same loss (to 1e-3) and
    gradients within 2e-2 as one vector (bfloat16 keeps 8 bits: the backward's sums, decomposed
    here, round in another order), float32 like the parameters, and the same running statistics."""
    torch.manual_seed(0)
    net = make()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 32), precision="bf16")
    assert "bfloat16" in {v.spec.dtype for v in step.graph.values}  # its convolutions compute in bf16
    for k in range(20):
        x, t = batch(4, 32, seed=k + 1)
        ref.load_state_dict(net.state_dict())
        ref.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = F.cross_entropy(ref(x), t)
        expected.backward()
        loss = step(x, t)
        assert loss.dtype == torch.float32
        assert abs(float(loss) - float(expected.detach())) <= 1e-3 * abs(float(expected.detach())), k
        assert all(p.grad.dtype == torch.float32 for p in net.parameters())
        assert relative(torch.cat([p.grad.reshape(-1) for p in net.parameters()]),
                        torch.cat([p.grad.reshape(-1) for p in ref.parameters()])) <= 2e-2, k
        for (n, b), r in zip(net.named_buffers(), ref.buffers()):
            assert torch.allclose(b.float(), r.float(), atol=1e-3, rtol=1e-3), (k, n)


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
], ids=["sgd_fused", "adam_fused", "adamw_foreach"])
def test_a_step_with_a_fused_optimizer_moves_the_weights_as_eager_does(optimizer):
    torch.manual_seed(0)
    net = Small()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(), optimizer=optimizer(net.parameters()))
    ref_opt = optimizer(ref.parameters())
    for k in range(5):
        x, t = batch(seed=k + 1)
        step(x, t)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), t).backward()
        ref_opt.step()
    for (n, p), r in zip(net.named_parameters(), ref.parameters()):
        assert relative(p.detach(), r.detach()) <= 1e-5, n
        assert p.grad.stride() == p.stride()  # in the parameter's layout, as autograd leaves it


def test_dropout_draws_fresh_masks_from_torch_s_generator_as_eager_does():
    """A random op stays an op of the step: each call draws a new mask, from the same generator
    eager uses, so a seed reproduces eager's step exactly."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))
    ref = copy.deepcopy(net)
    x, t = torch.randn(32, 16), torch.randint(0, 10, (32,))
    step = nimble.TrainStep(net, F.cross_entropy, x, t)
    losses = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        losses.append(float(step(x, t)))
    assert losses[0] == losses[1] != losses[2]
    torch.manual_seed(1)
    step(x, t)
    torch.manual_seed(1)
    F.cross_entropy(ref(x), t).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_stochastic_depth_from_torch_empty_is_an_op_of_every_step():
    """EfficientNet's stochastic depth (`torch.empty(...).bernoulli_(p)`: `empty` then `bernoulli.p`
    in torch's trace, which reads only the shape of the empty tensor) and an in-place SiLU (whose
    backward fills an `empty_like` with ones) train as eager does, draw for draw; it was refused as
    reading uninitialized memory."""
    torch.manual_seed(0)
    net = StochasticNet()
    ref = copy.deepcopy(net)
    x, t = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    step = nimble.TrainStep(net, F.cross_entropy, x, t)
    losses = []
    for seed in (3, 4):
        ref.load_state_dict(net.state_dict())
        ref.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        losses.append(float(step(x, t)))
        torch.manual_seed(seed)
        expected = F.cross_entropy(ref(x), t)
        expected.backward()
        assert losses[-1] == pytest.approx(float(expected), rel=1e-6)
        for p, q in zip(net.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert losses[0] != losses[1]  # a new draw each step


def test_silu_s_backward_takes_its_ones_as_a_number():
    """torch's trace of an in-place SiLU's backward fills a tensor with ones for `1 - sigmoid(x)`:
    the step computes it from the number (`inline_scalar_constants`), with eager's gradients, and
    no fill is left to write a tensor of ones each step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(inplace=True), nn.Flatten(),
                        nn.Linear(8 * 14 * 14, 10))
    ref = copy.deepcopy(net)
    x, t = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    step = nimble.TrainStep(net, F.cross_entropy, x, t)
    found = [op.target for op in step.graph.ops] + [node[0] for op in step.graph.ops
                                                    if op.target == "nimble::fused" for node in op.args[0]]
    assert "aten::fill.Scalar" not in found and "aten::neg.default" in found, found
    step(x, t)
    F.cross_entropy(ref(x), t).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_a_step_can_hand_back_the_module_s_outputs_beside_the_loss():
    torch.manual_seed(0)
    net = Small()
    ref = copy.deepcopy(net)
    x, t = batch()
    step = nimble.TrainStep(net, F.cross_entropy, x, t, outputs=True)
    loss, logits = step(x, t)
    expected = ref(x)
    assert torch.allclose(logits, expected, rtol=1e-5, atol=1e-6) and not logits.requires_grad
    assert torch.allclose(loss, F.cross_entropy(expected, t))
    step(*batch(seed=3))
    assert torch.allclose(logits, expected, rtol=1e-5, atol=1e-6)  # the caller's own tensor: no later call writes it


class WithSpare(Small):
    """Small with a layer its forward never uses."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(3, 3)


def test_frozen_layers_get_no_gradient_and_the_rest_get_eager_s():
    """Parameters with requires_grad=False (a frozen convolution, an unused layer) get no
    gradient: the backward ops are asked for fewer results (batch norm's backward then gives no
    input gradient), and the others match eager."""
    torch.manual_seed(0)
    net = WithSpare()
    net.conv.requires_grad_(False)
    net.spare.requires_grad_(False)
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch())
    x, t = batch(seed=1)
    step(x, t)
    F.cross_entropy(ref(x), t).backward()
    assert net.conv.weight.grad is None and net.spare.weight.grad is None
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), n


def test_bad_steps_are_one_line_each():
    torch.manual_seed(0)
    net = Small()
    x, t = batch()
    with pytest.raises(UsageError, match="it must return one scalar tensor"):
        nimble.TrainStep(net, lambda out, t: F.cross_entropy(out, t, reduction="none"), x, t)
    with pytest.raises(UsageError, match="example_targets must be a tensor"):
        nimble.TrainStep(net, F.cross_entropy, x, "labels")
    with pytest.raises(UsageError, match="precision 'fp8': use one of fp32, bf16"):
        nimble.TrainStep(net, F.cross_entropy, x, t, precision="fp8")
    with pytest.raises(UsageError, match="outputs=True needs a module that returns tensors"):
        nimble.TrainStep(Pair(), lambda out, t: F.mse_loss(out[0], t), x, torch.randn(4, 3, 8, 8), outputs=True)
    with pytest.raises(UsageError, match="gets no gradient from the loss; set requires_grad=False"):
        nimble.TrainStep(WithSpare(), F.cross_entropy, x, t)
    with pytest.raises(UsageError, match="bucket_mb"):
        nimble.TrainStep(net, F.cross_entropy, x, t, bucket_mb=0)
    step = nimble.TrainStep(net, F.cross_entropy, x, t)
    with pytest.raises(ShapeError, match="prepared for 4x3x8x8 float32"):
        step(torch.randn(2, 3, 8, 8), t[:2])
    with pytest.raises(UsageError, match="1 input"):
        step((x, x), t)
    net.fc.weight = nn.Parameter(net.fc.weight.detach().clone())  # changed after prepare
    with pytest.raises(ModelError, match="fc.weight"):
        step(x, t)


def test_a_model_torch_export_cannot_trace_is_refused_with_the_way_out():
    net = DataDependentIf()
    x = torch.randn(2, 4)
    with pytest.raises(UnsupportedError, match="torch.export could not trace its training step"):
        nimble.TrainStep(net, lambda out, t: F.mse_loss(out, t), x, torch.randn(2, 4))


def test_a_detach_in_the_joint_graph_is_its_input_under_another_name_never_a_buffer_of_its_own():
    """The backward detaches what it saved. Typed as a fresh value, a detach bound as computed (a
    view of its input's buffer) outlived that buffer's end in the plan: resnet18's gradients were
    wrong by 100 % on the H200 before."""
    from nimble.frontend.builder import GraphBuilder
    from nimble.ir import TensorSpec

    b = GraphBuilder("m", training=True)
    x = b.add_input("x", TensorSpec((2, 3), "float32"))
    y = b.op("aten::relu.default", [x], "m.py:1")
    for target in ("aten::detach.default", "aten::alias.default"):  # y itself, or a value aliasing it
        r = b.op(target, [y], "m.py:2")
        assert r.id == y.id or b.values[r.id].alias_of == y.id, target
    torch.manual_seed(0)
    step = nimble.TrainStep(ResNet18(classes=10), F.cross_entropy, *batch(2, 16))
    graph = step.graph  # torch 2.11 and 2.13 detach what the backward saves (2.14 does not)
    detached = [v for op in graph.ops if op.target == "aten::detach.default" for v in op.outputs]
    assert all(graph.values[v].alias_of is not None for v in detached)
    assert not set(detached) & loose(graph, step.runner.placed)


def test_backward_ops_write_into_their_buffers_through_their_grad_input_overloads():
    from nimble.runtime.placed.placement import out_overload

    found = out_overload("aten::threshold_backward.default", training=True)
    assert found is not None and found[1] == ("grad_input",)
    assert out_overload("aten::max_pool2d_with_indices_backward.default", training=True) is not None


def test_a_copy_writes_its_buffer_and_clones_nothing():
    """`aten::copy(self, src)`'s own out= overload first computes the functional op, which clones
    all of self's storage (torch's clone_preserve_strides): with self a view of the arena, the whole
    arena, 1894 MiB at once in efficientnet_b0's step on an H200. Placed, a copy writes src into its
    buffer (broadcast, cast to self's dtype) and runs nothing else."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nimble.runtime.placed.placement import out_overload

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    fn, names = out_overload("aten::copy.default", training=True)
    arena = torch.zeros(1000)
    given = arena[100:106].view(2, 3)
    for src in (torch.arange(6.0).view(2, 3), torch.arange(3)):
        out = torch.full((2, 3), -1.0)
        with Seen() as seen:
            fn(given, src, False, **{names[0]: out})
        assert torch.equal(out, torch.ops.aten.copy(given, src)) and seen.ops == ["aten.copy_.default"]
    assert not arena.any()


def test_close_drops_the_step_s_gradients_and_the_next_call_runs_again():
    torch.manual_seed(0)
    net = Small()
    step = nimble.TrainStep(net, F.cross_entropy, *batch())
    first = float(step(*batch(seed=1)))
    step.close()
    assert all(p.grad is None for p in net.parameters())
    assert float(step(*batch(seed=1))) == first and all(p.grad is not None for p in net.parameters())


def test_a_step_s_auto_schedule_takes_at_most_step_streams_and_a_cap_is_kept():
    # a step's kernels fill the GPU one at a time: more streams than a few hold memory and buy no time
    torch.manual_seed(0)
    net = MobileNetV2Small()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    auto = nimble.TrainStep(net, F.cross_entropy, x, y)
    assert auto.schedule.num_streams == STEP_STREAMS
    wide = nimble.TrainStep(net, F.cross_entropy, x, y, streams=16)
    assert STEP_STREAMS < wide.schedule.num_streams <= 16
    assert nimble.TrainStep(net, F.cross_entropy, x, y, streams=1).schedule.num_streams == 1
