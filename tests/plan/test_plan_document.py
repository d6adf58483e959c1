"""`nimble compile --json` on every sample model passes the outside checker."""

import json

import pytest
from typer.testing import CliRunner

from nimble.cli.main import app

from ..plan_checker import check

runner = CliRunner()


def compile_json(path, shapes, *extra):
    import tempfile

    args = ["compile", str(path), "--device", "cpu", "--json", "-o", tempfile.mkdtemp(), *extra]
    for s in shapes:
        args += ["--shape", "x".join(map(str, s))]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("streams", ["auto", "1", "3"])
def test_every_sample_plan_passes_the_outside_checker(sample, streams):
    name, path, shapes = sample
    doc = compile_json(path, shapes, "--streams", streams)
    assert doc["schedule"]["requested"] == streams
    assert check(doc) == []
    if streams != "auto":
        assert doc["streams"] <= int(streams)


def test_the_checker_catches_a_missing_wait():
    from ..conftest import SAMPLES

    doc = compile_json(SAMPLES / "inception.pt", [(1, 3, 224, 224)])
    victim = next(op for op in doc["ops"] if op["waits"])
    victim["waits"] = victim["waits"][1:]
    doc["syncs"] -= 1
    assert any("not enforced" in p for p in check(doc))


def test_dot_file_shows_streams_and_waits(tmp_path):
    from ..conftest import SAMPLES

    dot = tmp_path / "inception.dot"
    result = runner.invoke(app, ["compile", str(SAMPLES / "inception.pt"), "-s", "1x3x224x224",
                                 "--device", "cpu", "--dot", str(dot), "-o", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    text = dot.read_text()
    assert text.startswith('digraph "inception.pt"') and text.rstrip().endswith("}")
    doc = compile_json(SAMPLES / "inception.pt", [(1, 3, 224, 224)])
    assert text.count("style=dashed") == doc["syncs"]
    assert text.count("fillcolor=") == len(doc["ops"])


@pytest.mark.parametrize("bad", ["0", "-1", "many"])
def test_bad_stream_count_is_a_usage_error(bad):
    from ..conftest import SAMPLES

    result = runner.invoke(app, ["compile", str(SAMPLES / "resnet.pt"), "-s", "1x3x32x32", "--streams", bad])
    assert result.exit_code == 2 and "--streams" in result.stderr and "Traceback" not in result.stderr
