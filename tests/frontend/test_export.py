"""The torch.export frontend: `.pt2` programs compile to the same op graphs as TorchScript, bring
their own shapes, and a crafted archive cannot run code."""

import io
import os
import zipfile

import pytest
import torch
from torch import nn

from nimble.errors import ModelError, UnsupportedError
from nimble.pipeline import compile_model
from nimble.specs import input_specs

from .. import models
from ..conftest import MODELS, SAMPLES
from ..cli.test_cli import invoke, one_line_error


def export(tmp_path, module: nn.Module, example: tuple, name: str = "model", **kwargs):
    path = tmp_path / f"{name}.pt2"
    torch.export.save(torch.export.export(module.eval(), example, **kwargs), str(path))
    return path


def op_kinds(graph) -> dict[str, int]:
    """Ops by kind up to naming, by the sweep's own rule (benchmarks/zoo.py)."""
    from benchmarks.zoo import op_kinds as by_kind

    return by_kind([op.target for op in graph.ops])


@pytest.mark.parametrize("fuse", [False, True])
def test_samples_compile_from_pt2_to_the_graph_torchscript_gives(sample, fuse, tmp_path):
    from sample_models.build import build_module

    name, path, shapes = sample
    program = export(tmp_path, build_module(name), tuple(torch.randn(s) for s in shapes), name)
    script = compile_model(path, input_specs(["x".join(map(str, s)) for s in shapes]), device="cpu", fuse=fuse)
    exported = compile_model(program, None, device="cpu", fuse=fuse)
    assert exported.check.passed
    # vit: a trace records nn.MultiheadAttention's fused fast path, export its general path in ~25
    # ops; the export frontend lowers that block whole, to the ops the fast path stands for
    assert op_kinds(exported.graph) == op_kinds(script.graph)
    assert exported.memory.arena_bytes == script.memory.arena_bytes
    assert exported.options["frontend"] == "torch.export" and script.options["frontend"] == "torchscript"


def test_batch_norm_folds_into_the_convolution_and_in_place_relu_becomes_functional(tmp_path):
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
    with torch.no_grad():
        module[1].running_mean.uniform_(-1, 1)
        module[1].running_var.uniform_(0.5, 2)
    path = export(tmp_path, module, (torch.randn(1, 3, 8, 8),))
    c = compile_model(path, None, device="cpu", fuse=False)
    assert [op.target for op in c.graph.ops] == ["aten::convolution.default", "aten::relu.default"]
    assert sorted(c.weights) == ["0.bias_fused_bn", "0.weight_fused_bn"]
    assert c.check.passed


def test_cli_compiles_and_runs_a_pt2_without_shapes(tmp_path):
    from sample_models.build import build_module

    path = export(tmp_path, build_module("two_io"), (torch.randn(1, 3, 64, 64), torch.randn(1, 8)))
    result = invoke("compile", path, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "model.nimble").is_file()
    assert invoke("run", tmp_path / "model.nimble", "--check", "--device", "cpu").exit_code == 0


def evil_pickle() -> bytes:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {MARK}",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    return buf.getvalue()


MARK = "/tmp/nimble-test-export-pwned"


