"""A fused op and the spatial mean of its result as one kernel (`runtime/kernels/fused_mean.py`): its
source run on the CPU through `triton_shim` against torch and against the mean run apart, which
ops `pairs.mean_pairs` pairs, and on the GPU an efficientnet-like squeeze-and-excitation block
against eager, in both layouts."""

from __future__ import annotations

import pytest
import torch

from nimble.ir import Local
from nimble.runtime.base.settings import Settings
from nimble.runtime.kernels import depthwise_conv, fused_mean, pooled_conv, reductions
from nimble.runtime.kernels import fused as kernels
from nimble.runtime import pairs
from nimble.runtime.placed import placement
from nimble.runtime.tune import choices as tuning

from .. import triton_shim
from ..conftest import save_script

CONV = ("aten::convolution.default", (), ())  # a leading convolution: the kernel reads its result from the buffer
SILU = ("aten::silu.default", (Local(0),), ())


def shim_pair(body, out, operands, mean, leads, bias, sms=1, wide=None):
    """The pair's launches on the CPU, as `fused_mean.run` makes them; returns the launches."""
    launches = reductions.mean_launches(out, mean.out, sms, reductions.FUSED_MEAN_STEPS)
    (grid, args, constants), rest = launches[0], launches[1:]
    wide = constants["WIDE"] if wide is None else wide
    text = fused_mean.source(body, out, operands, leads, bias, mean.store, wide)
    triton_shim.run_grid(text, grid, *args, *operands, **{**constants, "WIDE": wide})
    for grid, args, constants in rest:
        triton_shim.run_grid(reductions.SPATIAL_MEAN, grid, *args, **constants)
    return launches


def shim_apart(x, out, sms):
    for grid, args, constants in reductions.mean_launches(x, out, sms, reductions.FUSED_MEAN_STEPS):
        triton_shim.run_grid(reductions.SPATIAL_MEAN, grid, *args, **constants)


