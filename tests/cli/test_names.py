"""Inputs and outputs carry names a client can use (issue 62): the model's own (a .pt2's argument
names, the keys of a returned dict), `output`/`output_k` otherwise, or those given at compile;
inspect, run and the KServe metadata show them."""

import json

import torch

from nimble.formats import read_artifact
from nimble.serve.protocol import model_info

from ..conftest import SAMPLES
from .test_cli import invoke, one_line_error


class _Dict(torch.nn.Module):
    def forward(self, image, scale):
        return {"logits": image.mean((2, 3)) * scale, "aux": {"map": image * 2}}


def test_a_program_keeps_its_argument_names_and_its_dict_keys(tmp_path):
    path = tmp_path / "dict.pt2"
    torch.export.save(torch.export.export(_Dict(), (torch.randn(1, 3, 4, 4), torch.ones(1, 3))), str(path))
    out = tmp_path / "dict.nimble"
    assert invoke("compile", path, "--device", "cpu", "-o", out).exit_code == 0
    g = read_artifact(out).graph
    assert [g.values[i].name for i in g.inputs] == ["image", "scale"]
    assert [g.values[o].name for o in g.outputs] == ["logits", "aux.map"]
    meta = model_info("dict", g, [1]).metadata()  # what a KServe client reads
    assert [t["name"] for t in meta["inputs"]] == ["image", "scale"]
    assert [t["name"] for t in meta["outputs"]] == ["logits", "aux.map"]


def test_names_given_at_compile_and_mistakes_in_them(tmp_path):
    out = tmp_path / "t.nimble"
    args = ["compile", SAMPLES / "two_io.pt", "-s", "1x3x64x64", "-s", "1x8", "--device", "cpu", "-o", out]
    result = invoke(*args)
    assert result.exit_code == 0
    g = read_artifact(out).graph
    assert [g.values[o].name for o in g.outputs] == ["output_0", "output_1"]  # a tuple, from a trace
    assert invoke(*args, "--input-names", "img,feat", "--output-names", "logits,embedding").exit_code == 0
    doc = json.loads(invoke("inspect", out, "--json").stdout)
    assert doc["input_names"] == ["img", "feat"]
    assert doc["output_names"] == ["logits", "embedding"]
    for extra, words in ((["--output-names", "logits"], "gives 1 name(s) but two_io.pt has 2 output(s)"),
                         (["--output-names", "a,a"], "given twice"),
                         (["--output-names", "bad name,x"], "a name starts with a letter"),
                         (["--output-names", "logits,image"], "an input has that name")):
        line = one_line_error(invoke(*args, *extra), 2)
        assert words in line, line
