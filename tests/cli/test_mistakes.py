"""The mistakes a new user makes, named as the user made them (issue 30's findings): each gets
one line that says what is wrong and what to do, with the right exit code."""

import numpy as np
import pytest
import torch

import nimble
from nimble.errors import ShapeError

from ..conftest import SAMPLES
from .test_cli import invoke, one_line_error


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistakes")
    one, two = folder / "resnet.nimble", folder / "two_io.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", one).exit_code == 0
    assert invoke("compile", SAMPLES / "two_io.pt", "-s", "1x3x64x64", "-s", "1x8", "--device", "cpu",
                  "-o", two).exit_code == 0
    return one, two


def test_a_half_input_to_a_float_model_is_named_a_precision_mistake(tmp_path):
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--dtype", "float16",
                                 "--device", "cpu", "-o", tmp_path / "a.nimble"), 1)
    assert "input 'x' is float16 but the weights of aten::conv2d" in line and "--dtype float32" in line
    assert "internal error" not in line and not (tmp_path / "a.nimble").exists()


def test_a_shape_of_the_wrong_rank_is_blamed_on_the_input(tmp_path):
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32", "--device", "cpu",
                                 "-o", tmp_path / "a.nimble"), 1)
    assert "input 'x' of shape 1x3x32" in line and "check --shape" in line


def test_run_writes_npy_when_asked_and_refuses_other_suffixes(artifacts, tmp_path):
    one, two = artifacts
    out = tmp_path / "out.npy"
    assert invoke("run", one, "--device", "cpu", "-o", out).exit_code == 0
    assert np.load(out).shape == (1, 10)
    assert ".npy file holds one array" in one_line_error(invoke("run", two, "--device", "cpu", "-o",
                                                                tmp_path / "two.npy"), 2)
    assert "writes .safetensors" in one_line_error(invoke("run", one, "--device", "cpu", "-o", tmp_path / "o.bin"), 2)
    assert not (tmp_path / "two.npy").exists() and not (tmp_path / "o.bin").exists()


def test_compile_names_an_artifact_and_an_onnx_file_for_what_they_are(artifacts, tmp_path):
    one, _ = artifacts
    line = one_line_error(invoke("compile", one, "-s", "1x3x32x32"), 1)
    assert "is a nimble artifact, compiled already" in line and "nimble run" in line
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"\x08\x07\x12\x07pytorch")
    line = one_line_error(invoke("compile", onnx, "-s", "1x3"), 1)
    assert "is an ONNX model" in line and "torch.export.save" in line


def test_a_zip_with_a_broken_directory_is_one_line(tmp_path):
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("manifest.json", "{}")
    data = bytearray(buffer.getvalue())
    at = data.rfind(b"PK\x01\x02")
    data[at:at + 4] = b"XXXX"  # the end record still points at a central directory that is not there
    path = tmp_path / "model.pt"
    path.write_bytes(bytes(data))
    for args in (["-s", "1x3"], []):
        line = one_line_error(invoke("compile", path, *args), 1)
        assert "is a damaged zip archive" in line and "internal error" not in line


def test_a_wrong_file_points_to_torch_export_first(tmp_path):
    junk = tmp_path / "model.pt"
    junk.write_bytes(b"not a zip")
    line = one_line_error(invoke("compile", junk, "-s", "1x3"), 1)
    assert line.index("torch.export.save") < line.index("torch.jit.save") and "deprecated" in line


def test_a_folder_that_takes_no_file_is_refused_before_compiling():
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "-o", "/proc/x.nimble"), 2)
    assert "new files cannot be created in folder /proc" in line and ".tmp" not in line


def test_the_python_api_names_a_wrong_input_dtype_without_cli_flags(artifacts):
    one, _ = artifacts
    exe = nimble.load(one, device="cpu")
    with pytest.raises(ShapeError, match=r"must be float32, got float64; convert it first") as caught:
        exe(torch.randn(1, 3, 32, 32, dtype=torch.float64))
    assert "--" not in str(caught.value)
    with pytest.raises(ShapeError, match=r"compiled for that shape alone"):
        exe(torch.randn(1, 3, 16, 16))


@pytest.mark.parametrize("args", [
    ["compile", "missing.pt", "-s", "1x3"],
    ["compile", str(SAMPLES / "resnet.pt"), "-s", "1x3", "--device", "gpu"],
    ["compile", str(SAMPLES / "resnet.pt"), "-s", "1xx3"],
    ["compile", str(SAMPLES / "resnet.pt"), "-s", "1x3", "--streams", "0"],
    ["run", "missing.nimble"],
    ["bench", str(SAMPLES), "--device", "cpu"],
    ["bench", "missing.nimble", "--tune", "fast"],
    ["inspect", "missing.nimble"],
])
def test_a_flag_or_file_mistake_is_refused_before_torch_is_imported(args):
    """torch takes seconds to import (6 s on the GPU machine); these mistakes need none of it."""
    import subprocess
    import sys

    code = ("import sys\nfrom typer.testing import CliRunner\nfrom nimble.cli.main import app\n"
            f"r = CliRunner().invoke(app, {args!r})\nprint(r.exit_code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    exit_code, imported = out.stdout.split()
    assert exit_code in ("1", "2") and imported == "False", out.stdout + out.stderr
