"""Reduced precision (`passes/reduce_precision.py`, `precision.py`, `compile --precision`): which
ops compute in which dtype, what the weights are stored as, that the reduced graph stays close to
float32, and that the search keeps what a tolerance needs and no more. Each graph is run by the
reference executor on the CPU and compared with the float32 graph."""

import json

import pytest
import torch
from torch import nn

from nimble import frontend
from nimble.errors import MismatchError
from nimble.formats import read_artifact
from nimble.ir import ACTIVATION, WEIGHT, TensorSpec
from nimble.ops import targets
from nimble.passes.reduce_precision import FP32_OPS, Precision, _follows, convert, short_target
from nimble.pipeline import compile_model, rewrite, sample_inputs
from nimble.runtime.placed import reference
from nimble.runtime.base.compare import relative_l2
from nimble.specs import input_specs

from ..conftest import save_script
from ..cli.test_cli import invoke, one_line_error

SAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "sample_models"


def lowered(path, specs):
    return rewrite(frontend.lower(frontend.load_module(path), specs, path.stem))


class Tiny(nn.Module):
    """Values far below float16's smallest normal number in the middle, scaled back at the end:
    float16 loses them, float32 and bfloat16 do not."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        y = torch.relu(self.conv(x)) * 1e-9
        y = torch.sigmoid(y * 1e9) * 1e-9
        return self.head(y.flatten(1)) * 1e9


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ops_compute_in_the_reduced_dtype_but_the_float32_list_and_weights_halve(dtype):
    low = lowered(SAMPLES / "bert.pt", [TensorSpec((1, 16), "int64")] * 2)
    c = convert(low.graph, low.weights, Precision(dtype))
    g = c.graph
    for op in g.ops:
        floats = [g.values[o].spec.dtype for o in op.outputs if g.values[o].spec.dtype in ("float32", dtype)]
        if not floats or op.target == "aten::_to_copy.default":
            continue
        if _follows(targets.resolve(op.target)._schema):  # views, cat, pooling: as their input comes
            want = g.values[op.refs()[0]].spec.dtype
        else:
            want = "float32" if short_target(op.target) in FP32_OPS else dtype
        assert floats == [want] * len(floats), (op.target, floats)
        if want == "float32":  # its floating inputs were cast up
            assert all(g.values[r].spec.dtype != dtype for r in op.refs()), op.target
    # 5 layer norms (the softmaxes are inside scaled_dot_product_attention, which computes in the reduced dtype)
    assert sum(short_target(op.target) in FP32_OPS for op in g.ops) == len(c.fp32) == 5
    assert all(why == "policy" for why in c.fp32.values())
    kept_fp32 = []
    for name, w in c.weights.items():  # every name is the model's; integer weights stay as they were
        orig = low.weights[name]
        assert w.shape == orig.shape and torch.equal(w.to(orig.dtype), orig.to(w.dtype).to(orig.dtype))
        if orig.dtype != torch.float32:
            assert w.dtype == orig.dtype
        elif w.dtype == torch.float32:
            kept_fp32.append(name)
        else:
            assert w.dtype == getattr(torch, dtype)
    readers = {g.values[r].name for op in g.ops if "layer_norm" in op.target for r in op.refs()}
    assert kept_fp32 and set(kept_fp32) <= readers  # only the layer norms' weights stay float32
    # inputs (int64) and outputs keep the model's dtypes and names
    assert [g.values[i].spec.dtype for i in g.inputs] == ["int64", "int64"]
    assert [g.values[o].spec.dtype for o in g.outputs] == ["float32", "float32"]
    assert [g.values[o].name for o in g.outputs] == [low.graph.values[o].name for o in low.graph.outputs]
    xs = sample_inputs([low.graph.values[i].spec for i in low.graph.inputs])
    want, got = reference.run(low.graph, low.weights, xs), reference.run(g, c.weights, xs)
    assert all(relative_l2(a, b) < (2e-3 if dtype == "float16" else 2e-2) for a, b in zip(got, want))


def test_batch_norm_keeps_its_statistics_in_float32_and_views_add_no_casts(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):  # a batch norm no convolution precedes: it stays a batch norm
            return self.conv(torch.relu(self.bn(x))).flatten(1).transpose(0, 1)

    net = Net().eval()
    with torch.no_grad():
        net.bn.running_var.uniform_(0.5, 2.0)
    path = save_script(tmp_path, net, "bn")  # as lowered, before affine_batch_norm makes it a multiply-add
    low = frontend.lower(frontend.load_module(path), [TensorSpec((2, 3, 8, 8), "float32")], "bn")
    c = convert(low.graph, low.weights, Precision("float16", io="reduced"))
    g = c.graph
    bn = next(op for op in g.ops if "batch_norm" in op.target)
    stats = [g.values[r] for r in list(bn.refs())[1:]]
    assert [v.kind for v in stats] == [WEIGHT] * 4 and {v.spec.dtype for v in stats} == {"float32"}
    assert g.values[bn.outputs[0]].spec.dtype == "float16"
    assert [g.values[i].spec.dtype for i in g.inputs] == ["float16"]  # --io-dtype reduced
    assert [g.values[o].spec.dtype for o in g.outputs] == ["float16"]
    assert sum(op.target == "aten::_to_copy.default" for op in g.ops) == 0  # all float16 from the input on
    views = [v for v in g.values if v.kind == ACTIVATION and v.alias_of is not None]
    assert views and all(v.spec.dtype == "float16" for v in views)
    x = torch.randn(2, 3, 8, 8)
    got = reference.run(g, c.weights, [x.half()])[0]
    assert relative_l2(got, net(x).detach()) < 2e-3


def test_a_kept_op_computes_in_float32_and_the_next_one_casts_back(tmp_path):
    low = lowered(SAMPLES / "resnet.pt", [TensorSpec((1, 3, 32, 32), "float32")])
    conv = next(op.id for op in low.graph.ops if "convolution" in op.target)
    c = convert(low.graph, low.weights, Precision("float16", keep=frozenset({conv})))
    assert c.fp32 == {conv: "kept"}
    new = c.graph.values[c.value_of[low.graph.ops[conv].outputs[0]]]
    assert new.spec.dtype == "float32"
    reads = [op for op in c.graph.ops if new.id in op.refs()]
    assert [op.target for op in reads] == ["aten::_to_copy.default"]  # one cast, shared by every reader


def test_float16_that_loses_small_values_names_the_op_and_the_search_keeps_them(tmp_path):
    path = save_script(tmp_path, Tiny().eval(), "tiny")
    specs = input_specs(["2x3x6x6"])
    with pytest.raises(MismatchError) as e:
        compile_model(path, specs, device="cpu", precision="fp16")
    text = str(e.value)
    assert "first op to lose accuracy is mul_" in text and "smallest normal number" in text, text
    assert "--precision bf16" in text and "--tolerance" in text and "\n" not in text
    found = compile_model(path, specs, device="cpu", precision="fp16", tolerance=1e-2)
    record = found.precision
    kept = [o for o in record["fp32_ops"] if o["why"] == "kept"]
    assert record["searched"] and 0 < len(kept) < record["floating_ops"], record
    assert found.check.passed and max(found.check.rel_l2) <= 1e-2 and found.check.l2 == 1e-2
    # bfloat16 has float32's range: nothing to keep
    assert compile_model(path, specs, device="cpu", precision="bf16").check.passed


def test_the_artifact_records_its_precision_and_run_check_holds_it(tmp_path):
    out = tmp_path / "r16.nimble"
    result = invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--precision", "fp16", "--device", "cpu",
                    "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["precision"]["dtype"] == "float16" and doc["check"]["rel_l2_tolerance"] == 1e-2
    art = read_artifact(out)
    assert art.precision == doc["precision"] and art.precision["io"] == "model"
    assert {art.weights[n].dtype for n in art.weights} == {torch.float16}
    assert art.sample_inputs[0].dtype == art.sample_outputs[0].dtype == torch.float32
    fp32 = compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu")
    assert art.memory.arena_bytes < fp32.memory.arena_bytes
    shown = invoke("inspect", out)
    assert shown.exit_code == 0 and "float16 (inputs and outputs float32)" in shown.stdout
    checked = invoke("run", out, "--check", "--device", "cpu", "--json")
    assert checked.exit_code == 0, checked.stderr
    assert json.loads(checked.stdout)["check"]["rel_l2_tolerance"] == 1e-2
    strict = invoke("run", out, "--check", "--device", "cpu", "--rtol", "1e-9")  # --rtol: the L2 tolerance
    assert "--rtol" in one_line_error(strict, 3)


@pytest.mark.parametrize("args, words", [
    (["--tolerance", "1e-2"], "go with --precision fp16 or bf16"),
    (["--precision", "fp8"], "use fp32, fp16 or bf16"),
    (["--precision", "fp16", "--io-dtype", "half"], "use model"),
    (["--precision", "fp16", "--tolerance", "2"], "between 0 and 1"),
])
def test_precision_options_are_refused_in_one_line(tmp_path, args, words):
    result = invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "-o", tmp_path / "x.nimble", *args)
    assert words in one_line_error(result, 2)
    assert not (tmp_path / "x.nimble").exists()


@pytest.mark.parametrize("edit", [
    lambda p: p.update(dtype="float8_e4m3fn"),
    lambda p: p.update(tolerance=float("1e300") * 10),
    lambda p: p.update(tolerance=-1),
    lambda p: p["fp32_ops"].append({"op": "x", "target": "aten::relu.default", "source": "", "why": "because"}),
    lambda p: p["fp32_ops"].append("softmax_3"),
    lambda p: p.update(extra=1),
    lambda p: p.pop("io"),
])
def test_a_malformed_precision_record_is_refused(tmp_path, edit):
    from nimble.errors import ArtifactError
    from nimble.formats import write_artifact

    from ..forge import rebuild

    compiled = compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu", precision="bf16")
    good = tmp_path / "good.nimble"
    write_artifact(good, compiled.artifact())

    def forge(manifest):
        edit(manifest["precision"])

    bad = tmp_path / "bad.nimble"
    bad.write_bytes(rebuild(good.read_bytes(), {}, manifest_edit=forge))
    with pytest.raises(ArtifactError, match="precision"):
        read_artifact(bad)
    assert read_artifact(good).precision["dtype"] == "bfloat16"


def test_the_python_api_prepares_in_bfloat16_and_checks_against_float32():
    import nimble

    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    fast = nimble.Nimble(net).prepare(x, precision="bf16", tolerance=5e-2)
    record = fast._compiled.precision
    assert record["dtype"] == "bfloat16" and record["io"] == "model"
    with torch.no_grad():
        want = net(x)
    got = fast(x)
    assert got.dtype == torch.float32 and 0 < relative_l2(got, want) <= 5e-2
    with pytest.raises(nimble.UsageError, match="inference"):
        nimble.Nimble(net).prepare(x, training=True, precision="fp16")
    with pytest.raises(MismatchError, match="first op to lose accuracy"):
        nimble.Nimble(Tiny().eval()).prepare(torch.randn(2, 3, 6, 6), precision="fp16")


def test_outputs_float16_cannot_hold_are_measured_as_handed_out(tmp_path):
    """With --io-dtype reduced the outputs themselves are float16: a search cannot keep them in
    float32, so the compile says to hand them out in float32 instead."""
    class Huge(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 1e6

    path = save_script(tmp_path, Huge().eval(), "huge")
    with pytest.raises(MismatchError, match="--io-dtype model"):
        compile_model(path, input_specs(["4x8"]), device="cpu", precision="fp16", io_dtype="reduced", tolerance=1e-2)
    assert compile_model(path, input_specs(["4x8"]), device="cpu", precision="fp16", tolerance=1e-2).check.passed


class NormBetweenGemms(nn.Module):
    """GPT-2's shape in small: a residual sum, its layer norm, a GEMM, and pow in a GELU; `tap`
    also returns the layer norm's result (a float32 graph output at --io-dtype model)."""

    def __init__(self, tap: bool = False):
        super().__init__()
        self.tap = tap
        self.up, self.down, self.norm = nn.Linear(32, 64), nn.Linear(64, 32), nn.LayerNorm(32)

    def forward(self, x):
        y = self.norm(x + 1.0)
        h = self.up(y)
        h = 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0))))
        out = self.down(h)
        return (out, y) if self.tap else out


