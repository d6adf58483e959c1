"""The fusion passes and fused ops on the CPU: what fuses, that fused graphs compute what the
unfused ones do (hypothesis-generated elementwise chains included), that a fused body is checked
when read, and that the generated kernels' index arithmetic addresses the right elements."""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nimble.errors import ArtifactError, GraphError
from nimble.formats import read_artifact
from nimble.formats.artifact import encode
from nimble.frontend import quiet_torchscript
from nimble.ir import Local, Op, Ref
from nimble.ops import fusion
from nimble.pipeline import CompileOptions, compile_model, compile_script
from nimble.runtime.placed import reference
from nimble.runtime.kernels.codegen import _expr, elementwise_source, strided_offset
from nimble.specs import input_specs

from ..conftest import SAMPLES
from ..forge import edit_json


def targets(graph) -> list[str]:
    return [op.target for op in graph.ops]


@pytest.fixture(scope="module")
def resnet():
    return {fuse: compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu", fuse=fuse)
            for fuse in (False, True)}


def test_convolutions_fuse_with_bias_residual_add_and_relu(resnet):
    plain, fused = resnet[False].graph, resnet[True].graph
    patterns = sorted(str(fusion.convolution_pattern(fusion.body_of(op))) for op in fused.ops
                      if op.target == fusion.FUSED)
    assert patterns.count("add_relu") == 4 and patterns.count("relu") == 5
    assert targets(fused).count("aten::relu.default") == 0 and targets(plain).count("aten::relu.default") == 9
    assert len(fused.ops) == len(plain.ops) - 13
    x = resnet[True].sample_inputs
    for got, want in zip(reference.run(fused, resnet[True].weights, x), reference.run(plain, resnet[False].weights, x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fusion_keeps_artifacts_byte_identical(tmp_path):
    a = compile_model(SAMPLES / "mobilenet.pt", input_specs(["1x3x32x32"]), device="cpu")
    b = compile_model(SAMPLES / "mobilenet.pt", input_specs(["1x3x32x32"]), device="cpu")
    assert any(op.target == fusion.FUSED for op in a.graph.ops)
    assert encode(a.artifact()) == encode(b.artifact())


UNARY = {
    "relu": F.relu, "relu6": F.relu6, "sigmoid": torch.sigmoid, "silu": F.silu, "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid, "tanh": torch.tanh, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "leaky": lambda x: F.leaky_relu(x, 0.1), "clamp": lambda x: torch.clamp(x, -0.5, 0.7), "neg": torch.neg,
    "exp_small": lambda x: torch.exp(x * 0.1), "abs": torch.abs, "erf": torch.erf, "scale": lambda x: x * 1.5 - 0.25,
}
BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "max": torch.maximum,
          "div": lambda a, b: a / (b.abs() + 1.0)}


class Chain(nn.Module):
    """A random tree of elementwise ops over a convolution's output, a per-channel tensor (SE-like
    broadcast) and the input."""

    def __init__(self, steps):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.scale = nn.Conv2d(4, 4, 1)
        self.steps = steps

    def forward(self, x):
        y = self.conv(x)
        s = self.scale(x.mean((2, 3), keepdim=True))
        values = [y]
        for kind, name, other in self.steps:
            a = values[-1]
            if kind == "unary":
                values.append(UNARY[name](a))
            else:
                b = (x, s, values[0])[other]
                values.append(BINARY[name](a, b))
        return values[-1]


SE_LIKE = [("unary", "silu", 0), ("binary", "mul", 1), ("unary", "hardswish", 0), ("binary", "add", 2)]
step = st.one_of(st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY)), st.just(0)),
                 st.tuples(st.just("binary"), st.sampled_from(sorted(BINARY)), st.integers(0, 2)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=8))
@example(SE_LIKE)
def test_generated_chains_match_the_unfused_reference(steps):
    torch.manual_seed(0)
    module = Chain(steps).eval()
    x = torch.randn(2, 4, 6, 5)
    with quiet_torchscript():
        traced = torch.jit.trace(module, (x,))
    runs = {fuse: compile_script(traced, input_specs(["2x4x6x5"]), "chain", "chain.pt", "0" * 64,
                                 CompileOptions(device="cpu", fuse=fuse)) for fuse in (False, True)}
    assert len(runs[True].graph.ops) <= len(runs[False].graph.ops)
    if steps == SE_LIKE:
        assert any(op.target == fusion.FUSED for op in runs[True].graph.ops)
    got = reference.run(runs[True].graph, runs[True].weights, [x])
    want = reference.run(runs[False].graph, runs[False].weights, [x])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)