def test_a_pickle_that_would_run_code_is_refused_and_never_run(tmp_path):
    path = export(tmp_path, nn.Linear(4, 2), (torch.randn(1, 4),))
    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as out:
        pickles = [n for n in src.namelist() if n.endswith("sample_inputs/model.pt")]
        assert pickles, src.namelist()
        for name in src.namelist():
            out.writestr(name, evil_pickle() if name in pickles else src.read(name))
    if os.path.exists(MARK):
        os.remove(MARK)
    line = one_line_error(invoke("compile", evil, "--device", "cpu"), 1)
    assert "holds a pickle with objects other than tensors" in line
    assert not os.path.exists(MARK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt2", "model.pt2"]


def test_dynamic_dimensions_need_a_shape_and_static_ones_must_match(tmp_path):
    batch = torch.export.Dim("batch", min=2, max=16)
    path = export(tmp_path, nn.Linear(4, 2), (torch.randn(3, 4),), dynamic_shapes={"input": {0: batch}})
    line = one_line_error(invoke("compile", path, "--device", "cpu"), 2)  # a missing --shape: usage
    assert "dimension 0 of input" in line and "dynamic" in line and "--shape" in line
    assert invoke("compile", path, "--device", "cpu", "--shape", "8x4").exit_code == 0
    line = one_line_error(invoke("compile", path, "--device", "cpu", "--shape", "8x5"), 1)
    assert "exported as ?x4" in line


def test_an_unsupported_op_names_the_op_and_the_model_line(tmp_path):
    path = export(tmp_path, models.UnsupportedOp(), (torch.randn(3, 3),))
    line = one_line_error(invoke("compile", path, "--device", "cpu"), 1)
    assert "aten::linalg_inv" in line and "models.py:" in line


def test_dtype_without_shape_is_a_usage_error(tmp_path):
    path = export(tmp_path, nn.Linear(4, 2), (torch.randn(1, 4),))
    line = one_line_error(invoke("compile", path, "--dtype", "float16"), 2)
    assert "--dtype goes with --shape" in line


def test_torchscript_still_needs_shapes():
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "--device", "cpu"), 2)
    assert "--shape" in line


def test_a_zip_that_is_not_a_program_is_not_taken_for_one(tmp_path):
    path = tmp_path / "other.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "hi")
    line = one_line_error(invoke("compile", path, "--shape", "1x3"), 1)
    assert "nor a TorchScript archive" in line or "torch.save checkpoint" in line or "torch.export" in line


def test_int64_inputs_keep_their_dtype(tmp_path):
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(10, 4)

        def forward(self, ids):
            return self.table(ids).sum(1)

    path = export(tmp_path, Embed(), (torch.randint(0, 10, (2, 5)),))
    c = compile_model(path, None, device="cpu")
    assert c.graph.values[c.graph.inputs[0]].spec.dtype == "int64" and c.check.passed
    assert len(MODELS) >= 6  # the samples above are all of them


def test_a_concatenation_read_only_by_another_along_the_same_dimension_joins_it():
    class Nested(nn.Module):  # inception_v3's InceptionE: cat([cat([a, b]), cat([c, d]), e])
        def forward(self, x):
            a, b = torch.relu(x), torch.sigmoid(x)
            inner = torch.cat([a, b], 1)
            other = torch.cat([a, b], 0)  # another dimension: stays
            return torch.cat([inner, torch.tanh(x)], 1), other

    c = compile_model(export_to(Nested(), (torch.randn(2, 3),)), None, device="cpu", fuse=False)
    cats = [op for op in c.graph.ops if op.target == "aten::cat.default"]
    assert len(cats) == 2 and len(cats[0].args[0]) + len(cats[1].args[0]) == 5 and c.check.passed


def export_to(module, example):
    import tempfile

    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "model.pt2")
    torch.export.save(torch.export.export(module.eval(), example), path)
    return path


