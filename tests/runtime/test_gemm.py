"""Float32 matrix products as one kernel (`runtime/kernels/gemm.py`): its source run on the CPU through
`triton_shim` against PyTorch's product (shapes no tile fills, transposed and strided operands, a
strided result, with and without a bias), which ops and calls qualify, and on the GPU against
PyTorch in a capture and in a loaded model with linear, addmm and mm ops."""

from __future__ import annotations

import pytest
import torch

from nimble.runtime.kernels import gemm

from .. import triton_shim
from ..models import FeedForward


def run(x, b, bias, out, tile=gemm.TILES[0]):
    grid, constants = gemm.grid(x, b, tile)
    constants.pop("num_stages")
    triton_shim.run_grid(gemm.source(x, b, bias, out, tile=tile), grid, x, b, out, out if bias is None else bias,
                         **constants)


@pytest.mark.parametrize("m, k, n", [(7, 33, 65), (64, 64, 64), (130, 70, 3), (1, 1, 1), (65, 96, 129)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("tile", gemm.TILES)
def test_the_kernel_computes_what_pytorch_s_product_does(m, k, n, with_bias, tile):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g).t()  # a linear's weight, transposed: strides (1, k)
    bias = torch.randn(n, generator=g) if with_bias else None
    want = torch.addmm(bias, x, b) if with_bias else x @ b
    out = torch.full((m, n), 7.0)
    run(x, b, bias, out, tile)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_elementwise_op_after_the_product_runs_in_its_kernel():
    """bias, GELU and a residual add on the product's tiles, stored in the op's buffer: the
    product's own buffer is never written."""
    from nimble.ir import Local
    from nimble.runtime.kernels.codegen import pointwise_operands as _operands

    g = torch.Generator().manual_seed(2)
    x, b = torch.randn(2, 35, 40, generator=g), torch.randn(40, 70, generator=g)
    product = torch.full((2, 35, 70), 7.0)  # the product's buffer, as the elementwise op reads it
    bias, residual = torch.randn(70, generator=g), torch.randn(2, 35, 70, generator=g)
    body = (("aten::add.Tensor", (product, bias), (("alpha", 1),)),
            ("aten::gelu.default", (Local(0),), (("approximate", "none"),)),
            ("aten::add.Tensor", (Local(1), residual), (("alpha", 1),)))
    operands = _operands(body, skip_first=False)
    into = torch.full((2, 35, 70), 5.0)
    epilogue = gemm.Epilogue(body, operands, 0, into)
    x2, out2 = x.view(-1, 40), product.view(-1, 70)
    tile = gemm.TILES[-1]
    grid, constants = gemm.grid(x2, b, tile)
    constants.pop("num_stages")
    triton_shim.run_grid(gemm.source(x2, b, None, out2, epilogue, tile), grid, x2, b, into, into, *operands,
                         **constants)
    want = torch.nn.functional.gelu(x @ b + bias) + residual
    torch.testing.assert_close(into, want, rtol=1e-5, atol=1e-5)
    assert bool((product == 7.0).all())


@pytest.mark.parametrize("tile", gemm.TILES)
def test_the_product_is_stored_where_the_copy_of_its_permuted_windows_would_put_it(tile):
    """`scatter`: Swin's window merge, the product's rows [windows * 9, C] stored straight into
    the merged map [B, H, W, C] (the copy's buffer), seen back as [B, H/3, W/3, 3, 3, C]."""
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(2 * 2 * 3 * 9, 40, generator=g), torch.randn(40, 24, generator=g)
    bias = torch.randn(24, generator=g)
    merged = torch.full((2, 6, 9, 24), 7.0)  # the copy's buffer
    into = merged.view(2, 2, 3, 3, 3, 24).permute(0, 1, 3, 2, 4, 5)  # seen back through the permutation
    out = torch.full((x.shape[0], 24), 5.0)  # the product's own buffer: never written
    grid, constants = gemm.grid(x, b, tile)
    constants.pop("num_stages")
    triton_shim.run_grid(gemm.source(x, b, bias, out, tile=tile, scatter=into), grid, x, b, into, bias, **constants)
    rows = torch.addmm(bias, x, b)
    want = rows.view(2, 2, 3, 3, 3, 24).permute(0, 1, 3, 2, 4, 5).reshape(2, 6, 9, 24)
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-5)
    assert bool((out == 5.0).all())


