"""A depthwise convolution and its body as one kernel (`runtime/depthwise_conv.py`): its source run
on the CPU through `triton_shim` against torch's convolution for strides, paddings, dilations,
filter sizes and channel counts that do not fill a tile, which convolutions qualify, and on the
GPU mobilenet_v2's block against eager, in fewer kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nimble.ir import Local
from nimble.runtime import depthwise_conv, tuning

from .. import triton_shim
from .test_pooled_conv import with_and_without

RELU6 = ("aten::hardtanh.default", (Local(0), 0.0, 6.0), ())


def params(x, w, bias, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=None):
    return {"input": x, "weight": w, "bias": bias, "stride": stride, "padding": padding, "dilation": dilation,
            "groups": x.shape[1] if groups is None else groups}


def shim(body, out, x, w, operands, bias, p):
    block_p, block_c = depthwise_conv.blocks(out.shape[1])
    text = depthwise_conv.source(body, out, x, w, operands, bias, p)
    positions = out.shape[0] * out.shape[2] * out.shape[3]
    triton_shim.run_grid(text, (-(-positions // block_p), -(-out.shape[1] // block_c)), out, x, w, *operands,
                         BLOCK_P=block_p, BLOCK_C=block_c)


@pytest.mark.parametrize("n, c, size, k, stride, padding, dilation", [
    (2, 16, (9, 7), 3, (1, 1), (1, 1), (1, 1)),
    (1, 24, (12, 12), 3, (2, 2), (1, 1), (1, 1)),  # mobilenet_v2's downsampling
    (1, 40, (11, 10), 5, (2, 2), (2, 2), (1, 1)),  # efficientnet_b0's 5x5
    (3, 5, (6, 8), 3, (1, 2), (0, 1), (2, 1)),  # a channel count no tile divides, uneven arguments
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_convolution_and_its_relu6_are_what_torch_computes(n, c, size, k, stride, padding, dilation, with_bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, *size, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(c, 1, k, k, generator=g)
    b = torch.randn(c, generator=g) if with_bias else None
    want = F.hardtanh(F.conv2d(x, w, b, stride, padding, dilation, groups=c), 0.0, 6.0)
    out = torch.full_like(want, 7.0).contiguous(memory_format=torch.channels_last)
    p = params(x, w, b, stride, padding, dilation)
    operands = [b.reshape(1, -1, 1, 1)] if with_bias else []
    node = ("aten::convolution.default", (x, w, b, stride, padding, dilation, False, (0, 0), c), ())
    shim([node, RELU6], out, x, w, operands, with_bias, p)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_only_depthwise_convolutions_into_channels_last_results_qualify(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # `fits` reads only shapes here
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(8, 1, 3, 3), torch.randn(8)
    out = torch.empty(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    assert depthwise_conv.fits(params(x, w, b), out)
    assert not depthwise_conv.fits(params(x, w, b), torch.empty(2, 8, 6, 6))  # a contiguous result
    assert not depthwise_conv.fits(params(x, torch.randn(8, 2, 3, 3), b, groups=4), out)  # grouped, not depthwise
    assert not depthwise_conv.fits(params(x, torch.randn(8, 1, 9, 9), b, padding=(4, 4)), out)  # past MAX_TAPS
    assert not depthwise_conv.fits(params(x, w, b, stride=(2, 2)), out)  # not the shape it computes
    assert not depthwise_conv.fits(params(x.double(), w.double(), b.double()), out.double())
    monkeypatch.setattr(depthwise_conv, "ENABLED", False)
    assert not depthwise_conv.fits(params(x, w, b), out)


@pytest.mark.parametrize("channels, block_c", [(96, 32), (144, 16), (32, 32), (5, 8), (1280, 64)])
def test_a_tile_spans_channels_that_divide_them_where_it_can(channels, block_c):
    block_p, got = depthwise_conv.blocks(channels)
    assert got == block_c and block_p * got == depthwise_conv.TILE


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
    kernels_with, kernels_without = with_and_without(depthwise_conv, read_artifact(tmp_path / "b.nimble"), choice,
                                                     tmp_path, monkeypatch)
    assert kernels_with <= kernels_without - 2


def test_an_input_viewed_across_more_than_2_to_the_31_elements_gets_64_bit_indices():
    out = torch.empty(2, 8, 4, 4, device="meta").contiguous(memory_format=torch.channels_last)
    w = torch.empty(8, 1, 3, 3, device="meta")
    far = torch.empty_strided((2, 8, 4, 4), (2**31, 1, 32, 8), device="meta")
    node = ("aten::convolution.default", (), ())
    assert "tl.int64" not in depthwise_conv.source([node], out, out, w, [], False, params(out, w, None))
    assert "tl.program_id(0).to(tl.int64)" in depthwise_conv.source([node], out, far, w, [], False, params(far, w, None))