def test_loading_caches_type_hints_only_while_it_reads(tmp_path):
    """torch's archive reader asks typing.get_type_hints once per serialized object; nimble answers
    from a cache during the load and puts the original back after, even when the load fails."""
    import typing

    from nimble.frontend.program import load_program

    original = typing.get_type_hints
    path = export(tmp_path, nn.Linear(3, 2), (torch.randn(1, 3),))
    assert load_program(path).graph is not None
    assert typing.get_type_hints is original
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(bad, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            zout.writestr(item, data[: len(data) // 2] if "/weight_" in item.filename else data)
    with pytest.raises(ModelError, match="could not be loaded as an exported program"):
        load_program(bad)
    assert typing.get_type_hints is original


def test_a_random_op_is_refused_not_folded_into_a_constant(tmp_path):
    """Ops on constants alone fold on the host; a random one would become one fixed draw."""

    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.randn(4)

    path = export(tmp_path, Noisy(), (torch.randn(2, 4),))
    with pytest.raises(UnsupportedError, match=r"aten::randn\S* at .*test_export.py:\d+ draws random numbers"):
        compile_model(path, None, device="cpu")


OUTLIB = '''
import dataclasses
import torch
import torch.utils._pytree as pytree


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    pooled: torch.Tensor


pytree.register_dataclass(Out, serialized_type_name=__name__ + ".Out")
'''


def _program_returning_a_dataclass(tmp_path, monkeypatch, library: str):
    """A program whose outputs are a dataclass registered with torch's pytree by its library (as
    Hugging Face's ModelOutput is), saved, then the library forgotten, as in a fresh process."""
    import importlib
    import sys

    import torch.utils._pytree as pytree

    (tmp_path / f"{library}.py").write_text(OUTLIB)
    monkeypatch.syspath_prepend(str(tmp_path))
    outlib = importlib.import_module(library)

    class Model(nn.Module):
        def forward(self, x):
            return outlib.Out(x * 2, x.sum(1))

    path = export(tmp_path, Model(), (torch.randn(2, 3),))
    pytree._deregister_pytree_node(outlib.Out)
    del sys.modules[library]
    return path


def test_a_program_returning_a_library_dataclass_loads_once_the_library_is_imported(tmp_path, monkeypatch):
    from nimble.frontend import program as frontend_export

    path = _program_returning_a_dataclass(tmp_path, monkeypatch, "outlib_known")
    monkeypatch.setattr(frontend_export, "OUTPUT_LIBRARIES", ("outlib_known",))
    c = compile_model(path, None, device="cpu")
    assert c.check.passed and len(c.graph.outputs) == 2
    assert "outlib_known" in __import__("sys").modules


def test_a_dataclass_of_an_unknown_library_gets_one_line_and_no_log(tmp_path, monkeypatch, capfd):
    path = _program_returning_a_dataclass(tmp_path, monkeypatch, "outlib_unknown")
    capfd.readouterr()
    result = invoke("compile", path, "--device", "cpu", "-o", tmp_path / "out.nimble")
    message = one_line_error(result, 1)
    assert "returns a outlib_unknown.Out, a type torch cannot read back until its library registers it" in message
    assert "Traceback" not in capfd.readouterr().err


class _Branches(nn.Module):
    """Two branches that each apply ReLU and the same pooling to one value (as NASNet's cells do),
    and two that read a value later written in place, which must stay apart."""

    def forward(self, x):
        a = torch.nn.functional.avg_pool2d(torch.relu(x), 3, 1, 1) + 1
        b = torch.nn.functional.avg_pool2d(torch.relu(x), 3, 1, 1) * 2
        y = x * 3
        c = torch.sigmoid(y)
        y.add_(1)
        d = torch.sigmoid(y)
        return a, b, c, d


def test_the_same_op_on_the_same_values_is_computed_once_unless_a_write_intervenes(tmp_path):
    c = compile_model(export(tmp_path, _Branches(), (torch.randn(1, 2, 6, 6),)), None, device="cpu", fuse=False)
    kinds = op_kinds(c.graph)
    assert c.check.passed, c.check.describe()
    assert kinds["relu"] == 1 and kinds["avg_pool2d"] == 1 and kinds["sigmoid"] == 2, kinds


class _Scaled(nn.Module):
    def forward(self, x, y):
        return torch.relu(x / 4.0 + y)


def test_a_number_in_a_tensor_slot_takes_the_scalar_overload_and_fuses(tmp_path):
    """export records `x / 4.0` as div.Tensor with a number; the Scalar overload computes the same
    and joins the pointwise fusion, as in a trace (the bert sample's attention scale)."""
    from nimble.ops import fusion

    c = compile_model(export(tmp_path, _Scaled(), (torch.randn(2, 8), torch.randn(2, 8))), None, device="cpu")
    assert c.check.passed
    (op,) = c.graph.ops
    assert op.target == fusion.FUSED and [node[0] for node in fusion.body_of(op)][0] == "aten::div.Scalar"