def test_strided_operands_and_a_result_inside_a_larger_buffer():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 2 * 50, generator=g)[:, ::2]  # every other column
    b = torch.randn(50, 30, generator=g)
    bias = torch.randn(2 * 30, generator=g)[::2]
    whole = torch.full((40, 70), 7.0)
    out = whole[:, 20:50]  # a column slice: the rest of the buffer is left as it was
    run(x, b, bias, out)
    torch.testing.assert_close(out, torch.addmm(bias, x, b), rtol=1e-5, atol=1e-5)
    assert bool((whole[:, :20] == 7.0).all()) and bool((whole[:, 50:] == 7.0).all())


def test_buffers_that_share_bytes_are_seen_to_overlap():
    from nimble.runtime.kernels.codegen import overlaps

    arena = torch.zeros(1000)
    a, b, c = arena[:400].view(20, 20), arena[300:700].view(20, 20), arena[700:].view(20, 15)
    assert overlaps(a, (None, b)) and overlaps(b, (a,)) and not overlaps(a, (c, None)) and not overlaps(b, (c,))
    assert overlaps(arena[::2][:10], (arena[18:19],)) and not overlaps(arena[::2][:10], (arena[19:20],))


def test_a_tensor_spanning_more_than_2_to_the_31_elements_gets_64_bit_indices():
    """Meta tensors: only shapes and strides are read."""
    x, b, out = (torch.empty(64, 64, device="meta") for _ in range(3))
    assert "tl.int64" not in gemm.source(x, b, None, out)
    far = torch.empty_strided((64, 64), (2**31, 1), device="meta")
    for args in ((far, b, None, out), (x, far, None, out), (x, b, None, far)):
        text = gemm.source(*args)
        assert "tl.program_id(0).to(tl.int64)" in text and "tl.arange(0, BLOCK_K).to(tl.int64)" in text


def test_which_calls_qualify(monkeypatch, use_settings):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # `fits` reads only shapes here
    x, w, bias = torch.randn(2, 5, 8), torch.randn(3, 8), torch.randn(3)
    out = torch.empty(2, 5, 3)
    got = gemm.operands_of("aten::linear.default", [x, w, bias], out)
    assert got is not None and got[0].shape == (10, 8) and got[1].shape == (8, 3) and got[3].shape == (10, 3)
    assert got[3].data_ptr() == out.data_ptr() and got[1].stride() == (1, 8)
    assert gemm.operands_of("aten::linear.default", [x, w], out) is not None
    assert gemm.operands_of("aten::linear.default", [x.transpose(0, 1), w, bias], out.transpose(0, 1)) is None  # no view
    assert gemm.operands_of("aten::addmm.default", [bias, x[0], w.t()], out[0]) is not None
    assert gemm.operands_of("aten::mm.default", [x[0], w.t()], out[0]) is not None
    assert gemm.operands_of("aten::mm.default", [x[0].double(), w.t().double()], out[0].double()) is None
    assert gemm.operands_of("aten::mm.default", [x[0], w], out[0]) is None  # shapes that do not chain
    assert gemm.operands_of("aten::matmul.default", [x[0], w.t()], out[0]) is not None
    assert gemm.operands_of("aten::matmul.default", [x, w.t()], out) is None  # batched: not a matrix product
    assert gemm.operands_of("aten::addmm.default", [torch.randn(5, 3), x[0], w.t()], out[0]) is None  # a 2-D bias
    use_settings(gemm_kernel=False)
    assert gemm.operands_of("aten::mm.default", [x[0], w.t()], out[0]) is None


def test_which_ops_qualify():
    from nimble.ir import Graph, Op, Ref, TensorSpec, Value

    specs = (((4, 8), "float32"), ((3, 8), "float32"), ((3,), "float32"), ((4, 3), "float32"), ((4, 3), "float16"))
    g = Graph(tuple(Value(i, "activation", TensorSpec(shape, dtype), f"v{i}") for i, (shape, dtype) in enumerate(specs)),
              (), (0,), (3,))
    x, w, bias, out, half = 0, 1, 2, 3, 4
    assert gemm.applies(g, Op(0, "aten::linear.default", (Ref(x), Ref(w), Ref(bias)), (), (out,)))
    assert gemm.applies(g, Op(0, "aten::mm.default", (Ref(x), Ref(w)), (), (out,)))
    assert gemm.applies(g, Op(0, "aten::addmm.default", (Ref(bias), Ref(x), Ref(w)), (("beta", 1), ("alpha", 1)), (out,)))
    assert not gemm.applies(g, Op(0, "aten::addmm.default", (Ref(bias), Ref(x), Ref(w)), (("beta", 0.5),), (out,)))
    assert not gemm.applies(g, Op(0, "aten::addmm.default", (Ref(bias), Ref(x), Ref(w), 2), (), (out,)))
    assert not gemm.applies(g, Op(0, "aten::mm.default", (Ref(x), Ref(w)), (), (half,)))  # float32 only
    assert not gemm.applies(g, Op(0, "aten::bmm.default", (Ref(x), Ref(w)), (), (out,)))