class SqueezeExcite(nn.Module):
    """efficientnet_b0's block: the SiLU result is read by the pooling and by the multiply, and the
    scale comes from a convolution smaller than the product."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(4, 8, 3, padding=1)
        self.reduce = nn.Conv2d(8, 2, 1)
        self.restore = nn.Conv2d(2, 8, 1)
        self.project = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = F.silu(self.expand(x))
        scale = torch.sigmoid(self.restore(F.silu(self.reduce(F.adaptive_avg_pool2d(y, 1)))))
        return self.project(y * scale), y + y  # y + y: alone, and it broadcasts nothing


def compile_both(module: nn.Module, shape: tuple[int, ...], name: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(shape)
    with quiet_torchscript():
        traced = torch.jit.trace(module.eval(), (x,))
    runs = {fuse: compile_script(traced, input_specs(["x".join(map(str, shape))]), name, f"{name}.pt", "0" * 64,
                                 CompileOptions(device="cpu", fuse=fuse)) for fuse in (False, True)}
    got = reference.run(runs[True].graph, runs[True].weights, [x])
    want = reference.run(runs[False].graph, runs[False].weights, [x])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    return runs


def bodies_of(op) -> list[str]:
    return [node[0] for node in fusion.body_of(op)] if op.target == fusion.FUSED else []


def bodies(graph) -> list[list[str]]:
    return [bodies_of(op) for op in graph.ops if op.target == fusion.FUSED]


def test_the_excitation_scale_is_computed_in_the_multiply_and_its_convolution_runs_alone():
    runs = compile_both(SqueezeExcite(), (2, 4, 9, 7), "se")
    conv = "aten::convolution.default"
    assert sorted(bodies(runs[True].graph)) == sorted([
        [conv, "aten::silu.default"],  # expand
        [conv, "aten::silu.default"],  # reduce, on the pooled map
        [conv],  # restore, its bias moved (`bias_into_broadcast`)
        ["aten::add.Tensor", "aten::sigmoid.default", "aten::mul.Tensor"],  # its bias, the sigmoid, the multiply
        [conv],  # project (`fuse_lone_convolutions`)
    ])
    graph = runs[True].graph
    restore = next(op for op in graph.ops
                   if bodies_of(op) == [conv] and graph.values[op.outputs[0]].spec.shape[2:] == (1, 1))
    assert fusion.body_of(restore)[0][1][2] is None
    moved = [v for v in graph.values if v.name == "restore.bias.broadcast"]
    assert [v.spec.shape for v in moved] == [(1, 8, 1, 1)] and "restore.bias" not in runs[True].weights
    assert targets(graph).count("aten::add.Tensor") == 1  # y + y alone: it broadcasts nothing


class BroadcastReaders(nn.Module):
    """A scale from a pooling (no convolution), and two convolutions whose small results are read
    by something other than one larger elementwise op: all keep their bias."""

    def __init__(self):
        super().__init__()
        self.restore = nn.Conv2d(4, 4, 1)
        self.twice = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        pooled = F.adaptive_avg_pool2d(x, 1)
        same = torch.sigmoid(self.restore(pooled)) + pooled  # read by an op of its own shape
        s = torch.sigmoid(self.twice(pooled))
        return x * pooled, same, x * s + s.mean()  # s read twice


def test_a_lone_broadcasting_multiply_becomes_a_generated_op_and_other_biases_stay():
    runs = compile_both(BroadcastReaders(), (2, 4, 5, 3), "readers")
    assert not any(v.name.endswith(".broadcast") for v in runs[True].graph.values)
    assert ["aten::mul.Tensor"] in bodies(runs[True].graph)  # x * pooled, alone and generated
    assert "aten::mul.Tensor" in targets(runs[False].graph)

def test_a_cat_leads_the_elementwise_op_that_alone_reads_it():
    """densenet's layers: the cat and the batch norm and ReLU after it become one body led by the
    cat (`fuse_concats`), whose parts are the fused op's inputs; a cat with two readers stays."""
    from ..models import DenseBlock

    runs = compile_both(DenseBlock(), (2, 5, 7, 9), "dense")
    graph = runs[True].graph
    led = [op for op in graph.ops if bodies_of(op)[:1] == ["aten::cat.default"]]
    assert len(led) == 4 and targets(graph).count("aten::cat.default") == 1  # `twice` is read twice
    parts = [len(fusion.body_of(op)[0][1][0]) for op in led]
    assert parts == [1, 2, 3, 4]
    for op in led:
        assert bodies_of(op)[1:] and all(t in fusion.POINTWISE for t in bodies_of(op)[1:])
        assert {graph.values[r.id].spec.shape[1] for r in fusion.body_of(op)[0][1][0]} <= {3, 5}
        assert fusion.body_of(op)[0][1][1] == 1