@pytest.mark.parametrize("shape", [(2, 5, 7, 9), (1, 70, 3, 3), (2, 3, 1, 17), (2, 3, 17, 1), (1, 4, 40, 40)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("sms", [1, 64])  # 64: few programs for the GPU, so the positions split into parts
def test_a_convolution_s_silu_and_its_mean_are_what_the_two_ops_give_apart(shape, channels_last, sms):
    """The SiLU of the convolution plus its bias, stored, and its mean: the map as torch computes
    it, and the mean bit for bit what SPATIAL_MEAN gives of the stored map over the same parts."""
    g = torch.Generator().manual_seed(1)
    conv = torch.randn(*shape, generator=g) * 2
    if channels_last:
        conv = conv.contiguous(memory_format=torch.channels_last)
    bias = torch.randn(shape[1], generator=g).reshape(1, -1, 1, 1)
    out = conv.clone(memory_format=torch.preserve_format)
    mean = fused_mean.MeanAfter(torch.full((*shape[:2], 1, 1), 7.0), store=True)
    launches = shim_pair([CONV, SILU], out, [bias], mean, leads=True, bias=True, sms=sms)
    torch.testing.assert_close(out, torch.nn.functional.silu(conv + bias), rtol=1e-6, atol=1e-6)
    apart = torch.full_like(mean.out, 7.0)
    shim_apart(out, apart, sms)
    assert torch.equal(mean.out, apart)
    torch.testing.assert_close(mean.out, out.mean((2, 3), keepdim=True), rtol=1e-5, atol=1e-6)
    if sms == 64 and shape == (1, 4, 40, 40):
        assert len(launches) == 2  # the parts, then their sum


def test_a_result_only_the_mean_reads_is_never_stored():
    """The last block of efficientnet_b0: its SiLU's one reader is the mean."""
    conv = torch.randn(2, 6, 5, 5, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(1, 6, 1, 1)
    out = conv.clone()
    mean = fused_mean.MeanAfter(torch.empty(2, 6), store=False)
    shim_pair([CONV, SILU], out, [bias], mean, leads=True, bias=True)
    assert torch.equal(out, conv)  # the convolution's result, as it was
    torch.testing.assert_close(mean.out, torch.nn.functional.silu(conv + bias).mean((2, 3)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wide", [False, True])
def test_operands_broadcast_and_strided_any_way_are_read_where_they_lie(wide):
    """A body of several operands (a residual seen through a permutation, a per-image scale, a
    map shared by every channel) with no convolution leading it; in the 64-bit form too."""
    g = torch.Generator().manual_seed(3)
    n, c, h, w = 2, 5, 6, 7
    residual = torch.randn(n, h, c, w, generator=g).permute(0, 2, 1, 3)  # no stride walks H and W as one
    scale = torch.randn(n, 1, 1, 1, generator=g)
    shared = torch.randn(1, 1, h, w, generator=g)
    body = [("aten::mul.Tensor", (residual, scale), ()),
            ("aten::add.Tensor", (Local(0), shared), (("alpha", 1),)),
            ("aten::relu.default", (Local(1),), ())]
    out = torch.full((n, c, h, w), 7.0).contiguous(memory_format=torch.channels_last)
    mean = fused_mean.MeanAfter(torch.empty(n, c, 1, 1), store=True)
    shim_pair(body, out, [residual, scale, shared], mean, leads=False, bias=False, wide=wide)
    want = torch.relu(residual * scale + shared)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mean.out, want.mean((2, 3), keepdim=True), rtol=1e-5, atol=1e-6)


def test_the_64_bit_form_widens_the_program_ids():
    out = torch.empty(1, 2, 3, 3)
    assert "n = n.to(tl.int64)" in fused_mean.source([CONV, SILU], out, [], True, False, True, wide=True)
    assert fused_mean.tile_offset((2, 3, 4, 5), (60, 20, 5, 1), 5) == "n * 60 + cs[None, :] * 20 + pos[:, None] * 1"
    assert fused_mean.tile_offset((2, 3, 4, 5), (60, 1, 15, 3), 5) == "n * 60 + cs[None, :] * 1 + pos[:, None] * 3"
    assert "// 5" in fused_mean.tile_offset((2, 3, 4, 5), (60, 5, 15, 1), 5)  # rows apart: H and W apart


def test_the_cpu_and_what_does_not_fit_run_apart():
    """Nothing runs where the pair cannot: `run` declines before it touches a tensor."""
    from nimble.ir import Op
    from nimble.ops import fusion
    from nimble.runtime.kernels.fused import FusedKernel

    kernel = FusedKernel(Op(0, fusion.FUSED, (((SILU[0], (Local(0),), ()),),), (), (1,), (), (), "test"))
    x = torch.randn(2, 3, 4, 5)
    mean = fused_mean.MeanAfter(torch.empty(2, 3, 1, 1), store=True)
    assert fused_mean.run(kernel, [], x, mean) is None and not mean.done  # the CPU


class SqueezeExcite(torch.nn.Module):
    """efficientnet_b0's block, small: depthwise conv, SiLU, squeeze (mean), excite, multiply;
    then a head whose SiLU only the mean reads."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.depthwise = torch.nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.reduce, self.expand = torch.nn.Conv2d(c, 4, 1), torch.nn.Conv2d(4, c, 1)
        self.head = torch.nn.Conv2d(c, 32, 1)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = torch.nn.functional.silu(self.depthwise(x))
        s = torch.sigmoid(self.expand(torch.nn.functional.silu(self.reduce(self.pool(y)))))
        z = torch.nn.functional.silu(self.head(y * s))
        return torch.flatten(self.pool(z), 1)


def se_graph(tmp_path, shape=(2, 16, 12, 12)):
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    torch.manual_seed(0)
    path = save_script(tmp_path, SqueezeExcite(shape[1]).eval(), "se")
    return compile_model(path, input_specs(["x".join(map(str, shape))]), device="cpu").artifact()


def test_each_mean_pairs_with_the_fused_op_before_it_only_where_it_is_issued_next(tmp_path, monkeypatch, use_settings):
    a = se_graph(tmp_path)
    g, order = a.graph, list(a.schedule.order)
    n = len(g.ops)
    placed = placement.prepare(g)
    found = pairs.mean_pairs(g, placed, order, [0] * n, [()] * n)
    assert len(found) == 2
    stores = []
    for fused, (mean, store, kernel) in found.items():
        assert kernel is placed[fused].substitute and mean.op.target == "aten::adaptive_avg_pool2d.default"
        assert mean.op.args[0].id == g.ops[fused].outputs[0] and order.index(mean.op.id) == order.index(fused) + 1
        stores.append(store)
    assert sorted(stores) == [False, True]  # the block's SiLU is read by the multiply too; the head's is not
    mean = next(iter(found.values()))[0].op.id
    waits = [()] * n
    waits[mean] = (0,)  # a mean that waits for another stream stays on its own
    assert mean not in {p.op.id for p, *_ in pairs.mean_pairs(g, placed, order, [0] * n, waits).values()}
    assert pairs.mean_pairs(g, placed, order, [k % 2 for k in range(n)], [()] * n) == {}  # on other streams
    assert pairs.find(g, placed, order, [0] * n, [()] * n).means == found
    assert pairs.find(g, placed, order, [0] * n, [()] * n, settings=Settings(mean_pairs=False)).means == {}


@pytest.mark.parametrize("dims, keepdim, pairs_", [([2, 3], True, True), ([-1, -2], False, True), ([1, 2], True, False)])
def test_a_mean_dim_pairs_only_over_the_last_two_dimensions(tmp_path, dims, keepdim, pairs_):
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    class Mean(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x * 2.0).mean(dims, keepdim=keepdim)

    path = tmp_path / "mean.pt"
    torch.jit.save(torch.jit.trace(Mean(), torch.randn(2, 3, 4, 5)), str(path))
    a = compile_model(path, input_specs(["2x3x4x5"]), device="cpu").artifact()
    n = len(a.graph.ops)
    found = pairs.mean_pairs(a.graph, placement.prepare(a.graph), list(a.schedule.order), [0] * n, [()] * n)
    assert bool(found) == pairs_


def test_pooling_to_more_than_one_position_stays_apart(tmp_path):
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    class Pool(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.adaptive_avg_pool2d(torch.relu(x * 2.0), (2, 2))

    path = tmp_path / "pool.pt"
    torch.jit.save(torch.jit.trace(Pool(), torch.randn(2, 3, 4, 6)), str(path))
    a = compile_model(path, input_specs(["2x3x4x6"]), device="cpu").artifact()
    n = len(a.graph.ops)
    assert "aten::adaptive_avg_pool2d.default" in {op.target for op in a.graph.ops}
    assert pairs.mean_pairs(a.graph, placement.prepare(a.graph), list(a.schedule.order), [0] * n, [()] * n) == {}


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 16, 12, 12), (1, 24, 56, 56), (3, 40, 7, 5)])
def test_a_squeeze_and_excitation_block_runs_its_means_in_its_silu_kernels_and_agrees_with_eager(
        tmp_path, monkeypatch, layout, shape, use_settings):
    """With the convolutions split from their epilogues (no cuDNN graph takes a whole body), both
    pairs run as one generated kernel each: two launches fewer than apart, and the outputs match
    the stored eager ones and those of the ops run apart. With the default choice (cuDNN may take
    a body whole, and its mean then runs apart) the outputs match too."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(depthwise_kernel=False)  # apart, its depthwise body would be one kernel too
    # the scale and the projection: one kernel or two, as timed at each load (this test compares two loads exactly)
    use_settings(input_pairs=False)
    use_settings(standalone_pointwise=False)  # likewise a 1x1 convolution alone
    write_artifact(tmp_path / "se.nimble", se_graph(tmp_path, shape))
    art = read_artifact(tmp_path / "se.nimble")
    x = [t.cuda() for t in art.sample_inputs]
    split = tuning.Choice(layout=layout, streams="serial", convolutions="split")
    exe = Executable(art, "cuda", choice=split, graph_dump=str(tmp_path / "paired.dot"))
    assert len(exe._pairs.means) == 2 and exe.stats.kernel_fallbacks == [], exe.stats.kernel_fallbacks
    built = [key for _, _, kernel in exe._pairs.means.values() for key, launch in kernel._built.items()
             if key[0] == "mean" and launch is not None]
    assert len(built) == 2
    result = compare(exe.run(*x), art.sample_outputs, rtol=1e-3, atol=1e-4)
    assert result.passed, result.describe()
    default = Executable(art, "cuda", choice=tuning.Choice(layout=layout, streams="serial"))
    result = compare(default.run(*x), art.sample_outputs, rtol=1e-3, atol=1e-4)
    assert result.passed, result.describe()
    use_settings(mean_pairs=False)
    apart = Executable(art, "cuda", choice=split, graph_dump=str(tmp_path / "apart.dot"))
    assert not apart._pairs.means
    torch.testing.assert_close(exe.run(*x)[0], apart.run(*x)[0], rtol=1e-5, atol=1e-6)
    assert count_kernels(tmp_path / "paired.dot") < count_kernels(tmp_path / "apart.dot")


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_excitation_scale_computed_in_the_multiply_agrees_with_eager_in_one_kernel_fewer(
        tmp_path, monkeypatch, layout, use_settings):
    """`bias_into_broadcast`: the excitation's convolution runs alone without its bias, and its
    bias and sigmoid run in the multiply's kernel. The block matches the stored eager outputs, and
    the same block compiled without the pass, in one kernel fewer (the excitation's convolutions
    on cuDNN, as `pooled_conv` would run both ways as one kernel)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble import pipeline
    from nimble.formats import read_artifact, write_artifact
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(pooled_kernel=False)
    use_settings(standalone_pointwise=False)  # nor as a timed matrix product: the test counts
    write_artifact(tmp_path / "moved.nimble", se_graph(tmp_path, (3, 40, 7, 5)))
    monkeypatch.setattr(pipeline, "FUSION", tuple(p for p in pipeline.FUSION if p.__name__ != "bias_into_broadcast"))
    write_artifact(tmp_path / "kept.nimble", se_graph(tmp_path, (3, 40, 7, 5)))
    outputs = {}
    for name in ("moved", "kept"):
        art = read_artifact(tmp_path / f"{name}.nimble")
        assert any(v.name.endswith(".broadcast") for v in art.graph.values) == (name == "moved")
        x = [t.cuda() for t in art.sample_inputs]
        exe = Executable(art, "cuda", choice=tuning.Choice(layout=layout, streams="serial", convolutions="split"),
                         graph_dump=str(tmp_path / f"{name}.dot"))
        assert exe.stats.kernel_fallbacks == [], exe.stats.kernel_fallbacks
        outputs[name] = exe.run(*x)
        result = compare(outputs[name], art.sample_outputs, rtol=1e-3, atol=1e-4)
        assert result.passed, result.describe()
    torch.testing.assert_close(outputs["moved"][0], outputs["kept"][0], rtol=1e-4, atol=1e-5)
    assert count_kernels(tmp_path / "moved.dot") == count_kernels(tmp_path / "kept.dot") - 1


@gpu
def test_a_depthwise_convolution_s_mean_runs_after_the_depthwise_kernel_unless_set(tmp_path, monkeypatch,
                                                                                  use_settings):
    """Under channels_last the depthwise kernel computes the block's depthwise convolution with its
    SiLU, and that op's mean runs apart: no cuDNN convolution, whose plan each process would build
    again. The head's mean still runs in its SiLU's kernel. `depthwise_mean_pairs` pairs both, as
    before; every way agrees with eager."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(input_pairs=False, standalone_pointwise=False)  # fewer load-time choices between the loads
    write_artifact(tmp_path / "se.nimble", se_graph(tmp_path, (2, 16, 12, 12)))
    art = read_artifact(tmp_path / "se.nimble")
    x = [t.cuda() for t in art.sample_inputs]
    split = tuning.Choice(layout="channels_last", streams="serial", convolutions="split")
    outputs = {}
    for paired in (False, True):
        use_settings(depthwise_mean_pairs=paired)
        exe = Executable(art, "cuda", choice=split)
        assert len(exe._pairs.means) == 2 and exe.stats.kernel_fallbacks == [], exe.stats.kernel_fallbacks
        kinds = sorted(key[0] for _, _, kernel in exe._pairs.means.values() for key, launch in kernel._built.items()
                       if launch is not None and key[0] in ("mean", "depthwise"))
        assert kinds == (["mean", "mean"] if paired else ["depthwise", "mean"]), kinds
        outputs[paired] = exe.run(*x)
        result = compare(outputs[paired], art.sample_outputs, rtol=1e-3, atol=1e-4)
        assert result.passed, result.describe()
    torch.testing.assert_close(outputs[False][0], outputs[True][0], rtol=1e-4, atol=1e-5)