class Products(torch.nn.Module):
    """Two linears (the first's bias joins the ReLU's kernel), an addmm, a matmul of matrices and
    a matmul of a matrix by a weight."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(96, 300), torch.nn.Linear(300, 96, bias=False)
        self.w, self.b = torch.nn.Parameter(torch.randn(96, 40)), torch.nn.Parameter(torch.randn(40))
        self.m = torch.nn.Parameter(torch.randn(96, 50))

    def forward(self, x):
        y = self.down(torch.relu(self.up(x))) + x
        flat = y.reshape(-1, 96)
        return torch.addmm(self.b, flat, self.w), flat.t() @ flat, flat @ self.m


def test_weights_read_only_as_a_product_s_right_operand_are_stored_k_major(tmp_path, monkeypatch, use_settings):
    from nimble.pipeline import compile_model
    from nimble.runtime.base import regions
    from nimble.specs import input_specs

    path = tmp_path / "products.pt"
    torch.jit.save(torch.jit.trace(Products().eval(), torch.randn(4, 33, 96)), str(path))
    graph = compile_model(path, input_specs(["4x33x96"]), device="cpu", check=False).graph
    assert {graph.values[k].name for k in gemm.k_major_weights(graph)} == {"w", "m"}  # not the linears' weights
    use_settings(gemm_kernel=False)
    assert gemm.k_major_weights(graph) == set()
    w = torch.randn(96, 40)
    packed = regions.pack({"w": w, "other": w}, torch.device("cpu"), strides={"w": (1, 96)})
    assert packed["w"].stride() == (1, 96) and torch.equal(packed["w"], w) and packed["other"].stride() == (40, 1)


gpu = pytest.mark.gpu


def loaded_artifact(module: torch.nn.Module, tmp_path, monkeypatch, use_settings, shape=(4, 33, 96)):
    """`module` traced on an input of `shape`, compiled on the CPU and read back, with the kernel
    chosen however fast it is and no choice left from another test."""
    from nimble.formats import read_artifact, write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(gemm_slower=float("inf"))
    monkeypatch.setattr(gemm, "_chosen", {})
    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.trace(module.eval(), torch.randn(shape)), str(path))
    spec = "x".join(map(str, shape))
    write_artifact(tmp_path / "m.nimble", compile_model(path, input_specs([spec]), device="cpu").artifact())
    return read_artifact(tmp_path / "m.nimble")


@gpu
def test_on_the_gpu_it_agrees_with_pytorch_and_replays_in_a_capture(monkeypatch, use_settings):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 7, 200, device="cuda", generator=g)  # 21 rows: no tile filled
    w = torch.randn(129, 200, device="cuda", generator=g)
    bias = torch.randn(129, device="cuda", generator=g)
    out = torch.empty(3, 7, 129, device="cuda")
    use_settings(gemm_slower=float("inf"))  # the kernel, however fast
    monkeypatch.setattr(gemm, "_chosen", {})
    product = gemm.Gemm(0, "aten::linear.default", None)
    assert product([x, w, bias], out) is out
    want = torch.nn.functional.linear(x.double(), w.double(), bias.double()).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert product([x, w, bias], out) is out
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    first_seen = torch.empty(5, 129, device="cuda")  # a new signature inside a capture: PyTorch's way
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert product([x[0, :5], w, bias], first_seen) is None


@gpu
def test_a_model_of_linear_addmm_and_mm_agrees_with_eager(tmp_path, monkeypatch, use_settings):
    """Loaded with the kernel and without, both match eager, and the kernel ran every product,
    reading the addmm's and the matmul's weights as the executable stored them (K-major)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.runtime.tune import choices as tuning

    from .test_pooled_conv import with_and_without

    art = loaded_artifact(Products(), tmp_path, monkeypatch, use_settings)
    choice = tuning.Choice(layout="contiguous", streams="serial")
    with_and_without("gemm_kernel", art, choice, tmp_path)
    assert len(gemm._chosen) >= 5 and all(tile in gemm.TILES for tile in gemm._chosen.values())
    use_settings(gemm_kernel=True)
    from nimble.runtime.executable import Executable
    exe = Executable(art, "cuda", choice=choice)
    strides = {art.graph.values[k].name: exe._stored_weights[k].stride() for k in gemm.k_major_weights(art.graph)}
    assert strides == {"w": (1, 96), "m": (1, 96)}, strides  # stored transposed, read as [K, N]


