"""Which buffers a channels_last load re-strides (`assemble.choice.channels_last_values`, `by_use`):
the maps convolutions read and write, including those that only permutes view, and never the
(N, H, W, C) maps whose last dim linears and layer norms read."""

import pytest
import torch
import torch.nn as nn

from nimble.formats import read_artifact, write_artifact
from nimble.ir import ACTIVATION
from nimble.pipeline import compile_model
from nimble.runtime.assemble.choice import channels_last_values, features_last, permuted_only
from nimble.runtime.placed.placement import arena_views
from nimble.specs import input_specs

from ..models import TinyConvNeXt


class _FlattenedConv(nn.Module):
    """A convolution's result that a permute and a flatten both view."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y.permute(0, 2, 3, 1).sum(-1), y.flatten(1)


def _compiled(tmp_path, module, shape: str):
    x = torch.randn(*map(int, shape.split("x")))
    torch.jit.trace(module.eval(), (x,), check_trace=False).save(str(tmp_path / "m.pt"))
    compiled = compile_model(tmp_path / "m.pt", input_specs([shape]), device="cpu")
    write_artifact(tmp_path / "m.nimble", compiled.artifact())
    return read_artifact(tmp_path / "m.nimble")


def _made_by(graph, target: str) -> set[int]:
    return {v for op in graph.ops if op.target == target for v in op.outputs}


def test_convnext_convolutions_go_channels_last_and_its_linears_keep_their_features_last(tmp_path):
    art = _compiled(tmp_path, TinyConvNeXt(), "2x3x32x32")
    g = art.graph
    permutes = [op for op in g.ops if op.target == "aten::permute.default"]
    convolved = {g.root(op.args[0].id) for op in permutes} & {
        v for op in g.ops if op.target == "nimble::fused" and op.args[0][0][0] == "aten::convolution.default"
        for v in op.outputs}
    assert len(convolved) == 1  # the depthwise convolution's result, permuted to (N, H, W, C)
    linear = _made_by(g, "aten::linear.default") | _made_by(g, "aten::layer_norm.default")
    four_d = {v for v in linear if len(g.values[v].spec.shape) == 4}
    assert four_d

    chosen = channels_last_values(g, by_use=True)
    assert convolved <= chosen and convolved <= permuted_only(g)
    assert not four_d & chosen and four_d <= features_last(g)
    # the rule before `by_use`: the permuted results stayed NCHW and the linears' maps were taken
    # as if their dim 1 held channels
    before = channels_last_values(g)
    assert not convolved & before and four_d & before

    views = arena_views(g, art.memory, torch.empty(art.memory.arena_bytes, dtype=torch.uint8), chosen)
    for op in permutes:
        base = g.root(op.args[0].id)
        if base in convolved:  # the permute to (N, H, W, C) of a channels_last map is dense
            assert views[base].is_contiguous(memory_format=torch.channels_last)
            assert views[base].permute(*op.args[1]).is_contiguous()
    assert all(views[v].is_contiguous() for v in four_d)


def test_a_map_another_view_reshapes_keeps_its_declared_strides(tmp_path):
    """A flatten of a channels_last map is no view: only a map that permutes alone view is taken."""
    art = _compiled(tmp_path, _FlattenedConv(), "2x3x8x8")
    g = art.graph
    conv = next(v for op in g.ops if op.target == "nimble::fused" for v in op.outputs)
    assert conv not in permuted_only(g) and conv not in channels_last_values(g, by_use=True)


def test_the_sample_conv_nets_lay_out_the_same_buffers_as_before(sample_artifacts):
    """No permute, no linear on a map: `by_use` changes nothing for them."""
    for name in ("resnet", "mobilenet", "inception", "nasnet"):
        g = read_artifact(sample_artifacts[name]).graph
        assert channels_last_values(g, by_use=True) == channels_last_values(g), name


def test_features_last_spreads_through_elementwise_ops_of_the_same_shape(tmp_path):
    """The GELU between ConvNeXt's two linears is no linear, but it joins their maps: it stays dense
    in (N, H, W, C) too."""
    art = _compiled(tmp_path, TinyConvNeXt(), "2x3x32x32")
    g = art.graph
    found = features_last(g)
    gelu = {v for op in g.ops if op.target == "nimble::fused"
            and any(node[0] == "aten::gelu.default" for node in op.args[0]) for v in op.outputs}
    assert gelu and all(g.values[v].kind == ACTIVATION for v in gelu) and gelu <= found


@pytest.mark.gpu
def test_convnext_runs_channels_last_as_eager_does_on_cuda(tmp_path):
    from nimble.runtime.executable import Executable
    from nimble.runtime.tune import choices as tuning

    module = TinyConvNeXt().eval()
    art = _compiled(tmp_path, module, "2x3x32x32")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = module(x)
    layouts = set()
    for choice in tuning.candidates(art.graph, art.schedule.num_streams):
        exe = Executable(art, "cuda", choice=choice)
        got = exe.run(x.cuda())
        torch.testing.assert_close(got[0].cpu() if isinstance(got, (list, tuple)) else got.cpu(), want,
                                   rtol=2e-3, atol=2e-3, msg=choice.describe())
        if choice.layout == "channels_last":
            env = exe.tensors()
            chosen = channels_last_values(art.graph, by_use=True)
            assert chosen and all(env[v].is_contiguous(memory_format=torch.channels_last) for v in chosen)
        layouts.add(choice.layout)
        exe.close()
    assert layouts == {"contiguous", "channels_last"}


def test_the_walk_finds_the_depthwise_kernel_of_convnext_laid_out_channels_last(tmp_path):
    """A pack built on the CPU builder walks every candidate as a load lays it out: channels_last
    now takes ConvNeXt's depthwise result, whose kernel (`kernels/depthwise_conv.py`) runs on
    channels_last maps alone, so the walk defines it."""
    from nimble.runtime import prebuild
    from nimble.runtime.kernels import aot

    art = _compiled(tmp_path, TinyConvNeXt(), "2x3x32x32")
    found = prebuild.walk(art, aot.Target(90, 132))
    sources = [kernel.source for kernel, _, _ in found.values()]
    assert any("for kh in tl.static_range(7):" in s and "BLOCK_P" in s for s in sources)


def test_a_permuted_map_that_an_unmarked_view_also_reads_keeps_its_strides(tmp_path):
    """`_unsafe_view` runs as a view though the graph gives its result no alias (`UNMARKED_VIEWS`):
    a map it reads is never re-strided, permuted or not."""
    from dataclasses import replace

    from nimble.ir import Graph, Ref

    art = _compiled(tmp_path, TinyConvNeXt(), "2x3x32x32")
    g = art.graph
    base = next(iter(permuted_only(g)))
    permute = next(op for op in g.ops if op.target == "aten::permute.default" and op.args[0] == Ref(base))
    reader = next(op for op in g.ops if permute.outputs[0] in op.refs())  # its layer norm, as an unmarked view
    ops = list(g.ops)
    ops[reader.id] = replace(reader, target="aten::_unsafe_view.default")
    marked = Graph(g.values, tuple(ops), g.inputs, g.outputs)
    assert base in permuted_only(g) and base not in permuted_only(marked)


@pytest.mark.parametrize("make", ["convnext", "swin"])
def test_a_training_step_lays_out_by_use_and_follows_eager(make):
    """A channels_last step re-strides by use too (`JointRunner`): the (N, H, W, C) maps, their
    layer norms' backward results and the gradients an elementwise op joins to them keep their
    strides, a convolution's result that only a permute views is channels_last, and the step
    gives eager's losses and gradients."""
    import copy

    import torch.nn.functional as F

    import nimble
    from nimble.runtime.joint import SAME_STRIDES

    from ..models import TinySwin
    from .test_train_step import batch, follows_eager

    torch.manual_seed(0)
    net = TinyConvNeXt() if make == "convnext" else TinySwin()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 16), layout="channels_last")
    g = step.graph
    laid = channels_last_values(g, SAME_STRIDES, by_use=True)
    backward_norms = _made_by(g, "aten::native_layer_norm_backward.default")
    assert backward_norms and not backward_norms & laid and not features_last(g) & laid
    permuted = {v for v in permuted_only(g, SAME_STRIDES) if len(g.values[v].spec.shape) == 4} & laid
    assert permuted  # under the rule before, a permuted map kept its declared strides
    for v in laid & set(step.runner.views):  # the planned ones (others are bound as computed)
        assert step.runner.views[v].is_contiguous(memory_format=torch.channels_last)
    follows_eager(step, net, ref, [batch(4, 16, seed=k + 1) for k in range(3)], loss_tol=1e-5, grad_tol=1e-4)
