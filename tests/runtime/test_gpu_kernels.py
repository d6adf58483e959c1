"""Fused ops on CUDA (`runtime/kernels/fused.py`) and the load-time choices (`runtime/tune/choices.py`):
every choice forced each way reproduces the model, generated kernels match the interpreted body,
and the tuning and kernel caches are used. Run with `pytest -m gpu`."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nimble
from nimble.formats import read_artifact
from nimble.ops import fusion
from nimble.runtime.kernels import cudnn_graph
from nimble.runtime import pairs
from nimble.runtime.placed import reference
from nimble.runtime.tune import choices as tuning
from nimble.runtime.base.compare import compare
from nimble.runtime.executable import Executable
from nimble.plan.capped import fold
from nimble.runtime.base.streams import count_kernels

from ..conftest import MODELS

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_forced_choice_reproduces_the_model(sample_artifacts, name):
    art = read_artifact(sample_artifacts[name])
    # the GEMM bias and the depthwise prologues are independent of the convolution algorithms: each
    # runs under one setting of them (the prologues under channels_last, the only layout they take)
    for choice in [c for c in tuning.every_choice() if c.algorithms == "heuristic" or (
            c.gemm_bias == "epilogue" and c.prologues == "apart")]:
        exe = Executable(art, "cuda", choice=choice)
        assert exe.stats.tuning == "forced" and exe.stats.kernel_fallbacks == [], exe.stats.kernel_fallbacks
        assert len(set(exe._stream_of)) <= (tuning.stream_cap(choice.streams) or exe.schedule.num_streams)
        if choice.streams == f"at most {tuning.CAP}" and art.schedule.capped:  # the artifact's candidate
            assert exe._stream_of == list(dict(art.schedule.capped)[tuning.CAP])
        result = compare(exe.run(*art.sample_inputs), art.sample_outputs, rtol=1e-2, atol=1e-3)
        assert result.passed, f"{choice}: {result.describe()}"
        fused = {op.outputs[0]: op for op in exe.graph.ops if op.target == fusion.FUSED}
        for vid in exe.outside_arena():  # only cuDNN's fused convolutions allocate their own result
            assert vid in fused and fusion.convolution_pattern(fusion.body_of(fused[vid])) is not None
            assert choice.convolutions == "cudnn-fused"


class Pointwise(nn.Module):
    """Elementwise chains and trees after convolutions: SE-style per-channel scaling, every
    activation the fused kernels know, scalars, and a residual."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 1)
        self.se = nn.Conv2d(16, 16, 1)
        self.c = nn.Conv2d(16, 16, 3, padding=1, groups=16)

    def forward(self, x):
        y = F.silu(self.a(x))
        s = torch.sigmoid(self.se(y.mean((2, 3), keepdim=True)))
        z = F.hardswish(self.b(y * s)) + y
        w = F.gelu(self.c(z)) * 0.5 - F.hardsigmoid(z) / 3.0
        u = F.relu6(w) + torch.tanh(z) * F.leaky_relu(w, 0.2)
        return F.gelu(torch.clamp(u, -1.0, 2.0) + F.elu(z), approximate="tanh")


@pytest.mark.parametrize("shape", [(1, 8, 12, 12), (4, 8, 7, 9)])
def test_generated_kernels_match_the_interpreted_body(shape):
    torch.manual_seed(0)
    module = Pointwise().eval()
    x = torch.randn(shape)
    with torch.no_grad():
        want = module(x)
    for layout in tuning.LAYOUTS:
        runner = nimble.Nimble(module).prepare(x)
        exe = runner._runner
        assert any(op.target == fusion.FUSED for op in exe.graph.ops)
        bodies = [[node[0] for node in fusion.body_of(op)] for op in exe.graph.ops if op.target == fusion.FUSED]
        # y * s computes s's bias and sigmoid (`bias_into_broadcast`); the convolution runs alone
        assert ["aten::add.Tensor", "aten::sigmoid.default", "aten::mul.Tensor"] in bodies
        assert [body for body in bodies if len(body) == 1] == [["aten::convolution.default"]]
        exe = Executable(exe.artifact, "cuda", choice=tuning.Choice(layout))
        assert exe.stats.kernel_fallbacks == [] and exe.stats.kernels_generated > 0
        got = exe(x.cuda()).cpu()
        interpreted = reference.run(exe.graph, exe.artifact.weights, [x], "cpu")[0]
        torch.testing.assert_close(got, interpreted, rtol=2e-3, atol=2e-4)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