class ClassToken(nn.Module):
    """vit's class token, expanded over the batch (a stride of 0), joined to the patches."""

    def __init__(self):
        super().__init__()
        self.token, self.position = nn.Parameter(torch.randn(1, 1, 6)), nn.Parameter(torch.randn(1, 5, 6))

    def forward(self, x):
        rows = torch.relu(x)  # an activation of its own
        return torch.cat([self.token.expand(x.shape[0], -1, -1), rows], 1) + self.position


def test_a_cat_of_a_part_that_is_a_view_stays_a_cat():
    """A part that is not a dense activation of its own (the expanded token) could be laid out
    otherwise than the result at load: `fuse_concats` leaves the cat alone."""
    runs = compile_both(ClassToken(), (3, 4, 6), "token")
    assert "aten::cat.default" in targets(runs[True].graph)
    assert not any(bodies_of(op)[:1] == ["aten::cat.default"] for op in runs[True].graph.ops)


@pytest.mark.parametrize("body, problem", [
    ((("aten::relu.default", (Ref(0),), ()), ("aten::cat.default", ((Ref(0),), 1), ())), "may only lead"),
    ((("aten::cat.default", ((Ref(0), 2.0), 1), ()), ("aten::relu.default", (Local(0),), ())), "graph values"),
    ((("aten::cat.default", ((Ref(0),), 1, 2), ()), ("aten::relu.default", (Local(0),), ())), "positionally"),
    ((("aten::cat.default", ((Ref(0),), 99), ()), ("aten::relu.default", (Local(0),), ())), "positionally"),
    ((("aten::cat.default", ((Ref(0),) * (fusion.MAX_PIECES + 1), 1), ()), ("aten::relu.default", (Local(0),), ())),
     "joins 1 to"),
    ((("aten::cat.default", ((Local(0),), 1), ()), ("aten::relu.default", (Local(0),), ())), "not an earlier node"),
])
def test_a_forged_cat_led_body_is_refused(body, problem):
    with pytest.raises(GraphError, match=problem):
        fusion.check(Op(0, fusion.FUSED, (body,), (), (1,), (), (), ""))


@pytest.mark.parametrize("reverse", [False, True])
def test_a_padding_mask_spread_by_ranges_is_a_view_and_its_booleans_fuse_into_the_selection(reverse):
    """`index_as_view`: indexing by constant ranges in order is a view (indexing the keys
    backwards stays a gather); `fuse_pointwise`: the and of booleans, the selection between 0 and
    -inf and the add of the scores are one fused op, whose result is the only floating one."""
    from ..models import PaddingMask

    scores, mask = torch.randn(3, 1, 7, 7), (torch.rand(3, 7) > 0.3).long()
    with quiet_torchscript():
        traced = torch.jit.trace(PaddingMask(reverse).eval(), (scores, mask))
    specs = input_specs(["3x1x7x7", "3x7"], ["float32", "int64"])
    c = compile_script(traced, specs, "mask", "mask.pt", "0" * 64, CompileOptions(device="cpu"))
    got = reference.run(c.graph, c.weights, [scores, mask])
    torch.testing.assert_close(got[0], PaddingMask(reverse)(scores, mask), rtol=0, atol=0)
    assert ("aten::index.Tensor" in targets(c.graph)) == reverse
    assert ["aten::__and__.Tensor", "aten::where.Scalar", "aten::add.Tensor"] in bodies(c.graph), bodies(c.graph)