@gpu
def test_the_op_after_a_product_is_not_written_over_the_product_s_input(monkeypatch, use_settings):
    """A memory plan may place the elementwise op's result where the product's input was (that
    input dies at the product): one kernel would then write it while other tiles still read it."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.ir import Local

    use_settings(gemm_slower=float("inf"))
    monkeypatch.setattr(gemm, "_chosen", {})
    arena = torch.randn(2 * 128 * 64, device="cuda")
    x, into = arena[: 128 * 64].view(128, 64), arena[64 * 64: 64 * 64 + 128 * 64].view(128, 64)  # overlapping
    w = torch.randn(64, 64, device="cuda")
    out = torch.empty(128, 64, device="cuda")
    body = (("aten::relu.default", (out,), ()), ("aten::mul.Scalar", (Local(0), 2.0), ()))
    product = gemm.Gemm(0, "aten::linear.default", None)
    assert not product.with_epilogue([x, w], out, body, [out], into)
    clear = torch.empty(128, 64, device="cuda")
    assert product.with_epilogue([x, w], out, body, [out], clear)
    torch.testing.assert_close(clear, torch.relu(x @ w.t()) * 2.0, rtol=1e-5, atol=1e-4)


class Block(torch.nn.Module):
    """A feed-forward block of linears: linear, GELU, linear, residual add."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(96, 384), torch.nn.Linear(384, 96)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))) + x


def kernels_paired_and_apart(art, switch: str, kind: str, pairs_made: int, tmp_path) -> dict:
    """{True: kernels of `art`'s graph loaded with the pairs `switch` (a setting) turns on,
    False: without}: each load makes `pairs_made` pairs of `kind` (or none), interprets nothing,
    and matches the sample outputs."""
    from nimble.runtime.kernels import generated
    from dataclasses import replace

    from nimble.runtime.base.settings import current
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels

    x = [t.cuda() for t in art.sample_inputs]
    counts = {}
    for paired in (True, False):
        chosen = replace(current(), **{switch: paired})  # on top of `loaded_artifact`'s
        before = len(generated.STATS.fallbacks)
        exe = Executable(art, "cuda", choice=tuning.Choice(layout="contiguous", streams="serial"),
                         graph_dump=str(tmp_path / f"{paired}.dot"), settings=chosen)
        assert generated.STATS.fallbacks[before:] == []
        assert len(getattr(exe._pairs, kind)) == (pairs_made if paired else 0)
        result = compare(exe.run(*x), art.sample_outputs, rtol=1e-4, atol=1e-4)
        assert result.passed, result.describe()
        counts[paired] = count_kernels(tmp_path / f"{paired}.dot")
    return counts


@gpu
def test_a_window_merge_stores_the_projection_into_the_merged_map_on_the_gpu(tmp_path, monkeypatch, use_settings):
    """Swin's window merge (`WindowMerge`) loaded with scatter pairs and without: both match
    eager, and with them one kernel fewer runs (the reshape's copy)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ..models import WindowMerge

    art = loaded_artifact(WindowMerge(), tmp_path, monkeypatch, use_settings, (2, 6, 9, 96))
    counts = kernels_paired_and_apart(art, "scatter_pairs", "scatters", 1, tmp_path)
    assert counts[True] == counts[False] - 1, counts


@gpu
@pytest.mark.parametrize("block", [Block, FeedForward])
def test_the_elementwise_op_after_a_product_runs_in_its_kernel_on_the_gpu(block, tmp_path, monkeypatch,
                                                                          use_settings):
    """A feed-forward block loaded with product pairs and without: both match eager, and with
    them two kernels fewer run (GELU's and the add's). In GPT-2's form (`FeedForward`) the op
    reads the product's rows through a reshape."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    art = loaded_artifact(block(), tmp_path, monkeypatch, use_settings)
    counts = kernels_paired_and_apart(art, "product_pairs", "products", 2, tmp_path)
    assert counts[True] == counts[False] - 2, counts
