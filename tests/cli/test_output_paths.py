"""Every path a command writes refuses what is not a new or regular file, and any of the command's
inputs; a file it replaces keeps no special bits. Every refusal is one line, exit 2, before any
work, and leaves the path as it was. And the small mistakes in what a command reads get one line."""

import os
import stat

import numpy as np
import pytest
from typer.testing import CliRunner

from nimble.cli.main import app
from nimble.fileio import write_atomic

runner = CliRunner()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    from ..conftest import SAMPLES

    path = tmp_path_factory.mktemp("paths") / "two_io.nimble"
    write_artifact(path, compile_model(SAMPLES / "two_io.pt", input_specs(["1x3x64x64", "1x8"]), device="cpu").artifact())
    return path


def refused(args, *words):
    result = runner.invoke(app, [*args, "--device", "cpu"] if args[0] != "inspect" else args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and all(w in result.output for w in words), result.output


def test_a_device_a_fifo_or_a_link_loop_is_never_written(artifact, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.safetensors"
    os.symlink(loop, loop)
    refused(["bench", str(artifact), "--trace", "/dev/null"], "not a regular file")
    refused(["bench", str(artifact), "--export-times", str(fifo)], "not a regular file")
    refused(["inspect", str(artifact), "--dot", str(fifo)], "not a regular file")
    refused(["run", str(artifact), "-o", str(loop)], str(loop))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(OSError, match="not a regular file"):  # the writer itself refuses too
        write_atomic(fifo, b"x")


def test_an_output_may_not_be_one_of_the_inputs(artifact, tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 8), np.float32))
    before = x.read_bytes()
    refused(["bench", str(artifact), "-i", f"features={x}", "--trace", str(x)], "--input file itself")
    refused(["bench", str(artifact), "-i", f"features={x}", "--export-times", str(x)], "--input file itself")
    assert x.read_bytes() == before


def test_a_replaced_output_loses_its_special_bits(artifact, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    os.chmod(out, 0o6755)
    result = runner.invoke(app, ["run", str(artifact), "--device", "cpu", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755


def test_inputs_that_are_not_files_or_given_twice_get_one_line(artifact, tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 8), np.float32))
    fifo = tmp_path / "f.npy"
    os.mkfifo(fifo)
    for item in (f"features={fifo}", f"features={tmp_path}"):
        result = runner.invoke(app, ["run", str(artifact), "--device", "cpu", "--input", item])
        assert result.exit_code == 1 and "not a regular file" in result.output, result.output
    refused(["run", str(artifact), "--input", f"features={x}", "--input", f"features={x}"], "given twice")
    refused(["run", str(artifact), "--check", "--rtol", "inf"], "finite")


def test_small_messages_say_what_is_true_and_what_to_do(artifact, tmp_path):
    from ..conftest import SAMPLES

    out = tmp_path / "r.nimble"
    result = runner.invoke(app, ["compile", str(SAMPLES / "resnet.pt"), "-s", "1x3x32x32", "--dtype", "float",
                                 "--device", "cpu", "-o", str(out)])
    assert result.exit_code == 0 and out.exists(), result.output  # torch's alias of float32
    if os.path.isdir("/proc/self"):
        refused(["compile", str(SAMPLES / "resnet.pt"), "-s", "1x3x32x32", "-o", "/proc/out.nimble"],
                "new files cannot be created in folder /proc", "writable disk")
    for command in ("run", "inspect", "serve"):
        args = [command, str(SAMPLES / "resnet.pt")] + (["--device", "cpu"] if command == "run" else [])
        result = runner.invoke(app, args)
        assert result.exit_code != 0 and "compile it first" in result.output, (command, result.output)


def test_an_interrupt_after_the_artifact_is_complete_keeps_it(tmp_path, monkeypatch):
    import nimble.formats
    from nimble.formats import read_artifact

    from ..conftest import SAMPLES

    real = nimble.formats.write_artifact

    def written_then_interrupted(path, art):
        real(path, art)
        raise KeyboardInterrupt

    def interrupted_before(path, art):
        raise KeyboardInterrupt

    out = tmp_path / "r.nimble"
    args = ["compile", str(SAMPLES / "resnet.pt"), "-s", "1x3x32x32", "--device", "cpu", "-o", str(out)]
    monkeypatch.setattr(nimble.formats, "write_artifact", interrupted_before)
    result = runner.invoke(app, args)
    assert result.exit_code == 130 and not out.exists(), result.output
    monkeypatch.setattr(nimble.formats, "write_artifact", written_then_interrupted)
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "complete and valid" in result.output, result.output
    read_artifact(out)
