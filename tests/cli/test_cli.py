import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from nimble.cli.main import app

from .. import models
from ..conftest import SAMPLES, save_script

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code):
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip() and not line.startswith("... ")]
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    return " ".join(lines)


def test_help_and_version():
    assert invoke("--help").exit_code == 0
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.startswith("nimble ")
    assert "--shape" in invoke("compile", "--help").stdout


def test_help_does_not_import_torch():
    code = "import sys; from nimble.cli.main import app; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compile_prints_a_summary_and_writes_the_artifact(tmp_path):
    out = tmp_path / "inception.nimble"
    result = invoke("compile", SAMPLES / "inception.pt", "--shape", "1x3x224x224", "--device", "cpu", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "42 ops" in result.stderr and "largest activations" in result.stderr
    assert "71 lowered ops became 42, 29 of them fused" in result.stderr
    assert "check on cpu: ok" in result.stderr and "arena" in result.stderr
    assert f"wrote {out}" in result.stderr.replace("\n", "")
    assert out.is_file() and result.stdout == ""
    text = " ".join(result.stderr.split())  # rich wraps long lines
    assert "passes: lowered 71 ops, fuse_conv 71 -> 42;" in text and "more passes changed no op count" in text
    assert "time: load " in text and "under 0.005 s" in text and "functionalise 0.00 s" not in text


def test_the_summary_names_the_passes_that_changed_the_op_count_and_the_stages_that_took_time():
    """`describe_passes` and `describe_seconds`: a compile runs about 30 passes, most of which change
    nothing in a given model and take no measurable time; the summary names the others, in order,
    and counts the rest (`--json` keeps every one)."""
    from nimble.cli.compile import describe_passes, describe_seconds

    passes = [("lowered", 71), ("functionalise", 71), ("fuse_conv", 60), ("fold", 60), ("fuse_pointwise", 42)]
    assert describe_passes(passes) == "lowered 71 ops, fuse_conv 71 -> 60, fuse_pointwise 60 -> 42; 2 more passes " \
        "changed no op count"
    assert describe_passes([("lowered", 5), ("fold", 5)]) == "lowered 5 ops, 1 pass changed no op count"
    assert describe_passes([("lowered", 5), ("fuse", 3)]) == "lowered 5 ops, fuse 5 -> 3"
    assert describe_passes([("lowered", 5)]) == "lowered 5 ops"
    assert describe_passes([]) == "none"
    seconds = {"load": 0.06, "functionalise": 0.001, "check": 0.5, "write": 0.004}
    assert describe_seconds(seconds) == "load 0.06 s, check 0.50 s; 2 stages under 0.005 s"
    assert describe_seconds({"load": 0.001}) == "1 stage under 0.005 s"
    assert describe_seconds({"load": 0.2}) == "load 0.20 s"


def test_output_folder_gets_model_stem(tmp_path):
    result = invoke("compile", SAMPLES / "two_io.pt", "-s", "1x3x64x64", "-s", "1x8", "-o", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "two_io.nimble").is_file()


def test_default_output_is_next_to_the_model(tmp_path):
    model = tmp_path / "m.pt"
    model.write_bytes((SAMPLES / "two_io.pt").read_bytes())
    assert invoke("compile", model, "-s", "1x3x64x64", "-s", "1x8").exit_code == 0
    assert (tmp_path / "m.nimble").is_file()


def test_output_in_a_missing_folder_is_an_error(tmp_path):
    line = one_line_error(invoke("compile", SAMPLES / "two_io.pt", "-s", "1x3x64x64", "-s", "1x8",
                                 "-o", tmp_path / "nope" / "x.nimble"), 2)
    assert "does not exist" in line


def test_compile_json_is_the_plan_document(tmp_path):
    result = invoke("compile", SAMPLES / "two_io.pt", "-s", "1x3x64x64", "-s", "1x8", "--json", "--device", "cpu",
                    "-o", tmp_path)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1
    assert len(doc["inputs"]) == 2 and len(doc["outputs"]) == 2
    ids = [op["id"] for op in doc["ops"]]
    assert ids == list(range(len(ids)))
    produced = set(doc["inputs"]) | {v["id"] for v in doc["values"]}
    aliases_outside = {o["value"] for op in doc["ops"] for o in op["outputs"] if o["alias_of"] in produced}
    for op in doc["ops"]:
        assert set(op["inputs"]) <= produced, op
        assert all(d < op["id"] for d in op["deps"])
        for out in op["outputs"]:
            assert out["nbytes"] > 0 and (out["offset"] is None) == (out["value"] in aliases_outside)
            assert out["offset"] is None or out["offset"] + out["nbytes"] <= doc["arena_bytes"]
            produced.add(out["value"])
    assert set(doc["outputs"]) <= produced


def test_missing_file():
    line = one_line_error(invoke("compile", "nope.pt", "--shape", "1x3"), 1)
    assert "nope.pt: no such file" in line


def test_random_bytes(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"not a model" * 50)
    assert "nor a TorchScript archive" in one_line_error(invoke("compile", path, "--shape", "1x3"), 1)


def test_state_dict(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(3, 3).state_dict(), path)
    assert "torch.save checkpoint" in one_line_error(invoke("compile", path, "--shape", "1x3"), 1)


@pytest.mark.parametrize("shape", ["1x3xabc", "1x-3", "", "1x3x"])
def test_malformed_shape_is_a_usage_error(shape):
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "--shape", shape), 2)
    assert "is not a shape" in line


def test_bad_dtype_is_a_usage_error():
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x8x8", "--dtype", "float33"), 2)
    assert "float33" in line


def test_wrong_number_of_shapes_is_a_usage_error_from_either_frontend(tmp_path):
    line = one_line_error(invoke("compile", SAMPLES / "two_io.pt", "--shape", "1x3x64x64"), 2)
    assert "takes 2 input(s)" in line
    dynamic = tmp_path / "dynamic.pt2"
    batch = torch.export.Dim("batch", min=2)
    torch.export.save(torch.export.export(torch.nn.Linear(4, 2), (torch.randn(3, 4),),
                                          dynamic_shapes=({0: batch},)), str(dynamic))
    assert "is dynamic in the program" in one_line_error(invoke("compile", dynamic), 2)  # a missing --shape
    assert "takes 1 input(s)" in one_line_error(invoke("compile", dynamic, "-s", "3x4", "-s", "3x4"), 2)


def test_shape_the_model_rejects():
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "--shape", "1x5x64x64"), 1)
    assert not (SAMPLES / "resnet.nimble").exists()
    assert "conv2d" in line and "does not fit" in line and "check --shape" in line


def test_unsupported_op_names_op_and_line(tmp_path):
    path = save_script(tmp_path, models.UnsupportedOp(), "inv")
    line = one_line_error(invoke("compile", path, "--shape", "3x3"), 1)
    assert "aten::linalg_inv" in line and "models.py:" in line


def test_data_dependent_control_flow(tmp_path):
    path = save_script(tmp_path, models.DataDependentIf(), "datadep")
    line = one_line_error(invoke("compile", path, "--shape", "3x3"), 1)
    assert "depends on tensor values" in line and "models.py:" in line


def test_debug_shows_the_traceback():
    result = invoke("compile", "nope.pt", "--shape", "1x3", "--debug")
    assert result.exit_code == 1 and "Traceback" in result.stderr


def test_no_cuda_is_a_clear_error_on_cpu_machines():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x8x8", "--device", "cuda"), 2)
    assert "no CUDA device" in line


def test_no_output_files_are_left_behind(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"junk")
    invoke("compile", path, "--shape", "1x3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pt"]