def _traced(tmp_path, model):
    path = tmp_path / "n.pt"
    torch.jit.save(torch.jit.trace(model, torch.randn(4, 8, 32)), str(path))
    return path


def _casts_around(graph, op) -> list[str]:
    """The casts next to `op`: the producer of its input, and its readers."""
    producer = graph.values[op.args[0].id].producer
    near = [graph.ops[producer]] if producer is not None else []
    near += [o for o in graph.ops if op.outputs[0] in o.refs()]
    return [o.target for o in near if o.target == "aten::_to_copy.default"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_layer_norm_and_pow_read_and_write_the_reduced_dtype_without_casts(tmp_path, dtype):
    model = NormBetweenGemms().eval()
    path = _traced(tmp_path, model)
    c = compile_model(path, [TensorSpec((4, 8, 32), "float32")], device="cpu", precision=dtype, io_dtype="reduced",
                      tolerance=1e-2)
    g = c.graph
    low = {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    [norm] = [op for op in g.ops if op.target == "aten::layer_norm.default"]
    assert g.values[norm.outputs[0]].spec.dtype == low and _casts_around(g, norm) == []
    assert [g.values[a.id].spec.dtype for a in norm.args[2:4]] == [low, low]  # CUDA's layer norm wants them so
    assert [op.target for op in g.ops].count("aten::_to_copy.default") == 0, [op.target for op in g.ops]
    assert any(name == "drop_precision_casts" and n < dict(c.passes)["reduce_precision"] for name, n in c.passes)


def test_a_float32_result_something_else_reads_keeps_its_casts(tmp_path):
    model = NormBetweenGemms(tap=True).eval()
    path = _traced(tmp_path, model)
    c = compile_model(path, [TensorSpec((4, 8, 32), "float32")], device="cpu", precision="fp16", tolerance=1e-2)
    g = c.graph
    [norm] = [op for op in g.ops if op.target == "aten::layer_norm.default"]
    assert g.values[norm.outputs[0]].spec.dtype == "float32"  # the graph returns it in float32
    assert _casts_around(g, norm)