def test_tuning_is_timed_once_then_read_from_the_cache(sample_artifacts):
    first = nimble.load(sample_artifacts["mobilenet"], device="cuda", tune="full")
    s = first.schedule
    planned = Executable(first.artifact, "cpu")  # the order and streams the load found its candidates under
    prologues = bool(pairs.find(planned.graph, planned._placed, planned._order, planned._stream_of, planned._waits,
                                prologues=True).prologues)
    options = tuning.candidates(first.graph, len(set(fold(s.order, s.stream, s.waits))), prologues)
    streams = len({c.streams for c in options})
    split = any(c.convolutions == "split" for c in options)
    # its classifier, a linear of few rows, runs as a generated kernel: no GEMM bias to choose
    bias = any(c.gemm_bias == "separate" for c in options)
    # both layouts, both algorithm settings; depthwise prologues under channels_last only
    assert not bias and len(options) == (4 + 2 * prologues) * streams * (1 + split)
    timed_split = split and cudnn_graph.frontend() is None  # with cuDNN graphs the split stage is skipped
    timed_prologues = prologues and first.choice.layout == "channels_last"  # the stage after the best so far
    assert first.stats.tuning == "timed"
    # both layouts with heuristic algorithms (with cuDNN graphs: channels_last, contiguous provisionally, and
    # contiguous again where that came within `provisional_layout`), then the faster of them with benchmarked
    # ones, then the later stages
    timed = first.stats.tuning_ms
    layouts = 2
    if cudnn_graph.frontend() is not None:
        base = "planned streams, heuristic algorithms, cudnn-fused"
        near = timed[f"contiguous, {base} (provisional)"] <= 1.3 * timed[f"channels_last, {base}"]
        assert (f"contiguous, {base}" in timed) == near
        layouts = 2 + near
    assert len(timed) == layouts + 1 + (streams - 1) + timed_split + bias + timed_prologues
    benchmarked = sum("benchmark algorithms" in k for k in timed)  # the later stages build on the best
    assert benchmarked == (1 if first.choice.algorithms == "heuristic" else len(timed) - layouts)
    assert tuning.cache_path().exists()
    again = nimble.load(sample_artifacts["mobilenet"], device="cuda")
    assert again.stats.tuning == "cache hit" and again.stats.choice == first.stats.choice
    assert again.stats.kernel_source_hits == again.stats.kernels_generated > 0
    off = nimble.load(sample_artifacts["mobilenet"], device="cuda", tune="off")
    assert off.stats.tuning == "off" and off.stats.choice == tuning.Choice().describe()


@pytest.mark.parametrize("name", ["transformer", "vit"])
def test_a_residual_sum_and_its_layer_norm_run_as_one_kernel(sample_artifacts, name):
    """On one stream each layer norm after an elementwise op runs in that op's kernel
    (`FusedKernel.with_norm`), and each attention result is copied once, through the head
    transpose, into the buffer of the copy after it (`copy_pairs`): the model's outputs are
    unchanged, and the pairs' kernels were built."""
    from nimble.runtime.kernels.fused import FusedKernel

    art = read_artifact(sample_artifacts[name])
    exe = Executable(art, "cuda", choice=tuning.Choice(streams="serial"))
    assert exe._pairs.norms and exe._pairs.copies and exe.stats.kernel_fallbacks == [], exe.stats.kernel_fallbacks
    result = compare(exe.run(*art.sample_inputs), art.sample_outputs, rtol=1e-2, atol=1e-3)
    assert result.passed, result.describe()
    built = [key for _, _, kernel in exe._pairs.norms.values() for key, launch in kernel._built.items()
             if key[0] == "norm" and launch is not None]
    assert len(built) >= 1 and all(isinstance(k, FusedKernel) for _, _, k in exe._pairs.norms.values())


