"""A 1x1 convolution of a 1x1 map and its body as one kernel (`runtime/kernels/pooled_conv.py`): its source
run on the CPU through `triton_shim` against torch's convolution, which convolutions qualify, and
on the GPU a squeeze-and-excitation block against eager in both layouts, in fewer kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nimble.ir import Local
from nimble.runtime.kernels import pooled_conv
from nimble.runtime.tune import choices as tuning

from .. import triton_shim
from .test_fused_mean import se_graph

SILU = ("aten::silu.default", (Local(0),), ())


def conv_node(x, w, bias):
    return ("aten::convolution.default", (x, w, bias, (1, 1), (0, 0), (1, 1), False, (0, 0), 1), ())


def params(x, w, bias, padding=(0, 0), groups=1):
    return {"input": x, "weight": w, "bias": bias, "stride": (1, 1), "padding": padding, "dilation": (1, 1),
            "groups": groups}


def shim(body, out, x, w, operands, bias):
    """The kernel's launch on the CPU, as `pooled_conv.launcher` makes it."""
    block, block_ci = pooled_conv.blocks(out, x.shape[1])
    text = pooled_conv.source(body, out, x, w, operands, bias)
    triton_shim.run_grid(text, (out.shape[0], -(-out.shape[1] // block)), out, x, w, *operands, BLOCK=block,
                         BLOCK_CI=block_ci)


@pytest.mark.parametrize("n, c_in, c_out", [(1, 1152, 48), (8, 48, 1152), (3, 37, 70), (2, 5, 3), (16, 300, 200)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_convolution_and_its_silu_are_what_torch_computes(n, c_in, c_out, channels_last, with_bias):
    g = torch.Generator().manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, c_in, 1, 1, generator=g).contiguous(memory_format=fmt)
    w = torch.randn(c_out, c_in, 1, 1, generator=g).contiguous(memory_format=fmt)
    b = torch.randn(c_out, generator=g) if with_bias else None
    out = torch.full((n, c_out, 1, 1), 7.0).contiguous(memory_format=fmt)
    operands = [b.reshape(1, -1, 1, 1)] if with_bias else []  # as `FusedKernel.operands` gives them
    shim([conv_node(x, w, b), SILU], out, x, w, operands, with_bias)
    torch.testing.assert_close(out, F.silu(F.conv2d(x, w, b)), rtol=1e-5, atol=1e-5)


def test_a_convolution_alone_and_a_body_of_other_operands():
    """The excitation's second convolution (its bias moved out, `bias_into_broadcast`) alone, and
    a body that reads a per-image operand and one of the result's own shape."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 20, 1, 1, generator=g), torch.randn(30, 20, 1, 1, generator=g)
    out = torch.empty(4, 30, 1, 1)
    shim([conv_node(x, w, None)], out, x, w, [], False)
    torch.testing.assert_close(out, F.conv2d(x, w), rtol=1e-5, atol=1e-5)
    per_image, same = torch.randn(4, 1, 1, 1, generator=g), torch.randn(4, 30, 1, 1, generator=g)
    body = [conv_node(x, w, None), ("aten::mul.Tensor", (Local(0), per_image), ()),
            ("aten::add.Tensor", (Local(1), same), (("alpha", 1),)), ("aten::sigmoid.default", (Local(2),), ())]
    shim(body, out, x, w, [per_image, same], False)
    torch.testing.assert_close(out, torch.sigmoid(F.conv2d(x, w) * per_image + same), rtol=1e-5, atol=1e-5)


def test_only_small_unpadded_ungrouped_1x1_convolutions_of_a_1x1_map_qualify(monkeypatch, use_settings):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # `fits` reads only shapes here
    x, w, b = torch.randn(2, 8, 1, 1), torch.randn(4, 8, 1, 1), torch.randn(4)
    out = torch.empty(2, 4, 1, 1)
    assert pooled_conv.fits(params(x, w, b), out)
    assert not pooled_conv.fits(params(torch.randn(2, 8, 2, 1), w, b), torch.empty(2, 4, 2, 1))  # a 2x1 map
    assert not pooled_conv.fits(params(x, torch.randn(4, 8, 3, 3), b, padding=(1, 1)), out)  # 3x3, padded
    assert not pooled_conv.fits(params(x, w, b, padding=(1, 1)), torch.empty(2, 4, 3, 3))
    assert not pooled_conv.fits(params(x, torch.randn(4, 4, 1, 1), b, groups=2), out)  # grouped
    assert not pooled_conv.fits(params(x.half(), w.half(), b), out.half())  # a bias of another dtype
    assert not pooled_conv.fits(params(x.double(), w.double(), b.double()), out.double())  # no Triton float64
    big = torch.empty(1, 2**12, 1, 1)
    assert not pooled_conv.fits(params(big, torch.empty(2**12 + 1, 2**12, 1, 1), None),
                                torch.empty(1, 2**12 + 1, 1, 1))  # past MAX_PRODUCTS
    use_settings(pooled_kernel=False)
    assert not pooled_conv.fits(params(x, w, b), out)


@pytest.mark.parametrize("n, c_out", [(1, 48), (8, 1152), (64, 4000)])
def test_the_programs_fill_the_gpu_and_hold_a_bounded_tile(n, c_out):
    out = torch.empty(n, c_out, 1, 1)
    block, block_ci = pooled_conv.blocks(out, 1152)
    assert pooled_conv.MIN_BLOCK <= block <= 64 and block * block_ci <= max(pooled_conv.MAX_TILE, 32 * block)
    assert block & (block - 1) == 0 and block_ci & (block_ci - 1) == 0  # powers of two, as tl.arange wants
    if n * c_out >= 8 * pooled_conv.PROGRAMS:
        assert n * -(-c_out // block) >= pooled_conv.PROGRAMS // 2


@pytest.mark.parametrize("m, k, n", [(8, 1280, 1000), (1, 2048, 1000), (3, 17, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_linear_of_few_rows_is_what_torch_computes(m, k, n, with_bias):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    out = torch.full((m, n), 7.0)
    shim([pooled_conv.LINEAR], out, x, w, [] if b is None else [b], with_bias)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    transposed = torch.randn(k, m, generator=g).t()  # an input read through its strides
    shim([pooled_conv.LINEAR], out, transposed, w, [] if b is None else [b], with_bias)
    torch.testing.assert_close(out, F.linear(transposed, w, b), rtol=1e-4, atol=1e-4)


def test_which_linears_run_generated_is_known_from_the_graph(tmp_path, monkeypatch, use_settings):
    from nimble.pipeline import compile_model
    from nimble.runtime.placed import placement
    from nimble.specs import input_specs

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small, self.large = torch.nn.Linear(64, 10), torch.nn.Linear(64, 4096)

        def forward(self, x):
            return self.small(x), self.large(x)

    path = tmp_path / "heads.pt"
    torch.jit.save(torch.jit.trace(Heads(), torch.randn(8, 64)), str(path))
    use_settings(max_pooled_products=8 * 64 * 100)  # the small head fits, the large does not
    graph = compile_model(path, input_specs(["8x64"]), device="cpu").graph
    linears = [op for op in graph.ops if op.target == "aten::linear.default"]
    assert sorted(placement.small_product(graph, op) for op in linears) == [0, 8 * 64 * 10]
    small = [p.substitute for p in placement.prepare(graph) if isinstance(p.substitute, pooled_conv.SmallLinear)]
    assert len(small) == 1 and not small[0].calls_cublas and small[0].product == 8 * 64 * 10
    assert any(c.gemm_bias == "separate" for c in tuning.candidates(graph, 1))  # the large head's choice
    use_settings(max_pooled_products=2**24)  # both fit: no GEMM bias left to choose
    assert all(c.gemm_bias == "epilogue" for c in tuning.candidates(graph, 1))
    use_settings(pooled_kernel=False)
    assert all(placement.small_product(graph, op) == 0 for op in linears)


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_squeeze_and_excitation_block_agrees_with_eager_with_its_convolutions_generated(
        tmp_path, monkeypatch, layout):
    """Both excitation convolutions of the block (one with a SiLU after it, one alone) run as
    generated kernels: the outputs match the stored eager ones and those with cuDNN's
    convolutions. With the convolutions split from their epilogues (no cuDNN graph takes a body
    whole), the first convolution and its SiLU take one kernel, not two."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    write_artifact(tmp_path / "se.nimble", se_graph(tmp_path, (3, 40, 7, 5)))
    choice = tuning.Choice(layout=layout, streams="serial", convolutions="split")
    kernels_with, kernels_without = with_and_without("pooled_kernel", read_artifact(tmp_path / "se.nimble"), choice,
                                                     tmp_path)
    assert kernels_with == kernels_without - 1


def with_and_without(setting: str, art, choice, tmp_path) -> tuple[int, int]:
    """`art` loaded and run with the kernel `setting` (`base/settings.py`) on, then off: each run falls back nowhere and
    matches the stored eager outputs, and the two match each other. Returns each run's kernels."""
    from nimble.runtime.kernels import fused as kernels, generated
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from dataclasses import replace

    from nimble.runtime.base.settings import current
    from nimble.runtime.base.streams import count_kernels

    x = [t.cuda() for t in art.sample_inputs]
    # a 1x1 convolution's generated matrix product is timed at each load: these counts and tolerances are not its
    outputs = {}
    for enabled in (True, False):
        chosen = replace(current(), standalone_pointwise=False, **{setting: enabled})
        before = len(generated.STATS.fallbacks)
        exe = Executable(art, "cuda", choice=choice, graph_dump=str(tmp_path / f"{enabled}.dot"), settings=chosen)
        assert generated.STATS.fallbacks[before:] == []
        outputs[enabled] = exe.run(*x)
        result = compare(outputs[enabled], art.sample_outputs, rtol=1e-3, atol=1e-4)
        assert result.passed, result.describe()
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=1e-3, atol=1e-4)
    return count_kernels(tmp_path / "True.dot"), count_kernels(tmp_path / "False.dot")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_in_reduced_precision_agrees_with_torch(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.ir import Op
    from nimble.ops import fusion
    from nimble.runtime.kernels.fused import FusedKernel

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1152, 1, 1, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(48, 1152, 1, 1, generator=g) / 30).to("cuda", dtype)
    b = torch.randn(48, generator=g).to("cuda", dtype)
    body = (conv_node(x, w, b), SILU)
    kernel = FusedKernel(Op(0, fusion.FUSED, (((body[0][0], (None,) * 9, ()), SILU),), (), (1,), (), (), "test"))
    out = torch.empty(8, 48, 1, 1, device="cuda", dtype=dtype)
    assert kernel._direct(list(body), out) is out
    want = F.silu(F.conv2d(x.float(), w.float(), b.float()))
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_a_classifier_runs_generated_and_no_stream_makes_a_cublas_workspace(tmp_path, monkeypatch, batch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.pipeline import compile_model
    from nimble.runtime.kernels import generated
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.specs import input_specs

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(3, 96, 3), torch.nn.Linear(96, 1000)

        def forward(self, x):
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1), 1))

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    path = tmp_path / "classifier.pt"
    torch.jit.save(torch.jit.trace(Classifier().eval(), torch.randn(batch, 3, 16, 16)), str(path))
    write_artifact(tmp_path / "c.nimble", compile_model(path, input_specs([f"{batch}x3x16x16"]), device="cpu").artifact())
    art = read_artifact(tmp_path / "c.nimble")
    before = len(generated.STATS.fallbacks)
    exe = Executable(art, "cuda")
    small = [p.substitute for p in exe._placed if isinstance(p.substitute, pooled_conv.SmallLinear)]
    assert len(small) == 1 and not small[0].calls_cublas and generated.STATS.fallbacks[before:] == []
    assert not exe._blas_ready
    result = compare(exe.run(*[t.cuda() for t in art.sample_inputs]), art.sample_outputs, rtol=1e-3, atol=1e-4)
    assert result.passed, result.describe()


def test_an_input_viewed_across_more_than_2_to_the_31_elements_gets_64_bit_indices():
    """A channel slice of a larger buffer spans more than its elements: the offsets it needs,
    not its size, decide the index width (meta tensors: only shapes and strides are read)."""
    out = torch.empty(2, 4, 1, 1, device="meta")
    w = torch.empty(4, 8, 1, 1, device="meta")
    near = torch.empty_strided((2, 8, 1, 1), (2**20, 1, 1, 1), device="meta")
    far = torch.empty_strided((2, 8, 1, 1), (2**31, 1, 1, 1), device="meta")
    assert "tl.int64" not in pooled_conv.source([pooled_conv.LINEAR], out, near, w, [], False)
    assert "tl.program_id(0).to(tl.int64)" in pooled_conv.source([pooled_conv.LINEAR], out, far, w, [], False)