def test_every_fusible_op_has_a_kernel_expression():
    for target, (slots, _, _) in fusion.SIGNATURES.items():
        args = ["t" if kind == "tensor" else 2.0 if kind == "number" else None for kind in slots]
        code = _expr(target, ["a", "b", "c"], args, {})
        ast.parse(code)  # a Python expression over a, b and c


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False), st.booleans())
def test_kernel_offsets_address_each_element(shape, rnd, broadcast):
    """The offset expression of a kernel, evaluated for every index, lands on the element the
    output's memory order puts there, for permuted outputs and broadcast operands."""
    shape = tuple(shape)
    perm = list(range(len(shape)))
    rnd.shuffle(perm)
    out = torch.empty([shape[p] for p in perm]).permute([perm.index(d) for d in range(len(shape))])
    operand_shape = tuple(1 if broadcast and rnd.random() < 0.5 else n for n in shape)
    operand = torch.empty(operand_shape).expand(shape)
    order = sorted(range(out.dim()), key=lambda d: (-out.stride(d), d))
    for tensor in (out, operand):
        expr = strided_offset(shape, tensor.stride(), order, dense=False)
        coords = torch.stack(torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, len(shape))
        for coord in coords.tolist():
            i = sum(coord[d] * out.stride(d) for d in range(len(shape)))  # the out element's position
            want = sum(coord[d] * tensor.stride(d) for d in range(len(shape)))
            assert eval(expr, {"i": i}) == want


def test_kernel_source_is_python_naming_each_operand():
    out = torch.empty(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    bias, other = torch.empty(1, 3, 1, 1), torch.empty(2, 3, 4, 4)
    body = [("aten::add.Tensor", (Local(0), other), ()), ("aten::silu.default", (Local(1),), ())]
    source = elementwise_source([("aten::conv2d.default", (), ())] + body, out, [other, bias], leads=True, bias=True)
    ast.parse(source)
    assert "in1_ptr" in source and "v2 = (v1 * tl.sigmoid(v1))" in source


@pytest.fixture(scope="module")
def fused_blob():
    c = compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu")
    return encode(c.artifact())


def first_fused(doc) -> dict:
    return next(op for op in doc["ops"] if op["target"] == fusion.FUSED)


@pytest.mark.parametrize("edit,match", [
    (lambda op: op["args"][0][1].__setitem__(0, "aten::linear.default"), "not an op a fused body may hold"),
    (lambda op: op["args"][0][1].__setitem__(0, "aten::cat.default"), "a cat may only lead"),
    (lambda op: op["args"][0][1].__setitem__(0, "aten::convolution.default"), "may only lead"),
    (lambda op: op["args"][0][1].__setitem__(1, [{"local": 3}]), "not an earlier node"),
    (lambda op: op["args"][0].__setitem__(0, ["aten::relu.default", [{"local": 0}], []]), "not an earlier node"),
    (lambda op: op["args"].append(1), "malformed"),
    (lambda op: op["args"][0].clear(), "0 body nodes"),
    (lambda op: op["args"][0][1].__setitem__(1, []), "positional arguments"),  # an IndexError once
    (lambda op: op["args"][0][1][1].append("extra"), "positional arguments"),
    (lambda op: op["args"][0][1].__setitem__(1, [{"local": 10**9}]), "not a body node"),
])
def test_a_forged_body_is_refused_in_one_line(fused_blob, tmp_path, edit, match):
    """Each refused before anything runs, the schema checks included (`fusion.SIGNATURES`)."""
    path = tmp_path / "a.nimble"
    path.write_bytes(edit_json(fused_blob, "graph.json", lambda doc: edit(first_fused(doc))))
    with pytest.raises(ArtifactError, match=match) as info:
        read_artifact(path)
    assert "\n" not in str(info.value)


def test_fused_bodies_hold_a_bounded_number_of_nodes_in_all(fused_blob, tmp_path, monkeypatch):
    path = tmp_path / "a.nimble"
    path.write_bytes(fused_blob)
    read_artifact(path)
    monkeypatch.setenv("NIMBLE_MAX_BODY_NODES", "2")
    with pytest.raises(ArtifactError, match="more than 2 body nodes in all"):
        read_artifact(path)
