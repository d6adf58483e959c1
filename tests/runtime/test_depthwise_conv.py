"""A depthwise convolution and its body as one kernel (`runtime/kernels/depthwise_conv.py`): its source run
on the CPU through `triton_shim` against torch's convolution for strides, paddings, dilations,
filter sizes and channel counts that do not fill a tile, which convolutions qualify, and on the
GPU mobilenet_v2's block against eager, in fewer kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nimble.ir import Local, Op
from nimble.ops.interpret import run_fused
from nimble.runtime.kernels import depthwise_conv
from nimble.runtime.tune import choices as tuning

from .. import triton_shim
from .test_pooled_conv import with_and_without

RELU6 = ("aten::hardtanh.default", (Local(0), 0.0, 6.0), ())


def params(x, w, bias, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=None):
    return {"input": x, "weight": w, "bias": bias, "stride": stride, "padding": padding, "dilation": dilation,
            "groups": x.shape[1] if groups is None else groups}


def shim(body, out, x, w, operands, bias, p):
    grid, block_p, block_c = depthwise_conv.grid(out, w.shape[2] * w.shape[3])
    text = depthwise_conv.source(body, out, x, w, operands, bias, p)
    triton_shim.run_grid(text, grid, out, x, w, *operands, BLOCK_P=block_p, BLOCK_C=block_c)


@pytest.mark.parametrize("n, c, size, k, stride, padding, dilation", [
    (2, 16, (9, 7), 3, (1, 1), (1, 1), (1, 1)),
    (1, 24, (12, 12), 3, (2, 2), (1, 1), (1, 1)),  # mobilenet_v2's downsampling
    (1, 40, (11, 10), 5, (2, 2), (2, 2), (1, 1)),  # efficientnet_b0's 5x5
    (3, 5, (6, 8), 3, (1, 2), (0, 1), (2, 1)),  # a channel count no tile divides, uneven arguments
    (2, 12, (9, 9), 7, (1, 1), (3, 3), (1, 1)),  # ConvNeXt's 7x7
    (2, 6, (7, 9), 3, (1, 1), (2, 2), (2, 2)),  # dilated, as wide as its input
])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_the_convolution_and_its_relu6_are_what_torch_computes(n, c, size, k, stride, padding, dilation, with_bias,
                                                                layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, *size, generator=g).contiguous(memory_format=layout)
    w = torch.randn(c, 1, k, k, generator=g)
    b = torch.randn(c, generator=g) if with_bias else None
    want = F.hardtanh(F.conv2d(x, w, b, stride, padding, dilation, groups=c), 0.0, 6.0)
    out = torch.full_like(want, 7.0).contiguous(memory_format=torch.channels_last)  # the input in either layout
    p = params(x, w, b, stride, padding, dilation)
    operands = [b.reshape(1, -1, 1, 1)] if with_bias else []
    node = ("aten::convolution.default", (x, w, b, stride, padding, dilation, False, (0, 0), c), ())
    shim([node, RELU6], out, x, w, operands, with_bias, p)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


SILU = ("aten::silu.default", (Local(0),), ())


@pytest.mark.parametrize("epilogue", ["relu6", "scale and silu"])
@pytest.mark.parametrize("n, c, size, k, stride, padding", [
    (2, 16, (9, 7), 3, (1, 1), (1, 1)),
    (1, 40, (11, 10), 5, (2, 2), (2, 2)),
    (3, 5, (6, 8), 3, (1, 2), (0, 1)),
])
def test_the_producer_s_epilogue_applied_on_load_is_what_torch_computes(epilogue, n, c, size, k, stride, padding):
    """mobilenet_v2's expansion: a 1x1 convolution, its bias and relu6 (or a per-channel scale and
    SiLU), then the depthwise convolution. The kernel reads the expansion's bare convolution and
    applies the rest tap by tap: padding taps are zero after it, not relu6(bias)."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(n, 3, *size, generator=g)
    w0, b0 = torch.randn(c, 3, 1, 1, generator=g), torch.randn(c, generator=g)
    scale = torch.rand(c, 1, 1, generator=g) + 0.5
    bare = F.conv2d(x0, w0).contiguous(memory_format=torch.channels_last)  # what the producer writes
    if epilogue == "relu6":
        before_body = [("aten::convolution.default", (x0, w0, b0), ()), RELU6]
        operands, activated = (b0.reshape(1, -1, 1, 1),), F.hardtanh(bare + b0.reshape(1, -1, 1, 1), 0.0, 6.0)
    else:
        before_body = [("aten::convolution.default", (x0, w0, b0), ()), ("aten::mul.Tensor", (Local(0), scale), ()),
                       ("aten::silu.default", (Local(1),), ())]
        operands = (scale, b0.reshape(1, -1, 1, 1))
        activated = F.silu((bare + b0.reshape(1, -1, 1, 1)) * scale)
    before = depthwise_conv.Prologue(before_body, operands, True)
    w, b = torch.randn(c, 1, k, k, generator=g), torch.randn(c, generator=g)
    want = F.hardtanh(F.conv2d(activated, w, b, stride, padding, groups=c), 0.0, 6.0)
    out = torch.full_like(want, 7.0).contiguous(memory_format=torch.channels_last)
    p = params(bare, w, b, stride, padding)
    node = ("aten::convolution.default", (bare, w, b, stride, padding, (1, 1), False, (0, 0), c), ())
    assert depthwise_conv.prologue_fits(before, bare)
    block_p, block_c = depthwise_conv.blocks(c)
    text = depthwise_conv.source([node, RELU6], out, bare, w, [b.reshape(1, -1, 1, 1)], True, p, before)
    positions = out.shape[0] * out.shape[2] * out.shape[3]
    triton_shim.run_grid(text, (-(-positions // block_p), -(-c // block_c)), out, bare, w, b.reshape(1, -1, 1, 1),
                         *operands, BLOCK_P=block_p, BLOCK_C=block_c)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_an_epilogue_that_reads_more_than_a_value_per_channel_is_not_applied_on_load():
    bare = torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    body = [("aten::convolution.default", (bare, bare, None), ()), ("aten::add.Tensor", (Local(0), None), ())]
    for t, fits in [(torch.randn(4, 1, 1), True), (torch.randn(1, 4, 1, 1), True), (torch.randn(1), True),
                    (torch.randn(5, 5), False), (torch.randn(2, 4, 1, 1), False), (torch.randn(4, 1, 1).double(), False),
                    (torch.randn(3, 1, 1), False)]:
        assert depthwise_conv.prologue_fits(depthwise_conv.Prologue(body, (t,), False), bare) is fits, t.shape


def test_only_depthwise_convolutions_into_dense_results_qualify(monkeypatch, use_settings):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # `fits` reads only shapes here
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(8, 1, 3, 3), torch.randn(8)
    out = torch.empty(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    assert depthwise_conv.fits(params(x, w, b), out)
    assert not depthwise_conv.fits(params(x, w, b), torch.empty(2, 8, 6, 6))  # NCHW stays with cuDNN
    assert not depthwise_conv.fits(params(x, w, b), torch.empty(2, 8, 12, 6)[:, :, ::2])  # dense in no order
    assert not depthwise_conv.fits(params(x, torch.randn(8, 2, 3, 3), b, groups=4), out)  # grouped, not depthwise
    assert not depthwise_conv.fits(params(x, torch.randn(8, 1, 9, 9), b, padding=(4, 4)), out)  # past MAX_TAPS
    assert not depthwise_conv.fits(params(x, w, b, stride=(2, 2)), out)  # not the shape it computes
    assert not depthwise_conv.fits(params(x.double(), w.double(), b.double()), out.double())
    use_settings(depthwise_kernel=False)
    assert not depthwise_conv.fits(params(x, w, b), out)


@pytest.mark.parametrize("channels, block_c", [(96, 32), (144, 16), (32, 32), (5, 8), (1280, 64)])
def test_a_tile_spans_channels_that_divide_them_where_it_can(channels, block_c):
    block_p, got = depthwise_conv.blocks(channels)
    assert got == block_c and block_p * got == depthwise_conv.TILE


@pytest.mark.parametrize("channels, positions, taps, tile", [
    (96, 56 * 56, 49, (16, 16)),  # convnext_tiny's first stage at batch 1: 1176 programs, not 147
    (768, 7 * 7, 49, (16, 16)),  # its last: as small as tiles go
    (96, 8 * 56 * 56, 49, (64, 32)),  # batch 8: 1176 programs already
    (96, 56 * 56, 9, (64, 32)),  # a 3x3 filter keeps its tile whatever the count
    (40, 14 * 14, 25, (256, 8)),  # and so does efficientnet_b0's 5x5
])
def test_a_wide_filter_over_few_positions_takes_smaller_tiles(channels, positions, taps, tile):
    block_p, block_c = depthwise_conv.blocks(channels, positions, taps)
    assert (block_p, block_c) == tile
    if taps > depthwise_conv.WIDE_TAPS:
        programs = -(-positions // block_p) * -(-channels // block_c)
        assert programs >= depthwise_conv.PROGRAMS or max(tile) == depthwise_conv.SMALL_BLOCK


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_mobilenet_v2_s_block_agrees_with_eager_in_fewer_kernels(tmp_path, monkeypatch, batch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    class Block(torch.nn.Module):  # expand, depthwise (stride 2, then 1), project: batch norms folded
        def __init__(self):
            super().__init__()
            self.expand = torch.nn.Conv2d(16, 96, 1)
            self.down = torch.nn.Conv2d(96, 96, 3, 2, 1, groups=96)
            self.same = torch.nn.Conv2d(96, 96, 5, 1, 2, groups=96)
            self.project = torch.nn.Conv2d(96, 24, 1)

        def forward(self, x):
            y = F.relu6(self.down(F.relu6(self.expand(x))))
            return self.project(F.relu6(self.same(y)) + y)

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    path = tmp_path / "block.pt"
    torch.jit.save(torch.jit.trace(Block().eval(), torch.randn(batch, 16, 28, 28)), str(path))
    write_artifact(tmp_path / "b.nimble", compile_model(path, input_specs([f"{batch}x16x28x28"]), device="cpu").artifact())
    choice = tuning.Choice(layout="channels_last", streams="serial", convolutions="split")
    kernels_with, kernels_without = with_and_without("depthwise_kernel", read_artifact(tmp_path / "b.nimble"), choice,
                                                     tmp_path)
    assert kernels_with <= kernels_without - 2


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_with_prologue_pairs_the_expansion_s_epilogue_runs_in_the_depthwise_kernel(tmp_path, monkeypatch, batch, use_settings):
    """Depthwise prologues on a mobilenet_v2 block: the expansion writes its convolution alone,
    the depthwise kernel applies its bias and relu6 as it loads; the outputs agree with eager and
    with the run without pairs, in one kernel fewer (the expansion's epilogue)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.pipeline import compile_model
    from nimble.runtime.kernels import generated
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels
    from nimble.specs import input_specs

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(prologue_slower=100.0)  # kept wherever it builds: this test counts kernels
    use_settings(standalone_pointwise=False)  # the expansion alone: one kernel or two, as timed
    torch.manual_seed(0)
    path = tmp_path / "block.pt"
    torch.jit.save(torch.jit.trace(Inverted().eval(), torch.randn(batch, 8, 28, 28)), str(path))
    write_artifact(tmp_path / "b.nimble",
                   compile_model(path, input_specs([f"{batch}x8x28x28"]), device="cpu").artifact())
    art = read_artifact(tmp_path / "b.nimble")
    x = [t.cuda() for t in art.sample_inputs]
    outputs = {}
    for paired in (True, False):
        choice = tuning.Choice(layout="channels_last", streams="serial", convolutions="split",
                               prologues=tuning.PROLOGUES[paired])
        before = len(generated.STATS.fallbacks)
        exe = Executable(art, "cuda", choice=choice, graph_dump=str(tmp_path / f"{paired}.dot"))
        assert bool(exe._pairs.prologues) is paired and generated.STATS.fallbacks[before:] == []
        outputs[paired] = exe.run(*x)
        result = compare(outputs[paired], art.sample_outputs, rtol=1e-3, atol=1e-4)
        assert result.passed, result.describe()
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=1e-3, atol=1e-4)
    assert count_kernels(tmp_path / "True.dot") == count_kernels(tmp_path / "False.dot") - 1


def test_an_input_viewed_across_more_than_2_to_the_31_elements_gets_64_bit_indices():
    out = torch.empty(2, 8, 4, 4, device="meta").contiguous(memory_format=torch.channels_last)
    w = torch.empty(8, 1, 3, 3, device="meta")
    far = torch.empty_strided((2, 8, 4, 4), (2**31, 1, 32, 8), device="meta")
    node = ("aten::convolution.default", (), ())
    assert "tl.int64" not in depthwise_conv.source([node], out, out, w, [], False, params(out, w, None))
    assert "tl.program_id(0).to(tl.int64)" in depthwise_conv.source([node], out, far, w, [], False, params(far, w, None))


class ShimKernel:
    """`generated.define` on the CPU: the generated text run through `triton_shim`."""

    def __init__(self, source):
        self.source = source

    def __getitem__(self, grid):
        return lambda *args, **constants: triton_shim.run_grid(self.source, grid, *args, **constants)


def fused_kernel(op_id, body):
    from nimble.ops import fusion
    from nimble.runtime.kernels import fused as kernels

    return kernels.FusedKernel(Op(op_id, fusion.FUSED, (tuple(body),), (), (op_id,), (), (), "test"))


def expansion_then_depthwise(g, c: int, size: tuple, stride: int):
    """mobilenet's expansion (1x1 from 8 channels to `c`, bias, relu6) into `mid`, then a
    depthwise 3x3 (`stride`, padding 1, bias, relu6) into `out`, both channels_last and filled
    with 7: (x0, w0, expand's body, mid, the depthwise body, out, what eager computes)."""
    cl = torch.channels_last
    x0 = torch.randn(2, 8, *size, generator=g).contiguous(memory_format=cl)
    w0, b0 = torch.randn(c, 8, 1, 1, generator=g), torch.randn(c, generator=g)
    wd, bd = torch.randn(c, 1, 3, 3, generator=g), torch.randn(c, generator=g)
    expand = [("aten::convolution.default", (x0, w0, b0, (1, 1), (0, 0), (1, 1), False, (0, 0), 1), ()), RELU6]
    mid = torch.full((2, c, *size), 7.0).contiguous(memory_format=cl)
    depthwise = [("aten::convolution.default", (mid, wd, bd, (stride,) * 2, (1, 1), (1, 1), False, (0, 0), c), ()),
                 RELU6]
    want = F.hardtanh(F.conv2d(F.hardtanh(F.conv2d(x0, w0, b0), 0.0, 6.0), wd, bd, stride, 1, groups=c), 0.0, 6.0)
    out = torch.full(want.shape, 7.0).contiguous(memory_format=cl)
    return x0, w0, expand, mid, depthwise, out, want


@pytest.mark.parametrize("kernel", ["generated", "generated, timed slower", "fails to build"])
def test_a_bare_producer_and_its_depthwise_reader_give_what_eager_does(kernel, monkeypatch, use_settings):
    """The runtime's side of `pairs.prologue_pairs`: the producer writes its convolution alone;
    the depthwise op applies the producer's bias and relu6 as it loads (its generated kernel,
    here through the shim), or, where that kernel fails to build, interprets them into a buffer
    of its own first. Where the pair was timed slower than the two run whole, the producer runs
    whole from then on. Either way the result is eager's."""
    import contextlib

    from nimble.runtime.kernels import fused as kernels, generated

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the CUDA paths, on the CPU
    monkeypatch.setattr(generated, "STATS", generated.KernelStats())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels.timing, "on_stream", lambda device: contextlib.nullcontext())
    times = iter([2.0, 1.0] if kernel == "generated, timed slower" else [1.0, 2.0])  # the pair's, then whole
    monkeypatch.setattr(kernels.timing, "graph_us", lambda fn, device: (fn(), next(times))[1])
    monkeypatch.setattr(kernels.FusedKernel, "whole_on_cudnn", lambda self, body, out: None)  # no cuDNN here
    use_settings(standalone_pointwise=False)  # the producer run whole: as before, untimed
    if kernel != "fails to build":
        monkeypatch.setattr(generated, "define", ShimKernel)
    else:
        def refuse(source):
            raise RuntimeError("no Triton here")
        monkeypatch.setattr(generated, "define", refuse)
    x0, w0, expand, mid, depthwise, out, want = expansion_then_depthwise(torch.Generator().manual_seed(2), 24,
                                                                         (10, 9), 2)
    producer, consumer = fused_kernel(1, expand), fused_kernel(2, depthwise)
    producer.bare, consumer.after_bare = True, producer
    assert producer([expand], mid) is mid and producer.wrote_bare is not None
    torch.testing.assert_close(mid, F.conv2d(x0, w0))  # its convolution alone: no bias, no relu6
    assert consumer([depthwise], out) is out
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert producer.bare is (kernel != "generated, timed slower")
    out.fill_(7.0)
    assert producer([expand], mid) is not None and consumer([depthwise], out) is out  # again: the same call
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    interpreted = [f for f in generated.STATS.fallbacks if "its input's epilogue interpreted" in f]
    assert len(interpreted) == (kernel == "fails to build"), generated.STATS.fallbacks
    # where the producer did not write bare (its body broadcasts past its convolution: it ran
    # whole), its reader applies nothing (None: the runtime interprets the body, as it would)
    producer.wrote_bare = None
    out.fill_(7.0)
    mid.copy_(run_fused(expand))
    got = consumer([depthwise], out)
    torch.testing.assert_close(got if got is not None else run_fused(depthwise), want, rtol=1e-4, atol=1e-4)


class Inverted(torch.nn.Module):
    """An inverted residual's first half: expansion (1x1, batch norm, relu6), then the depthwise
    3x3 (batch norm, relu6); `shared`: the expanded map is read again (summed into the result),
    `residual`: the expansion adds the input before its relu6."""

    def __init__(self, shared=False, residual=False):
        super().__init__()
        self.shared, self.residual = shared, residual
        self.expand, self.bn1 = torch.nn.Conv2d(8, 8 if residual else 24, 1, bias=False), \
            torch.nn.BatchNorm2d(8 if residual else 24)
        c = self.expand.out_channels
        self.dw, self.bn2 = torch.nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        e = self.bn1(self.expand(x))
        e = F.relu6(e + x if self.residual else e)
        y = F.relu6(self.bn2(self.dw(e)))
        return y + e if self.shared else y


@pytest.mark.parametrize("variant, paired", [("plain", True), ("shared", False), ("residual", False)])
def test_a_depthwise_op_is_paired_with_its_producer_only_where_the_epilogue_can_move(tmp_path, variant, paired):
    """`pairs.prologue_pairs`: the expansion's epilogue moves into the depthwise kernel only where
    the expanded map has no other reader and the epilogue reads values per channel alone; an op
    in another pair is left alone."""
    from nimble.pipeline import compile_model
    from nimble.runtime import pairs
    from nimble.runtime.placed.placement import prepare
    from nimble.specs import input_specs

    from ..conftest import save_script

    model = Inverted(shared=variant == "shared", residual=variant == "residual").eval()
    path = save_script(tmp_path, model, variant)
    graph = compile_model(path, input_specs(["2x8x6x6"]), device="cpu", check=False).artifact().graph
    placed = prepare(graph)
    found = pairs.prologue_pairs(graph, placed, set())
    assert bool(found) is paired, found
    for consumer, producer in found.items():
        assert graph.values[graph.ops[consumer].args[0][0][1][0].id].producer == producer
        assert pairs.prologue_pairs(graph, placed, {producer}) == {}
        assert pairs.prologue_pairs(graph, placed, {consumer}) == {}



@pytest.mark.parametrize("kernel_faster", [True, False])
def test_a_wide_filter_runs_the_way_measured_faster_and_a_later_load_recalls_it(kernel_faster, tmp_path, monkeypatch):
    """ConvNeXt's 7x7: the depthwise kernel or cuDNN's convolution (`FusedKernel._generated`, here
    torch's convolution), whichever `graph_us` timed faster on the first call; later calls and a
    later load (a fresh kernel, the choice recalled from the cache folder) run that way untimed.
    A 3x3 filter runs the kernel untimed."""
    import contextlib

    from nimble.runtime.kernels import fused as kernels, generated, recall

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(recall, "_where", lambda device: ("H-test", 9, 0, "torch", "triton", "code"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the CUDA paths, on the CPU
    monkeypatch.setattr(generated, "STATS", generated.KernelStats())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels.timing, "on_stream", lambda device: contextlib.nullcontext())
    ran = []

    class Counted(ShimKernel):
        def __getitem__(self, grid):
            run = super().__getitem__(grid)
            return lambda *args, **constants: (ran.append("kernel"), run(*args, **constants))
    monkeypatch.setattr(generated, "define", Counted)

    def by_torch(self, body, out):
        ran.append("cudnn")
        x, w, b = body[0][1][:3]
        out.copy_(F.conv2d(x, w, b, 1, w.shape[-1] // 2, groups=x.shape[1]))
        return out
    monkeypatch.setattr(kernels.FusedKernel, "_generated", by_torch)
    timed = []

    def graph_us(fn, device):
        fn()
        timed.append(len(timed))
        return {0: 1.0, 1: 2.0}[len(timed) - 1] if kernel_faster else {0: 2.0, 1: 1.0}[len(timed) - 1]
    monkeypatch.setattr(kernels.timing, "graph_us", graph_us)
    g = torch.Generator().manual_seed(3)
    for k in (7, 3):
        x = torch.randn(2, 12, 9, 9, generator=g).contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(12, 1, k, k, generator=g), torch.randn(12, generator=g)
        body = [("aten::convolution.default", (x, w, b, (1, 1), (k // 2,) * 2, (1, 1), False, (0, 0), 12), ())]
        want = F.conv2d(x, w, b, 1, k // 2, groups=12)
        for load in range(2):
            op = fused_kernel(1, body)
            for _ in range(2):
                out = torch.full_like(want, 7.0).contiguous(memory_format=torch.channels_last)
                ran.clear()
                got = op([body], out)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                assert ran[-1] == ("kernel" if k == 3 or kernel_faster else "cudnn"), ran  # the way that wrote it
        assert len(timed) == 2, timed  # the 7x7 timed once, on the first load's first call; the 3x3 never
