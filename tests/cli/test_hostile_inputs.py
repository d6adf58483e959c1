"""Files a user hands to `nimble run --input`, and names an artifact carries into a picture, are
data from a stranger too: each bad one gets one line, and nothing is allocated from a header that
lies about its size."""

import struct

import numpy as np
import pytest

from .test_cli import invoke, one_line_error


@pytest.fixture(scope="module")
def resnet(sample_artifacts):
    return sample_artifacts["resnet"]


def _npy_lying_about_its_shape(path):
    np.save(path, np.zeros((1, 3, 32, 32), dtype=np.float32))
    data = path.read_bytes()
    path.write_bytes(data.replace(b"(1, 3, 32, 32)", b"(99999,99999,)", 1))


@pytest.mark.parametrize("name, make, needle", [
    ("str.npy", lambda p: np.save(p, np.array(["a", "b"])), "holds <U1 values"),
    ("struct.npy", lambda p: np.save(p, np.zeros(2, dtype=[("a", "i4"), ("b", "f4")])), "values; nimble takes numbers"),
    ("object.npy", lambda p: np.save(p, np.array([None, 1], dtype=object), allow_pickle=True), "holds object values"),
    ("lie.npy", _npy_lying_about_its_shape, "bytes of data"),
    ("junk.npy", lambda p: p.write_bytes(b"\x93NUMPY\x09\x00garbage"), "not a readable .npy file"),
    ("header.safetensors", lambda p: p.write_bytes(struct.pack("<Q", 2**40) + b"{}"), "byte header"),
    ("ranges.safetensors", lambda p: p.write_bytes(
        (lambda h: struct.pack("<Q", len(h)) + h)(b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8000]}}')),
     "x"),
    ("dtype.safetensors", lambda p: p.write_bytes(
        (lambda h: struct.pack("<Q", len(h)) + h + b"\0" * 8)(b'{"x": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 8]}}')),
     "x"),
])
def test_a_bad_input_file_gets_one_line(resnet, tmp_path, name, make, needle):
    path = tmp_path / name
    make(path)
    line = one_line_error(invoke("run", resnet, "--input", path, "--device", "cpu"), 1)
    assert needle in line and "internal error" not in line, line


def test_a_model_name_cannot_break_out_of_the_dot_picture(resnet, tmp_path):
    from nimble.plan.dot import to_dot
    from nimble.formats import read_artifact

    art = read_artifact(resnet)
    dot = to_dot(art.graph, art.schedule, 'evil" URL="javascript:alert(1)" x="\n')
    first = dot.splitlines()[0]
    assert first == 'digraph "evil\\" URL=\\"javascript:alert(1)\\" x=\\"" {', first
    assert 'URL="' not in dot


def test_a_header_that_is_not_python_gets_one_line(resnet, tmp_path):
    path = tmp_path / "broken.npy"
    np.save(path, np.zeros((1, 3, 32, 32), dtype=np.float32))
    path.write_bytes(path.read_bytes().replace(b"(1, 3, 32, 32)", b"(1, 3, 32, 32"  + b" ", 1))
    assert "not a readable .npy file" in one_line_error(invoke("run", resnet, "--input", path, "--device", "cpu"), 1)