@pytest.mark.parametrize("images, precision", [(1, "fp32"), (3, "fp32"), (3, "fp16")])
def test_shifted_window_attention_runs_as_attention_and_agrees_with_eager(images, precision):
    """Swin's shifted windows: one attention op reading the windows' mask, stored aligned (no copy
    of the mask before the kernel), repeated over the images above one; as eager computes it."""
    from ..passes.test_attention_masks import WindowAttention

    torch.manual_seed(0)
    module = WindowAttention(windows=4, tokens=49, heads=3, dim=96).eval().cuda()
    x = torch.randn(images * 4, 49, 96, device="cuda")
    model = nimble.Nimble(module).prepare(x, precision=precision, tolerance=1e-2 if precision != "fp32" else None)
    kinds = [op.target for op in model._runner.graph.ops]
    assert "aten::scaled_dot_product_attention.default" in kinds and "aten::softmax.int" not in kinds
    with torch.no_grad():
        want = module(x)
    result = compare([model(x)], [want], rtol=1e-2 if precision == "fp32" else 5e-2, atol=1e-3 if precision == "fp32" else 2e-2)
    assert result.passed, result.describe()


def test_an_aligned_mask_saves_the_copy_attention_makes_of_an_unaligned_one(tmp_path, monkeypatch, use_settings):
    """The same weight mask of 49 keys, stored padded (`align_attention_masks`) and as it is: the
    padded one's captured graph has fewer kernels (PyTorch pads an unaligned mask on every call).
    PyTorch's attention runs: the generated one (`small_attention`) reads either mask as it is."""
    from nimble import pipeline
    from nimble.runtime.kernels import small_attention

    use_settings(attention_kernel=False)

    from ..passes.test_attention_masks import WeightMask

    module = WeightMask(49).eval().cuda()
    xs = [torch.randn(2, 2, 49, 64, device="cuda") for _ in range(3)]
    counts, results = [], []
    for layout in (pipeline.LAYOUT, ()):
        monkeypatch.setattr(pipeline, "LAYOUT", layout)
        artifact = nimble.Nimble(module).prepare(xs)._runner.artifact
        dump = tmp_path / f"graph{len(counts)}.dot"
        exe = Executable(artifact, "cuda", graph_dump=str(dump))
        results.append(exe.run(*xs)[0])
        counts.append(count_kernels(dump))
    with torch.no_grad():
        want = module(*xs)
    for got in results:
        assert compare([got], [want], rtol=1e-3, atol=1e-4).passed
    assert counts[0] < counts[1], counts


class Casts(nn.Module):
    def forward(self, x):
        return (x * 2.0).to(torch.float16) * 3.0 + (x - 1.0).to(torch.bfloat16).float()


def test_a_cast_writes_its_planned_buffer_in_one_kernel(tmp_path, monkeypatch):
    """_to_copy and to(dtype) copy once into their buffer (`substitutes.copy`); their generated
    out= overloads convert into a temporary and copy that in: a memcpy node more per cast."""
    import re

    from nimble.runtime.placed import placement

    x = torch.randn(4, 64, device="cuda")
    artifact = nimble.Nimble(Casts().eval()).prepare(x)._runner.artifact
    nodes = []
    for substitutes in (placement.SUBSTITUTES, {k: v for k, v in placement.SUBSTITUTES.items()
                                                if k not in ("aten::_to_copy.default", "aten::to.dtype")}):
        monkeypatch.setattr(placement, "SUBSTITUTES", substitutes)
        dump = tmp_path / f"graph{len(nodes)}.dot"
        exe = Executable(artifact, "cuda", graph_dump=str(dump), tune="off")
        torch.testing.assert_close(exe(x), Casts()(x))
        nodes.append(len(re.findall(r"\b(?:KERNEL|MEMCPY)\b", dump.read_text(errors="replace"))))
    assert nodes[0] < nodes[1], nodes


def test_a_float16_transformer_block_runs_its_layer_norm_without_casts():
    from ..passes.test_reduce_precision import NormBetweenGemms

    torch.manual_seed(0)
    module = NormBetweenGemms().eval().cuda()
    x = torch.randn(8, 128, 32, device="cuda")
    model = nimble.Nimble(module).prepare(x, precision="fp16", tolerance=1e-2)
    g = model._runner.graph
    assert [op.target for op in g.ops].count("aten::_to_copy.default") <= 2  # the input's and the output's only
    with torch.no_grad():
        want = module(x)
    assert compare([model(x)], [want], rtol=5e-2, atol=2e-2).passed


