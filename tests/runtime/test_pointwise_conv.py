"""A 1x1 convolution that computes its input as it loads it (`runtime/kernels/pointwise_conv.py`,
`pairs.input_pairs`, `memory.read_later`): the kernel's source run on the CPU through
`triton_shim` against torch for densenet's batch norm and ReLU over a cat (parts that a block of
channels spans one at a time, and parts it does not) and efficientnet's squeeze-and-excitation
scale; which convolutions qualify; the memory plan holding the elementwise op's inputs, and the
load-time proof refusing a plan that does not; the runtime's two paths; and on the GPU a
densenet block and an SE block against eager, in fewer kernels."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from nimble.ir import Local
from nimble.ops import fusion
from nimble.runtime.kernels import fused as kernels, generated
from nimble.runtime.kernels import codegen, pointwise_conv

from .. import triton_shim
from .test_depthwise_conv import ShimKernel, fused_kernel

CL = torch.channels_last
RELU = ("aten::relu.default", (Local(0),), ())
SILU = ("aten::silu.default", (Local(0),), ())


def conv_node(x, w, bias):
    return ("aten::convolution.default", (x, w, bias, (1, 1), (0, 0), (1, 1), False, (0, 0), 1), ())


def params(x, w, bias):
    return fusion.conv_params(*conv_node(x, w, bias)[:2])


def densenet_input(g, n, channels, size):
    """densenet's batch norm and ReLU over a cat of parts with these channels: (body, pieces,
    what it computes)."""
    pieces = [torch.randn(n, c, *size, generator=g).contiguous(memory_format=CL) for c in channels]
    total = sum(channels)
    scale, shift = torch.rand(1, total, 1, 1, generator=g) + 0.5, torch.randn(1, total, 1, 1, generator=g)
    body = [("aten::cat.default", (pieces, 1), ()), ("aten::mul.Tensor", (Local(0), scale), ()),
            ("aten::add.Tensor", (Local(1), shift), ()), ("aten::relu.default", (Local(2),), ())]
    return body, pieces, F.relu(torch.cat(pieces, 1) * scale + shift)


def se_input(g, n, channels, size):
    """efficientnet's squeeze-and-excitation scale: x * sigmoid(s + b), s one value per image and
    channel (`channels`: one count)."""
    (channels,) = channels
    x = torch.randn(n, channels, *size, generator=g).contiguous(memory_format=CL)
    s, b = torch.randn(n, channels, 1, 1, generator=g), torch.randn(1, channels, 1, 1, generator=g)
    body = [("aten::add.Tensor", (s, b), ()), ("aten::sigmoid.default", (Local(0),), ()),
            ("aten::mul.Tensor", (x, Local(1)), ())]
    return body, [], x * torch.sigmoid(s + b)


def conv_body(g, x, x_want, cout, activation):
    """The 1x1 convolution's body over `x` (its input buffer; `x_want` what it holds): with its
    bias and `activation` (a node over Local(0)), or, where None, without a bias and with a
    residual add. (body, operands, what it computes, the filter)."""
    n, cin, *size = x.shape
    w, b = torch.randn(cout, cin, 1, 1, generator=g), torch.randn(cout, generator=g)
    residual = torch.randn(n, cout, *size, generator=g).contiguous(memory_format=CL)
    if activation is not None:
        want = {"aten::relu.default": F.relu, "aten::silu.default": F.silu}[activation[0]](F.conv2d(x_want, w, b))
        return [conv_node(x, w, b), activation], [b.reshape(1, -1, 1, 1)], want, w
    return [conv_node(x, w, None), ("aten::add.Tensor", (Local(0), residual), ())], [residual], \
        F.conv2d(x_want, w) + residual, w


@pytest.fixture(autouse=True)
def exact_products_on_the_cpu(request, monkeypatch):
    """The CPU tests check what the kernel computes against float32 convolutions at 1e-4: there the
    operands are not rounded to TF32 first (the shim's products are exact). The rounding has tests
    of its own, and the GPU tests run as a load does."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(pointwise_conv, "ROUND_TF32", False)


def tf32(t: torch.Tensor, rounded: bool = True) -> torch.Tensor:
    """`t` as a TF32 product takes it: rounded to the nearest TF32 value, ties away from zero, or
    with its 13 low bits dropped (what Triton's tf32 products do)."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000 if rounded else bits) & ~0x1FFF).view(torch.float32)


def shim_run(body, out, w, operands, bias, before, tile):
    text = pointwise_conv.source(body, out, w, operands, bias, before, tile)
    rows = out.shape[0] * out.shape[2] * out.shape[3]
    programs = -(-rows // tile[0]) * -(-out.shape[1] // tile[1])
    triton_shim.run_grid(text, programs, out, w, *operands, *before.pieces, *before.operands,
                         BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=tile[2])
    return text


@pytest.mark.parametrize("kind, channels", [
    ("cat", (64, 32, 32)),  # parts on block boundaries: one loop picks the part of each block
    ("cat", (24, 13)),  # parts off them: a loop per part
    ("se", (40,)),
])
@pytest.mark.parametrize("tile", [pointwise_conv.TILES[1], (16, 32, 16, 4, 3)])
@pytest.mark.parametrize("after", ["bias and relu", "residual add"])
def test_the_kernel_computes_the_convolution_of_the_elementwise_op_s_result(kind, channels, tile, after):
    g = torch.Generator().manual_seed(0)
    n, size, cout = 2, (5, 7), 20
    before_body, pieces, x_want = (densenet_input if kind == "cat" else se_input)(g, n, channels, size)
    total = x_want.shape[1]
    x = torch.full((n, total, *size), float("nan")).contiguous(memory_format=CL)  # never written, never read
    body, operands, want, w = conv_body(g, x, x_want, cout, RELU if after == "bias and relu" else None)
    before = pointwise_conv.Before(tuple(before_body), x, tuple(pieces),
                                   tuple(codegen.pointwise_operands(before_body, skip_first=bool(pieces))))
    out = torch.full_like(want, 7.0).contiguous(memory_format=CL)
    text = shim_run(body, out, w, operands, after == "bias and relu", before, tile)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    aligned = kind == "cat" and all(c % tile[2] == 0 for c in channels[:-1])
    assert ("base = tl.where" in text) is aligned


def test_the_shim_rounds_to_the_nearest_tf32_value_ties_away_from_zero_as_the_gpu_does():
    """`cvt.rna.tf32.f32` in `triton_shim`, which the rounding tests below rely on: TF32 keeps 10
    bits of the mantissa, so 1 + 2**-11 lies halfway and rounds away from zero."""
    tl = triton_shim.language()
    x = torch.tensor([1 + 2**-11, -(1 + 2**-11), 1 + 2**-11 - 2**-23, 1 + 3 * 2**-11, 3.0, float("inf")])
    got = tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                    pack=1)
    assert got.tolist() == [1 + 2**-10, -(1 + 2**-10), 1.0, 1 + 2 * 2**-10, 3.0, float("inf")]
    assert torch.equal(got[:5], tf32(x[:5]))


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_float32_operands_are_rounded_to_the_nearest_tf32_value_before_a_tf32_product(allow_tf32, monkeypatch):
    """Triton's TF32 products drop each operand's 13 low bits, so with positive operands every
    error leans the same way; the kernel rounds both operands first (`ROUND_TF32`). Its result is
    the exact product of the rounded operands, not of the truncated ones. With TF32 off the
    products are three TF32 ones (float32's accuracy) and nothing is rounded."""
    monkeypatch.setattr(pointwise_conv, "ROUND_TF32", True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow_tf32)
    g = torch.Generator().manual_seed(9)
    x = (torch.rand(2, 96, 3, 5, generator=g) + 1).contiguous(memory_format=CL)
    w, b = torch.rand(24, 96, 1, 1, generator=g) + 1, torch.randn(24, generator=g)
    out = torch.full((2, 24, 3, 5), 7.0).contiguous(memory_format=CL)
    text = shim_run([conv_node(x, w, b), RELU], out, w, [b.reshape(1, -1, 1, 1)], True,
                    pointwise_conv.Before.alone(x), pointwise_conv.TILES[1])
    assert text.count("cvt.rna.tf32.f32") == (2 if allow_tf32 else 0)
    assert ('input_precision="tf32"' in text) is allow_tf32

    def product(xs, ws):
        return F.relu(F.conv2d(xs.double(), ws.double(), b.double())).float()
    if allow_tf32:
        torch.testing.assert_close(out, product(tf32(x), tf32(w)), rtol=1e-6, atol=1e-5)
        assert float((out - product(tf32(x, rounded=False), tf32(w, rounded=False))).abs().max()) > 1e-3
    else:
        torch.testing.assert_close(out, product(x, w), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("tile", [pointwise_conv.TILES[2], (16, 32, 16, 4, 3)])
@pytest.mark.parametrize("after", ["bias and silu", "residual add"])
def test_the_kernel_alone_computes_a_1x1_convolution_and_its_body(tile, after):
    """`Before.alone`: no elementwise op, the input read as it lies (efficientnet's expansion
    convolution and SiLU, a projection and its residual add)."""
    g = torch.Generator().manual_seed(5)
    n, size, cin, cout = 2, (5, 7), 24, 40
    x = torch.randn(n, cin, *size, generator=g).contiguous(memory_format=CL)
    body, operands, want, w = conv_body(g, x, x, cout, SILU if after == "bias and silu" else None)
    out = torch.full_like(want, 7.0).contiguous(memory_format=CL)
    shim_run(body, out, w, operands, after == "bias and silu", pointwise_conv.Before.alone(x), tile)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_only_1x1_convolutions_into_channels_last_results_over_the_elementwise_result_qualify(monkeypatch, use_settings):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # `fits` reads only shapes here
    g = torch.Generator().manual_seed(1)
    body, pieces, _ = densenet_input(g, 2, (8, 8), (6, 6))
    x = torch.empty(2, 16, 6, 6).contiguous(memory_format=CL)
    before = pointwise_conv.Before(tuple(body), x, tuple(pieces), tuple(codegen.pointwise_operands(body, skip_first=True)))
    w = torch.randn(12, 16, 1, 1)
    out = torch.empty(2, 12, 6, 6).contiguous(memory_format=CL)
    assert pointwise_conv.fits(params(x, w, None), out, before)
    assert not pointwise_conv.fits(params(x, w, None), torch.empty(2, 12, 6, 6), before)  # a contiguous result
    assert not pointwise_conv.fits(params(x, torch.randn(12, 16, 3, 3), None), out, before)  # not 1x1
    strided = {**params(x, w, None), "stride": (2, 2)}
    assert not pointwise_conv.fits(strided, torch.empty(2, 12, 3, 3).contiguous(memory_format=CL), before)
    assert not pointwise_conv.fits(params(x.clone(), w, None), out, before)  # not the elementwise op's result
    assert not pointwise_conv.fits(params(x, w.double(), None), out, before)
    into_a_part = pieces[0].new_empty(0).set_(pieces[0].untyped_storage(), 0, (2, 12, 6, 6), out.stride())
    assert not pointwise_conv.fits(params(x, w, None), into_a_part, before)  # the result over a part it reads
    use_settings(pointwise_kernel=False)
    assert not pointwise_conv.fits(params(x, w, None), out, before)


@pytest.mark.parametrize("cols, widths", [(16, (32, 32)), (128, (128, 64)), (320, (128, 64)), (40, (64, 64))])
def test_a_call_times_two_tiles_the_wider_spanning_the_output_channels(cols, widths):
    got = pointwise_conv.tiles(1000, cols)
    assert [t[1] for t in got] == list(widths) and [t[0] for t in got] == [64, 32]
    assert all(t in pointwise_conv.TILES for t in got)


def test_an_input_across_more_than_2_to_the_31_elements_gets_64_bit_indices():
    x = torch.empty(2, 8, 4, 4, device="meta").contiguous(memory_format=CL)
    far = torch.empty_strided((2, 8, 4, 4), (2**31, 1, 32, 8), device="meta")
    w = torch.empty(6, 8, 1, 1, device="meta")
    out = torch.empty(2, 6, 4, 4, device="meta").contiguous(memory_format=CL)
    body = [("aten::cat.default", ([x], 1), ()), RELU]
    near = pointwise_conv.Before(tuple(body), x, (x,), ())
    assert "tl.int64" not in pointwise_conv.source([conv_node(x, w, None)], out, w, [], False, near)
    hash(near.signature())  # a call's key: every constant hashable (a cat's list of parts among them)
    wide = pointwise_conv.Before(tuple(body), x, (far,), ())
    assert "tl.program_id(0).to(tl.int64)" in pointwise_conv.source([conv_node(x, w, None)], out, w, [], False, wide)


@pytest.mark.parametrize("kernel", ["generated", "fails to build", "slower"])
def test_a_deferred_elementwise_op_and_its_1x1_reader_give_what_eager_does(kernel, monkeypatch):
    """The runtime's side of `pairs.input_pairs`: the elementwise op writes nothing; its reader
    applies its body as it loads (the generated kernel, here through the shim), or, where that
    fails to build or was timed slower, runs the elementwise op into its buffer first. Either way
    the result is eager's."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the CUDA paths, on the CPU
    monkeypatch.setattr(generated, "STATS", generated.KernelStats())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(pointwise_conv.timing, "on_stream", lambda device: contextlib.nullcontext())
    one_choice = [1.0] * len(pointwise_conv.tiles(40, 16)) + [100.0 if kernel != "slower" else 0.5]
    times = iter(one_choice * 2)
    monkeypatch.setattr(pointwise_conv.timing, "graph_us", lambda fn, device: next(times))
    if kernel == "fails to build":
        def refuse(source):
            raise RuntimeError("no Triton here")
        monkeypatch.setattr(generated, "define", refuse)
    else:
        monkeypatch.setattr(generated, "define", ShimKernel)
    monkeypatch.setattr(kernels.FusedKernel, "whole_on_cudnn", lambda self, body, out: None)  # no cuDNN here
    g = torch.Generator().manual_seed(2)
    before_body, pieces, x_want = densenet_input(g, 2, (32, 8), (4, 5))
    x = torch.full((2, 40, 4, 5), 7.0).contiguous(memory_format=CL)
    w, b = torch.randn(16, 40, 1, 1, generator=g), torch.randn(16, generator=g)
    out = torch.full((2, 16, 4, 5), 7.0).contiguous(memory_format=CL)
    body = [conv_node(x, w, b), RELU]
    producer, consumer = fused_kernel(1, before_body), fused_kernel(2, body)
    producer.deferred, consumer.reads_deferred = True, producer
    for call in range(2):  # the first call chooses (running the two apart for reference), the second runs
        x.fill_(7.0)
        out.fill_(7.0)
        assert producer([before_body], x) is x and producer.deferred_call is not None
        assert bool((x == 7.0).all())  # deferred: nothing written
        assert consumer([body], out) is out
        torch.testing.assert_close(out, F.relu(F.conv2d(x_want, w, b)), rtol=1e-4, atol=1e-4)
    wrote_input = not bool((x == 7.0).all())
    assert wrote_input is (kernel != "generated")
    assert (generated.STATS.fallbacks != []) is (kernel == "fails to build")


@pytest.mark.parametrize("kernel", ["generated", "fails to build", "slower"])
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("residual_kernels", [1, 2, "large map", "no temporary folder"])
def test_a_1x1_convolution_alone_runs_as_one_kernel_where_measured_faster(kernel, enabled, residual_kernels,
                                                                          monkeypatch, use_settings):
    """`FusedKernel._pointwise`: a 1x1 convolution whose body cuDNN does not fuse whole runs as
    the generated matrix product where it builds, agrees and was timed faster; else as before
    (here: the convolution, then the generated SiLU). Either way the result is eager's. conv ->
    relu, one cuDNN kernel by its pattern, is never a candidate; conv -> add -> relu is one only
    where its way was counted launching two (a split sum) on a map of at most
    `FUSED_CANDIDATE_ROWS` positions ("large map": 40 positions past a bound of 39, never counted).
    Where the count cannot be taken (no temporary folder for the capture's DOT file) the body is no
    candidate, and the load goes on."""
    counted = []
    if residual_kernels == "large map":
        use_settings(fused_candidate_rows=39)
    split = residual_kernels if isinstance(residual_kernels, int) else 2  # what counting would find

    def kernels_in(fn, device):
        counted.append(fn)
        if residual_kernels == "no temporary folder":
            raise PermissionError("[Errno 13] Permission denied: '/tmp/tmpx'")
        return split
    monkeypatch.setattr(kernels.timing, "kernels_in", kernels_in)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(generated, "STATS", generated.KernelStats())
    use_settings(standalone_pointwise=enabled)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(pointwise_conv.timing, "on_stream", lambda device: contextlib.nullcontext())
    one_choice = [1.0] * len(pointwise_conv.tiles(40, 16)) + [100.0 if kernel != "slower" else 0.5]
    times = iter(one_choice * 2)
    monkeypatch.setattr(pointwise_conv.timing, "graph_us", lambda fn, device: next(times))
    monkeypatch.setattr(generated, "define", ShimKernel)
    if kernel == "fails to build":
        def refuse(source, tile):
            raise RuntimeError("no Triton here")
        monkeypatch.setattr(pointwise_conv, "launcher", refuse)
    monkeypatch.setattr(kernels.FusedKernel, "whole_on_cudnn", lambda self, body, out: None)  # no cuDNN here
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 24, 4, 5, generator=g).contiguous(memory_format=CL)
    w, b = torch.randn(16, 24, 1, 1, generator=g), torch.randn(16, generator=g)
    z = torch.randn(2, 16, 4, 5, generator=g).contiguous(memory_format=CL)
    out = torch.full((2, 16, 4, 5), 7.0).contiguous(memory_format=CL)
    residual = [conv_node(x, w, b), ("aten::add.Tensor", (Local(0), z), ()), ("aten::relu.default", (Local(1),), ())]
    for body, want in (([conv_node(x, w, b), SILU], F.silu(F.conv2d(x, w, b))),
                       ([conv_node(x, w, b), RELU], F.relu(F.conv2d(x, w, b))),
                       (residual, F.relu(F.conv2d(x, w, b) + z))):
        op = fused_kernel(3, body)
        for call in range(2):  # the first call chooses, the second runs the choice
            out.fill_(7.0)
            assert op([body], out) is out
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        chosen = list(op._tiles._chosen.values())
        candidate = enabled and (body[1] is SILU or body is residual and residual_kernels == 2)
        assert (chosen != [] and chosen[0] is not None) is (candidate and kernel == "generated")
        assert (chosen != []) is candidate
    # only the residual body's way counted, once, on its first call, and only on a small map
    assert len(counted) == (enabled and residual_kernels != "large map")
    uncounted = [f for f in generated.STATS.fallbacks if "kernels not counted" in f]
    assert len(uncounted) == (enabled and residual_kernels == "no temporary folder")
    assert (len(generated.STATS.fallbacks) > len(uncounted)) is (kernel == "fails to build" and enabled)


class Dense(torch.nn.Module):
    """Two densenet layers and a transition: batch norm and ReLU over every feature map before,
    then a 1x1 convolution."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.norms = torch.nn.ModuleList(torch.nn.BatchNorm2d(c) for c in (16, 24, 32))
        self.squeeze = torch.nn.ModuleList(torch.nn.Conv2d(c, 32, 1, bias=False) for c in (16, 24))
        self.mid = torch.nn.ModuleList(torch.nn.BatchNorm2d(32) for _ in range(2))
        self.grow = torch.nn.ModuleList(torch.nn.Conv2d(32, 8, 3, padding=1, bias=False) for _ in range(2))
        self.transition = torch.nn.Conv2d(32, 16, 1, bias=False)
        for norm in [*self.norms, *self.mid]:
            torch.nn.init.uniform_(norm.running_mean, -1, 1)
            torch.nn.init.uniform_(norm.running_var, 0.5, 2)
            torch.nn.init.uniform_(norm.weight, 0.5, 2)
            torch.nn.init.uniform_(norm.bias, -1, 1)

    def forward(self, x):
        features = [self.stem(x)]
        for k in range(2):
            h = torch.cat(features, 1)
            h = self.squeeze[k](F.relu(self.norms[k](h)))
            features.append(self.grow[k](F.relu(self.mid[k](h))))
        t = self.transition(F.relu(self.norms[2](torch.cat(features, 1))))
        return F.avg_pool2d(t, 2)


class Excite(torch.nn.Module):
    """efficientnet's squeeze-and-excitation, then its 1x1 projection, as wide as the map."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 32, 3, padding=1)
        self.reduce, self.expand = torch.nn.Conv2d(32, 8, 1), torch.nn.Conv2d(8, 32, 1)
        self.project = torch.nn.Conv2d(32, 32, 1)

    def forward(self, x):
        y = F.silu(self.conv(x))
        scale = torch.sigmoid(self.expand(F.silu(self.reduce(y.mean((2, 3), keepdim=True)))))
        return F.max_pool2d(self.project(y * scale), 2) + 1.0  # no spatial mean: that would pair with the projection


def compiled(module, shape, tmp_path):
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    torch.manual_seed(0)
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.trace(module.eval(), torch.randn(*shape)), str(path))
    return compile_model(path, input_specs(["x".join(map(str, shape))]), device="cpu").artifact()


@pytest.mark.parametrize("module, pairs", [(Dense, 3), (Excite, 1)])
def test_the_plan_holds_the_elementwise_op_s_inputs_until_its_1x1_reader(module, pairs, tmp_path):
    from nimble.plan import memory
    from nimble.plan.verify import check_plan
    from nimble.runtime.pairs import held_by

    art = compiled(module(), (2, 3 if module is Dense else 8, 8, 8), tmp_path)
    found = memory.read_later(art.graph)
    assert len(found) == pairs
    for second, first in found.items():
        assert not fusion.leads_with_convolution(fusion.body_of(art.graph.ops[first]))
        assert set(art.graph.ops[first].refs()) <= set(memory.held_inputs(art.graph)[second])
    check_plan(art.graph, art.schedule, art.memory, held_by(art.graph, found))


def test_a_plan_that_frees_the_elementwise_op_s_inputs_at_it_fails_the_load_time_proof(tmp_path, monkeypatch):
    """A plan made without the rule (as before it) gives the projection's result the bytes of the
    map the scale reads, which dies at the scale: safe while the scale runs first, not where the
    projection reads the map itself, and the proof the executable runs says so."""
    from nimble.plan import memory
    from nimble.plan.verify import check_plan
    from nimble.runtime.pairs import held_by

    art = compiled(Excite(), (2, 8, 8, 8), tmp_path)
    found = memory.read_later(art.graph)
    monkeypatch.setattr(memory, "read_later", lambda graph, readers=None: {})
    older = memory.plan(art.graph, art.schedule)
    check_plan(art.graph, art.schedule, older)
    with pytest.raises(ValueError, match="overlap but may be live at once"):
        check_plan(art.graph, art.schedule, older, held_by(art.graph, found))


@pytest.mark.gpu
@pytest.mark.parametrize("module, shape, pairs", [(Dense, (2, 3, 9, 7), 3), (Excite, (3, 8, 7, 5), 1)])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_on_the_gpu_the_pairs_agree_with_eager_in_fewer_kernels(module, shape, pairs, layout, tmp_path,
                                                                 monkeypatch, use_settings):
    """With input pairs on and the kernel taken wherever it is correct (SLOWER raised: this test
    counts kernels, it does not time them), each pair runs as one kernel in channels_last, and the
    results agree with eager and with the run without pairs; in contiguous the kernel declines
    and the two ops run apart, in as many kernels as without pairs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.runtime import pairs as pairing
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(pointwise_slower=100.0)
    write_artifact(tmp_path / "m.nimble", compiled(module(), shape, tmp_path))
    art = read_artifact(tmp_path / "m.nimble")
    x = [t.cuda() for t in art.sample_inputs]
    outputs = {}
    for paired in (True, False):
        use_settings(input_pairs=paired)
        before = len(generated.STATS.fallbacks)
        exe = Executable(art, "cuda", choice=tuning.Choice(layout=layout, streams="serial"),
                         graph_dump=str(tmp_path / f"{paired}.dot"))
        assert len(exe._pairs.inputs) == (pairs if paired else 0)
        assert generated.STATS.fallbacks[before:] == []
        outputs[paired] = exe.run(*x)
        result = compare(outputs[paired], art.sample_outputs, rtol=1e-2, atol=1e-3)
        assert result.passed, result.describe()
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=1e-2, atol=1e-3)
    fewer = pairs if layout == "channels_last" else 0
    assert count_kernels(tmp_path / "True.dot") == count_kernels(tmp_path / "False.dot") - fewer


class Inverted(torch.nn.Module):
    """mobilenet's and efficientnet's 1x1 convolutions outside SE: an expansion with SiLU, a
    projection with the residual add; odd sizes."""

    def __init__(self):
        super().__init__()
        self.expand, self.project = torch.nn.Conv2d(12, 44, 1), torch.nn.Conv2d(44, 12, 1)

    def forward(self, x):
        return x + self.project(F.silu(self.expand(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_on_the_gpu_1x1_convolutions_alone_agree_with_eager_in_one_kernel_each(layout, tmp_path, monkeypatch, use_settings):
    """With the generated kernel taken wherever it is correct (SLOWER raised) and cuDNN's whole
    bodies off (so that each op otherwise takes a convolution and a generated kernel), both 1x1
    convolutions run as one kernel each in channels_last and agree with eager; in contiguous the
    kernel declines."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(pointwise_slower=100.0)
    monkeypatch.setattr(kernels.FusedKernel, "whole_on_cudnn", lambda self, body, out: None)
    write_artifact(tmp_path / "m.nimble", compiled(Inverted(), (3, 12, 9, 7), tmp_path))
    art = read_artifact(tmp_path / "m.nimble")
    x = [t.cuda() for t in art.sample_inputs]
    for alone in (True, False):
        use_settings(standalone_pointwise=alone)
        before = len(generated.STATS.fallbacks)
        exe = Executable(art, "cuda", choice=tuning.Choice(layout=layout, streams="serial"),
                         graph_dump=str(tmp_path / f"{alone}.dot"))
        assert generated.STATS.fallbacks[before:] == []
        result = compare(exe.run(*x), art.sample_outputs, rtol=1e-2, atol=1e-3)
        assert result.passed, result.describe()
        exe.close()
    alone, apart = count_kernels(tmp_path / "True.dot"), count_kernels(tmp_path / "False.dot")
    if layout == "channels_last":  # at least the two epilogue kernels go; the other choices timed at
        assert alone <= apart - 2  # load may take one more (2 against 5 once, under four test processes)
    else:
        assert alone == apart


@pytest.mark.gpu
def test_on_the_gpu_a_call_s_kernels_are_counted_from_its_capture():
    """`timing.kernels_in`, which decides whether a conv -> relu that cuDNN runs whole is a
    candidate: the kernel nodes of one captured call, which does not run the call."""
    from nimble.runtime.base import timing

    x = torch.zeros(64, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert timing.kernels_in(lambda: x.add_(1).mul_(3), x.device) == 2
        assert timing.kernels_in(lambda: x.add_(1), x.device) == 1
    assert [str(w.message) for w in caught if "cudaGraphDebugDotPrint" in str(w.message)] == []  # a load says nothing
    torch.cuda.synchronize()
    assert float(x.abs().max()) == 0.0


@pytest.mark.gpu
def test_on_the_gpu_rounded_tf32_operands_err_less_than_truncated_ones_and_no_more_than_cudnn():
    """On the GPU, with positive operands over 1024 input channels (where truncation's errors add
    up): against a float64 product, the kernel with `ROUND_TF32` errs less than half as much as
    without it, and at most twice as much as cuDNN's TF32 convolution."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(1, 1024, 14, 14, generator=g) + 0.5).contiguous(memory_format=CL).cuda()
    w = (torch.rand(256, 1024, 1, 1, generator=g) + 0.5).contiguous(memory_format=CL).cuda()
    exact = F.conv2d(x.double(), w.double())
    body = [conv_node(x, w, None), RELU]
    errors = {}
    allow = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        for rounded in (True, False):
            pointwise_conv.ROUND_TF32 = rounded
            out = torch.empty_like(exact, dtype=torch.float32).contiguous(memory_format=CL)
            run = pointwise_conv.launcher(generated.define(pointwise_conv.source(
                body, out, w, [], False, pointwise_conv.Before.alone(x), pointwise_conv.TILES[1])),
                pointwise_conv.TILES[1])
            run(out, w, [], pointwise_conv.Before.alone(x))
            errors[rounded] = float((out.double() - exact.relu()).abs().max())
        cudnn = float((F.conv2d(x, w).double().relu() - exact.relu()).abs().max())
    finally:
        pointwise_conv.ROUND_TF32 = True
        torch.backends.cudnn.allow_tf32 = allow
    assert errors[True] < errors[False] / 2, errors
    assert errors[True] <= 2 * cudnn, (errors, cudnn)
