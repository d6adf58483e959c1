"""Every command's `--json` is one document on stdout, described by a JSON Schema in `schemas/`, on
success and on failure alike: real output is validated against the schemas, and a document that
lacks a field fails the validation."""

import json

import pytest

# A test extra (pyproject's `test`); a machine that lacks it (the GPU box has no network) skips
# this file, and CI, which installs the extras, runs it.
jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")
Registry, Resource = referencing.Registry, referencing.Resource

from ..conftest import ROOT, SAMPLES
from .test_cli import invoke

SCHEMAS = {p.name: json.loads(p.read_text()) for p in (ROOT / "schemas").glob("*.schema.json")}
REGISTRY = Registry().with_resources([(name, Resource.from_contents(doc)) for name, doc in SCHEMAS.items()])


def validate(doc: dict, kind: str) -> dict:
    jsonschema.Draft202012Validator(SCHEMAS[f"{kind}.schema.json"], registry=REGISTRY).validate(doc)
    return doc


def document(result, code: int) -> dict:
    """The one JSON document a command printed on stdout, with the exit code it gave."""
    assert result.exit_code == code, (result.exit_code, result.stderr)
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("json")
    out = folder / "resnet.nimble"
    doc = document(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out,
                          "--json"), 0)
    return out, doc


def test_every_schema_is_a_valid_schema():
    assert set(SCHEMAS) == {f"{k}.schema.json" for k in ("plan", "compile", "inspect", "run", "bench", "error")}
    for doc in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(doc)


def test_compile_names_the_artifact_its_check_stages_and_versions(compiled):
    import hashlib

    out, doc = compiled
    validate(doc, "compile")
    assert doc["artifact"] == {"path": str(out), "bytes": out.stat().st_size,
                               "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    assert doc["check"]["passed"] and doc["check"]["device"] == "cpu"
    assert {"lower", "functionalise", "fuse_pointwise", "check", "write"} <= set(doc["stages_seconds"])
    assert doc["versions"]["format"] == 2


def test_inspect_gives_the_manifest_and_the_names(compiled):
    out, _ = compiled
    doc = validate(document(invoke("inspect", out, "--json"), 0), "inspect")
    assert doc["manifest"]["options"]["frontend"] == "torchscript" and doc["input_names"] == ["x"]
    assert len(doc["output_names"]) == len(doc["outputs"]) and doc["footprint"] is None
    doc = validate(document(invoke("inspect", out, "--device", "cpu", "--json"), 0), "inspect")
    assert doc["footprint"] is None  # nimble's own books hold on the CPU: the plan


def test_run_names_the_file_it_wrote(compiled, tmp_path):
    out, _ = compiled
    written = tmp_path / "out.safetensors"
    doc = validate(document(invoke("run", out, "--device", "cpu", "--check", "-o", written, "--json"), 0), "run")
    assert doc["wrote"]["path"] == str(written) and written.exists() and doc["check"]["passed"]


def test_run_documents_the_kernels_readied_before_its_first_op(compiled, tmp_path):
    """On CUDA `kernels` is the prebuild's report (`runtime/prebuild.Prebuilt`); the CPU run here
    has none, so the report a GPU run gives is put in its place and checked the same way."""
    from nimble.runtime.prebuild import Prebuilt

    out, _ = compiled
    doc = validate(document(invoke("run", out, "--device", "cpu", "--json"), 0), "run")
    assert doc["kernels"] is None
    done = Prebuilt(found=31, cached=2, from_pack=27, built=2, seconds=1.5, notes=["a pack line"])
    done.stages.update(walk=0.4, take=0.6, build=0.5)
    validate({**doc, "kernels": done.document()}, "run")
    broken = {k: v for k, v in done.document().items() if k != "stages"}
    with pytest.raises(jsonschema.ValidationError):
        validate({**doc, "kernels": broken}, "run")


def test_a_reduced_precision_artifact_documents_its_record(tmp_path):
    out = tmp_path / "r16.nimble"
    doc = validate(document(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out,
                                   "--precision", "bf16", "--json"), 0), "compile")
    assert doc["precision"]["dtype"] == "bfloat16"
    assert validate(document(invoke("inspect", out, "--json"), 0), "inspect")["precision"] == doc["precision"]
    bench = validate(document(invoke("bench", out, "--device", "cpu", "-n", "2", "--duration", "0", "--no-baselines",
                                     "--json"), 0), "bench")
    assert bench["precision"] == doc["precision"]
    broken = dict(doc, precision=dict(doc["precision"], io="half"))
    with pytest.raises(jsonschema.ValidationError):
        validate(broken, "compile")


def test_bench_document(compiled, tmp_path):
    out, _ = compiled
    doc = validate(document(invoke("bench", out, "--device", "cpu", "-n", "5", "--duration", "0", "--no-baselines", "--json"), 0),
                   "bench")
    assert doc["results"]["nimble"]["iterations"] == 5 and doc["trace"] is None
    doc = validate(document(invoke("bench", out, "--device", "cpu", "-n", "1", "--duration", "0", "--no-baselines",
                                   "--trace", tmp_path / "t.json", "--json"), 0), "bench")
    assert doc["trace"]["path"] == str(tmp_path / "t.json")


@pytest.mark.parametrize("args, code, kind", [
    (("compile", SAMPLES / "two_io.pt", "-s", "1x3x8x8"), 2, "UsageError"),
    (("compile", SAMPLES / "resnet.pt", "-s", "1x5x32x32", "--device", "cpu"), 1, "ShapeError"),
    (("inspect", SAMPLES / "missing.nimble"), 1, "ArtifactError"),
    (("run", SAMPLES / "missing.nimble", "--device", "cpu"), 1, "ArtifactError"),
    (("bench", SAMPLES / "missing.nimble", "--device", "cpu"), 1, "ArtifactError"),
])
def test_a_failure_is_a_json_document_too(args, code, kind):
    doc = validate(document(invoke(*args, "--json"), code), "error")
    assert doc["error"]["kind"] == kind and doc["error"]["exit_code"] == code


def test_a_shape_error_names_the_op_and_the_source_line():
    doc = document(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x5x32x32", "--device", "cpu", "--json"), 1)
    assert doc["error"]["op"].startswith("aten::") and doc["error"]["source"].split(":")[-1].isdigit()


def test_a_mismatched_run_check_carries_its_report(compiled, tmp_path):
    from nimble.formats import read_artifact, write_artifact

    out, _ = compiled
    art = read_artifact(out)
    art.sample_outputs = [t + 1 for t in art.sample_outputs]
    write_artifact(tmp_path / "wrong.nimble", art)
    doc = validate(document(invoke("run", tmp_path / "wrong.nimble", "--check", "--device", "cpu", "--json"), 3),
                   "error")
    assert doc["error"]["kind"] == "MismatchError" and validate(doc["report"], "run")["check"]["passed"] is False


def test_the_schemas_can_fail(compiled):
    _, doc = compiled
    broken = {k: v for k, v in doc.items() if k != "artifact"}
    with pytest.raises(jsonschema.ValidationError, match="'artifact' is a required property"):
        validate(broken, "compile")
    with pytest.raises(jsonschema.ValidationError):
        validate({"schema_version": 1, "error": {"kind": "X", "message": "m", "op": None, "source": None,
                                                 "exit_code": 7}}, "error")


def test_the_exit_codes_are_in_the_help():
    text = " ".join(invoke("--help").stdout.split())
    for code in ("0 ok", "1 bad input", "2 usage", "3 outputs mismatched", "130 interrupted"):
        assert code in text
