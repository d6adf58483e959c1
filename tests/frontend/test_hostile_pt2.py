"""Crafted `.pt2` archives: compiling one runs no code from the file and no op outside the
allowlist, and each is refused in one line naming the member, the entry or the op."""

import json
import os
import pickle
import re
import zipfile

import pytest
import torch
from torch import nn

from nimble.errors import ModelError, UnsupportedError
from nimble.frontend import archive
from nimble.frontend.builder import GraphBuilder
from nimble.ops import targets

from ..cli.test_cli import invoke, one_line_error
from .test_export import export


class _Ran:
    """Pickled, it touches `mark` when unpickled."""

    def __init__(self, mark):
        self.mark = str(mark)

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def rewrite(src, dst, edit):
    """Copy the zip `src` to `dst`, passing each member's (name, bytes) through `edit`, which
    returns a list of (name, bytes) to write."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            for new_name, data in edit(name, zin.read(name)):
                zout.writestr(new_name, data)
    return dst


def refused(path, *needles, code=1):
    out = path.parent / "out.nimble"
    line = one_line_error(invoke("compile", path, "--device", "cpu", "-o", out), code)
    for needle in needles:
        assert needle in line, line
    assert not out.exists()
    return line


def with_constant_entry(tmp_path, path_name: str, payload: bytes, use_pickle=True):
    """A program whose constants config gains an entry `evil` stored at `path_name`."""
    path = export(tmp_path, nn.Linear(4, 2), (torch.randn(1, 4),))

    def edit(name, data):
        if name.endswith("_constants_config.json"):
            doc = json.loads(data)
            doc["config"]["evil"] = {"path_name": path_name, "is_param": False, "use_pickle": use_pickle,
                                     "tensor_meta": None}
            return [(name, json.dumps(doc).encode()), (name.rsplit("/", 1)[0] + "/" + path_name, payload)]
        return [(name, data)]

    return rewrite(path, tmp_path / "evil.pt2", edit)


@pytest.mark.parametrize("path_name, what", [("opaque_obj_0", "an object"), ("custom_obj_0", "an object"),
                                              ("tensor_7", "a pickle")])
def test_a_pickled_constant_is_refused_before_torch_reads_it(tmp_path, path_name, what):
    mark = tmp_path / "ran"
    evil = with_constant_entry(tmp_path, path_name, pickle.dumps(_Ran(mark)))
    refused(evil, "entry 'evil'", "constants_config.json", what, "could run code")
    assert not mark.exists()


def test_torchs_unpicklers_are_unreachable_while_it_reads(tmp_path):
    """Past the member check (here: skipped), torch's pickle.loads and TorchScript's object
    unpickler raise instead of running the payload."""
    from torch.export.pt2_archive import _package

    mark = tmp_path / "ran"
    evil = with_constant_entry(tmp_path, "opaque_obj_0", pickle.dumps(_Ran(mark)))
    before = getattr(_package, "pickle", None)  # torch 2.11's reader has none of its own
    with archive.unpicklers_blocked(), pytest.raises(Exception):
        torch.export.load(str(evil))
    assert not mark.exists()
    assert torch._C._pickle_load_obj.__name__ != "refuse"  # restored after the block
    assert getattr(_package, "pickle", None) is before


def test_a_weight_marked_as_pickled_is_refused(tmp_path):
    path = export(tmp_path, nn.Linear(4, 2), (torch.randn(1, 4),))

    def edit(name, data):
        if name.endswith("_weights_config.json"):
            doc = json.loads(data)
            next(iter(doc["config"].values()))["use_pickle"] = True
            data = json.dumps(doc).encode()
        return [(name, data)]

    refused(rewrite(path, tmp_path / "evil.pt2", edit), "weights_config.json", "a pickle")


def test_a_size_expression_that_is_python_is_refused_before_sympy_evaluates_it(tmp_path):
    class Flat(nn.Module):
        def forward(self, x):
            return torch.relu(x).reshape(-1)

    mark = tmp_path / "ran"
    batch = torch.export.Dim("batch", min=2, max=64)
    path = export(tmp_path, Flat(), (torch.randn(4, 4),), dynamic_shapes=({0: batch},))
    evil_expr = f"__import__('os').system('touch {mark}')"

    def edit(name, data):
        if name.endswith("models/model.json"):
            text = data.decode()
            assert '"expr_str"' in text
            data = re.sub(r'"expr_str": "[^"]*"', json.dumps({"expr_str": evil_expr})[1:-1], text, count=1).encode()
        return [(name, data)]

    evil = rewrite(path, tmp_path / "evil.pt2", edit)
    refused(evil, "size expression", "evaluate it as Python")
    assert not mark.exists()


def test_size_expressions_torch_writes_pass():
    assert archive._plain_size("Mul(Integer(4), Symbol('s77', positive=True, integer=True))")
    assert archive._plain_size("FloorDiv(s0, 2) + Mod(s1, 3)")
    for evil in ("Symbol('x').__class__", "eval('1')", "Integer(4)[0]", "s0.real", "lambda: 0", "open('/etc')"):
        assert not archive._plain_size(evil), evil


@pytest.mark.parametrize("member, needle", [
    ("model/data/aotinductor/model/x.so", "compiled package"),
    ("model/data/weights/model.pt", "legacy archive layout"),
    ("model/code/evil.py", "not part of an exported program"),
    ("model/../evil", "points outside the archive"),
])
def test_members_a_program_does_not_need_are_refused(tmp_path, member, needle):
    path = export(tmp_path, nn.Linear(4, 2), (torch.randn(1, 4),))
    evil = rewrite(path, tmp_path / "evil.pt2", lambda n, d: [(n, d)] + ([(member, b"x")] if n.endswith("archive_format") else []))
    refused(evil, needle)


def test_a_compressed_member_is_refused(tmp_path):
    path = export(tmp_path, nn.Linear(4, 2), (torch.randn(1, 4),))
    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(evil, "w", zipfile.ZIP_DEFLATED) as zout:
        for name in zin.namelist():
            zout.writestr(name, zin.read(name))
    refused(evil, "compressed")


def test_a_node_whose_target_is_not_an_operator_is_refused(tmp_path):
    path = export(tmp_path, nn.ReLU(), (torch.randn(4),))

    def edit(name, data):
        if name.endswith("models/model.json"):
            data = data.replace(b'"torch.ops.aten.relu.default"', b'"builtins.exec"')
        return [(name, data)]

    refused(rewrite(path, tmp_path / "evil.pt2", edit), "builtins.exec", "not an operator")


class _PlusOnes(nn.Module):
    def forward(self, x):
        return x + torch.ones(4)


def _with_node(tmp_path, target: str, inputs: list):
    """The program x + ones(4) with its `ones` node replaced by a call of `target`."""
    path = export(tmp_path, _PlusOnes(), (torch.randn(4),))

    def edit(name, data):
        if name.endswith("models/model.json"):
            doc = json.loads(data)
            for node in doc["graph_module"]["graph"]["nodes"]:
                if node["target"] == "torch.ops.aten.ones.default":
                    node["target"], node["inputs"] = target, inputs
            data = json.dumps(doc).encode()
        return [(name, data)]

    return rewrite(path, tmp_path / "evil.pt2", edit)


def test_from_file_in_a_program_is_refused_before_it_reads_the_file(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef")
    evil = _with_node(tmp_path, "torch.ops.aten.from_file.default", [
        {"name": "filename", "arg": {"as_string": str(secret)}, "kind": 1},
        {"name": "shared", "arg": {"as_bool": True}, "kind": 1},
        {"name": "size", "arg": {"as_int": 4}, "kind": 1}])
    refused(evil, "aten::from_file", "is not an op nimble runs, so it was not run")
    assert secret.read_bytes() == b"0123456789abcdef"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt2", "model.pt2", "secret"]


def test_a_huge_factory_is_refused_before_it_allocates(tmp_path):
    evil = _with_node(tmp_path, "torch.ops.aten.ones.default", [
        {"name": "size", "arg": {"as_ints": [2**34]}, "kind": 1}])
    refused(evil, "aten::ones.default", "bytes of constants", "at most")


def test_strict_folding_runs_allowlisted_ops_and_named_factories_only(tmp_path, capfd):
    walker = GraphBuilder("m", strict_folding=True)
    fold = lambda target, ins: walker.fold(targets.schema_op(target)._schema, target, ins, "here")  # noqa: E731
    assert fold("aten::ones.default", [[2, 3], None, None, None, None]).shape == (2, 3)
    assert fold("aten::add.Tensor", [torch.ones(2), torch.ones(2), 1]).tolist() == [2.0, 2.0]
    with pytest.raises(UnsupportedError, match="is not an op nimble runs"):
        fold("aten::_print.default", ["\x1b]0;pwned\x07"])
    assert "pwned" not in capfd.readouterr().out
    target = tmp_path / "f"
    with pytest.raises(UnsupportedError, match="is not an op nimble runs"):
        fold("aten::from_file.default", [str(target), True, 8, None, None, None, None])
    assert not target.exists()
    with pytest.raises(UnsupportedError, match="at most"):
        fold("aten::zeros.default", [[2**34], None, None, None, None])


def test_torchscript_folding_is_sized_too():
    walker = GraphBuilder("m")  # a TorchScript program: any op may fold, but none beyond the limit
    schema = targets.schema_op("aten::zeros.default")._schema
    with pytest.raises(UnsupportedError, match="at most"):
        walker.fold(schema, "aten::zeros.default", [[2**34], None, None, None, None], "here")


def test_only_modules_that_define_outputs_are_imported(tmp_path, monkeypatch):
    from nimble.frontend import program as frontend_export

    imported = []
    monkeypatch.setattr(frontend_export.importlib, "import_module", imported.append)
    with pytest.raises(ModelError, match="imports only the modules of transformers that define models"):
        frontend_export._import_output_library(tmp_path / "m.pt2", "transformers.commands.serving.Out")
    frontend_export._import_output_library(tmp_path / "m.pt2", "transformers.modeling_outputs.BaseModelOutput")
    frontend_export._import_output_library(tmp_path / "m.pt2", "transformers.models.bert.modeling_bert.Out")
    assert imported == ["transformers.modeling_outputs", "transformers.models.bert.modeling_bert"]


def test_size_arithmetic_out_of_any_size_range_is_refused_before_it_runs():
    """A crafted program's size arithmetic (`2 ** 10**9`, a product of huge numbers) would tie up
    the compiler; it is refused in one line, and a tensor among the numbers is too."""
    import operator

    from nimble.frontend.export import size_arithmetic

    assert size_arithmetic(operator.mul, [8, 16], "m: mul") == 128
    for target, args in ((operator.pow, [2, 10**9]), (operator.mul, [2**70, 3]), (operator.add, [torch.ones(1), 1])):
        with pytest.raises(UnsupportedError) as e:
            size_arithmetic(target, args, "m: op")
        assert "\n" not in str(e.value) and str(e.value).startswith("m: op")


class _StochasticDepth(nn.Module):
    def forward(self, x):
        return x * torch.empty([x.shape[0], 4], dtype=x.dtype).bernoulli_(0.5)


@pytest.mark.parametrize("functional", [False, True], ids=["bernoulli_.float", "bernoulli.p"])
def test_a_random_fill_of_torch_empty_is_refused_at_inference(tmp_path, functional):
    """A training step takes `torch.empty(...).bernoulli_(p)` (it reads only the empty tensor's
    shape); a program compiled for inference that draws it is refused in one line, and nothing
    is written."""
    program = torch.export.export(_StochasticDepth().eval(), (torch.randn(2, 4),))
    if functional:
        program = program.run_decompositions({})
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    line = refused(path, "aten::bernoulli")
    assert "draws random numbers" in line or "is not an op nimble runs" in line, line