class Projection(nn.Module):
    """A projection of a 3-D input whose result goes on as it is (BERT's query, key and value
    before the head split): its bias cannot move into an elementwise kernel after it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 96)

    def forward(self, x):
        return self.proj(x).view(8, 16, 6, 16).transpose(1, 2)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_linear_with_bias_on_a_3d_input_is_one_gemm(tmp_path, monkeypatch, precision):
    """`substitutes._linear`: addmm with cuBLASLt's bias epilogue into the planned buffer, one
    kernel in half precision; linear's out= overload runs a GEMM and then an add of the bias."""
    from nimble.runtime.placed import placement, substitutes

    torch.manual_seed(0)
    module = Projection().eval().cuda()
    x = torch.randn(8, 16, 64, device="cuda")
    model = nimble.Nimble(module).prepare(x, precision=precision, tolerance=1e-2 if precision != "fp32" else None)
    artifact = model._runner.artifact
    kernels = []
    for linear in (substitutes._linear, lambda args, out: None):
        monkeypatch.setattr(substitutes, "_linear", linear)
        monkeypatch.setitem(placement.SUBSTITUTES, "aten::linear.default", linear)
        dump = tmp_path / f"graph{len(kernels)}.dot"
        exe = Executable(artifact, "cuda", graph_dump=str(dump), tune="off")
        with torch.no_grad():
            assert compare([exe(x)], [module(x)], rtol=1e-2, atol=1e-2).passed
        kernels.append(count_kernels(dump))
    # in half precision cuBLASLt fuses the bias; in float32 it may run the bias apart either way
    assert kernels[0] < kernels[1] if precision == "fp16" else kernels[0] <= kernels[1], kernels


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("scale_shape", [(3, 5, 1, 1), ()])
def test_a_generated_kernel_reads_a_broadcast_scale_even_a_0d_one(layout, scale_shape):
    """A one-node body as `generate_broadcast_ops` makes it, x * scale: a per-image, per-channel
    scale, and a 0-d one (every stride 0: its offsets are a block of zeros, as Triton's load
    needs), compiled, not interpreted, in either layout and at odd sizes."""
    from nimble.ir import Op, Ref
    from nimble.runtime.kernels import fused as kernels, generated

    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, 9, device="cuda").to(memory_format=layout)
    scale = torch.randn(scale_shape, device="cuda")
    op = Op(0, fusion.FUSED, ((("aten::mul.Tensor", (Ref(0), Ref(1)), ()),),), (), (2,), (), (), "test")
    fallbacks = len(generated.STATS.fallbacks)
    out = torch.empty_like(x)
    got = kernels.FusedKernel(op)([(("aten::mul.Tensor", (x, scale), ()),)], out)
    assert got is out and len(generated.STATS.fallbacks) == fallbacks, generated.STATS.fallbacks[fallbacks:]
    torch.testing.assert_close(out, x * scale, rtol=0, atol=0)


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock: a 7x7 depthwise convolution, its channels moved last for a layer
    norm and two linears, moved back, scaled and added to the block's input."""

    def __init__(self, dim: int = 48):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.scale = nn.Parameter(torch.full((dim, 1, 1), 0.5))

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.scale * self.down(F.gelu(self.up(y))).permute(0, 3, 1, 2)


def test_a_layer_norm_over_a_channels_first_map_s_channels_is_one_kernel(tmp_path):
    """In NCHW, ConvNeXt's permute then layer norm: PyTorch makes the permuted map dense, normalises
    it and copies the result into its buffer; `norms.LAYER_NORM_CHANNELS` reads it where it lies
    and writes the buffer, one kernel. The setting off gives PyTorch's three, in the same process."""
    import re

    from nimble.runtime.base.settings import Settings

    torch.manual_seed(0)
    module = ConvNeXtBlock().eval().cuda()
    x = torch.randn(2, 48, 14, 14, device="cuda")
    artifact = nimble.Nimble(module).prepare(x)._runner.artifact
    with torch.no_grad():
        want = module(x)
    nodes = []
    for chosen in (None, Settings(channels_norm_kernel=False)):
        dump = tmp_path / f"graph{len(nodes)}.dot"
        exe = Executable(artifact, "cuda", choice=tuning.Choice("contiguous"), graph_dump=str(dump), settings=chosen)
        assert compare([exe(x)], [want], rtol=1e-2, atol=1e-3).passed
        nodes.append(len(re.findall(r"\b(?:KERNEL|MEMCPY)\b", dump.read_text(errors="replace"))))
    assert nodes[0] + 2 == nodes[1], nodes
