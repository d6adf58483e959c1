"""The .nimble artifact: round trips, reproducible bytes, and fuzzing that must end in ArtifactError."""

import io
import json
import random
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from nimble.cli.main import app
from nimble.errors import ArtifactError
from nimble.formats import FORMAT_VERSION, read_artifact, write_artifact
from nimble.formats.spec import ONE_BATCH_VERSION
from nimble.formats.artifact import encode
from nimble.pipeline import compile_model
from nimble.specs import input_specs

from ..conftest import ROOT, SAMPLES
from ..forge import edit_json, members_of, rebuild

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def compiled():
    return compile_model(SAMPLES / "two_io.pt", input_specs(["1x3x64x64", "1x8"]), device="cpu")


@pytest.fixture(scope="module")
def blob(compiled):
    return encode(compiled.artifact())


def read_bytes(tmp_path, data: bytes):
    path = tmp_path / "a.nimble"
    path.write_bytes(data)
    return read_artifact(path)


def test_round_trip(compiled, tmp_path):
    path = tmp_path / "two_io.nimble"
    write_artifact(path, compiled.artifact())
    art = read_artifact(path)
    assert art.graph == compiled.graph and art.schedule == compiled.schedule and art.memory == compiled.memory
    assert art.weights.keys() == compiled.weights.keys()
    assert all(torch.equal(art.weights[k], compiled.weights[k]) for k in art.weights)
    assert all(torch.equal(a, b) for a, b in zip(art.sample_inputs, compiled.sample_inputs))
    assert all(torch.equal(a, b) for a, b in zip(art.sample_outputs, compiled.sample_outputs))
    assert art.manifest["format_version"] == ONE_BATCH_VERSION  # several batch sizes write FORMAT_VERSION
    with zipfile.ZipFile(path) as z:
        assert [i.filename for i in z.infolist()][0] == "manifest.json"
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert not any(name.endswith((".pkl", ".py")) for name in z.namelist())


def test_two_compiles_give_identical_bytes(blob):
    again = compile_model(SAMPLES / "two_io.pt", input_specs(["1x3x64x64", "1x8"]), device="cpu")
    assert encode(again.artifact()) == blob


def test_inspect_json_round_trips_compile_json(sample, tmp_path):
    name, path, shapes = sample
    runner = CliRunner()
    args = ["compile", str(path), "--device", "cpu", "--json", "-o", str(tmp_path)]
    for s in shapes:
        args += ["-s", "x".join(map(str, s))]
    compiled_doc = runner.invoke(app, args)
    inspected = runner.invoke(app, ["inspect", str(tmp_path / f"{name}.nimble"), "--json"])
    assert compiled_doc.exit_code == 0 and inspected.exit_code == 0, inspected.stderr
    plan = json.loads((ROOT / "schemas" / "plan.schema.json").read_text())["properties"]
    compiled_plan, inspected_plan = ({k: json.loads(r.stdout)[k] for k in plan} for r in (compiled_doc, inspected))
    assert compiled_plan == inspected_plan
    human = runner.invoke(app, ["inspect", str(tmp_path / f"{name}.nimble")])
    assert human.exit_code == 0 and "lower bound" in human.stdout  # on stdout, for grep
    rows = [line.split() for line in human.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(len(json.loads(inspected.stdout)["ops"])))  # every id, none cut
    assert "…" not in human.stdout


def test_writing_is_atomic(compiled, tmp_path, monkeypatch):
    path = tmp_path / "a.nimble"
    path.write_bytes(b"old")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", broken)
    with pytest.raises(OSError):
        write_artifact(path, compiled.artifact())
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["a.nimble"]


@FUZZ
@given(cut=st.integers(0, 10**9))
def test_truncated_files(blob, tmp_path, cut):
    with pytest.raises(ArtifactError):
        read_bytes(tmp_path, blob[: cut % len(blob)])


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=4))
def test_flipped_bytes(blob, compiled, tmp_path, flips):
    data = bytearray(blob)
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    try:
        art = read_bytes(tmp_path, bytes(data))
    except ArtifactError:
        return
    # a flip in bytes nothing reads (a zip header's timestamp, say) may pass, but then nothing changed
    assert art.graph == compiled.graph and art.schedule == compiled.schedule and art.memory == compiled.memory
    assert all(torch.equal(art.weights[k], compiled.weights[k]) for k in art.weights)


@pytest.mark.parametrize("member", ["graph.json", "schedule.json", "memory.json", "weights.safetensors",
                                    "sample/inputs.safetensors", "sample/outputs.safetensors"])
def test_dropped_members(blob, tmp_path, member):
    with pytest.raises(ArtifactError, match=f"{member} is missing"):
        read_bytes(tmp_path, rebuild(blob, {member: None}))


def test_missing_manifest_and_extra_members(blob, tmp_path):
    members = members_of(blob)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, content in members.items():
            if name != "manifest.json":
                z.writestr(name, content)
    with pytest.raises(ArtifactError, match="no manifest.json"):
        read_bytes(tmp_path, out.getvalue())
    with pytest.raises(ArtifactError, match="code.py is unexpected"):
        read_bytes(tmp_path, rebuild(blob, {"code.py": b"import os"}))


def test_changed_hash_is_caught(blob, tmp_path):
    graph = members_of(blob)["graph.json"].replace(b'"relu', b'"gelu', 1)
    with pytest.raises(ArtifactError, match="graph.json does not match its sha256"):
        read_bytes(tmp_path, rebuild(blob, {"graph.json": graph}, fix_hashes=False))


@pytest.mark.parametrize("damage, match", [
    ("signature", "graph.json has no local header where the zip's directory points"),
    ("name", "graph.json's local header disagrees with the zip's directory"),
    ("method", "graph.json's local header disagrees with the zip's directory"),
    ("extra", "runs past the end of the file"),
])
def test_a_member_whose_local_header_lies_is_refused(blob, tmp_path, damage, match):
    """Members are read from where their local header says their bytes start (not through
    zipfile, which copies them and checks a CRC as well): a header that is missing, names another
    member, says the bytes are compressed, or puts them past the file's end is refused in one line."""
    data = bytearray(blob)
    members = zipfile.ZipFile(io.BytesIO(blob)).infolist()
    info = next(i for i in members if i.filename == "graph.json")
    if damage == "extra":  # the member stored last: its bytes pushed past the end of the file
        info = max(members, key=lambda i: i.header_offset)
        match = f"{info.filename} {match}"
    at = info.header_offset
    if damage == "signature":
        data[at:at + 4] = b"PK\x05\x06"
    elif damage == "name":
        data[at + 30] ^= 0x20  # graph.json -> Graph.json
    elif damage == "method":
        data[at + 8:at + 10] = zipfile.ZIP_DEFLATED.to_bytes(2, "little")
    else:
        data[at + 28:at + 30] = (0xFFFF).to_bytes(2, "little")
    with pytest.raises(ArtifactError, match=match):
        read_bytes(tmp_path, bytes(data))


NEWER = r"format version 4, newer than the 3 this nimble \(0.1.0\) reads; it was written by nimble 0.1.0: upgrade"


@pytest.mark.parametrize("version,match", [(FORMAT_VERSION + 1, NEWER),
                                           (0, "no valid format_version"), ("1", "no valid format_version"),
                                           (None, "no valid format_version")])
def test_format_versions(blob, tmp_path, version, match):
    with pytest.raises(ArtifactError, match=match):
        read_bytes(tmp_path, rebuild(blob, {}, manifest_edit=lambda m: m.update(format_version=version)))


def test_absurd_declared_sizes(blob, tmp_path):
    def huge(m):
        m["members"]["weights.safetensors"]["size"] = 2**62

    with pytest.raises(ArtifactError, match="the manifest says"):
        read_bytes(tmp_path, rebuild(blob, {}, manifest_edit=huge))
    weights = members_of(blob)["weights.safetensors"]
    n = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + n])
    first = sorted(k for k in header if k != "__metadata__")[0]
    header[first]["shape"] = [2**40, 2**20]
    body = json.dumps(header).encode()
    bad = len(body).to_bytes(8, "little") + body + weights[8 + n:]
    with pytest.raises(ArtifactError, match="spans"):
        read_bytes(tmp_path, rebuild(blob, {"weights.safetensors": bad}))
    lying = (2**40).to_bytes(8, "little") + weights[8:]
    with pytest.raises(ArtifactError, match="header"):
        read_bytes(tmp_path, rebuild(blob, {"weights.safetensors": lying}))


def test_op_outside_the_allowlist(blob, tmp_path):
    def edit(doc):
        doc["ops"][0]["target"] = "aten::fft_fft.default"

    with pytest.raises(ArtifactError, match="not an allowlisted overload"):
        read_bytes(tmp_path, edit_json(blob, "graph.json", edit))


def test_op_missing_from_this_torch(blob, tmp_path):
    def edit(doc):
        doc["ops"][0]["target"] = doc["ops"][0]["target"].split(".")[0] + ".no_such_overload"

    with pytest.raises(ArtifactError, match="not an allowlisted overload"):
        read_bytes(tmp_path, edit_json(blob, "graph.json", edit))


def test_a_dropped_wait_makes_the_plan_unsafe(blob, tmp_path):
    def edit(doc):
        i = next(i for i, w in enumerate(doc["waits"]) if w)
        doc["waits"][i] = []

    with pytest.raises(ArtifactError, match="may start before"):
        read_bytes(tmp_path, edit_json(blob, "schedule.json", edit))


def test_overlapping_live_buffers_make_the_plan_unsafe(blob, tmp_path):
    def edit(doc):
        for entry in doc["buffers"]:
            entry[1] = 0
        doc["arena_bytes"] = doc["lower_bound_bytes"] = max(size for _, _, size in doc["buffers"])

    with pytest.raises(ArtifactError, match="overlap"):
        read_bytes(tmp_path, edit_json(blob, "memory.json", edit))


def mutate(doc, rng: random.Random):
    """Replace one random leaf of a JSON document with a hostile value."""
    path, node = [], doc
    while isinstance(node, (dict, list)) and node:
        key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        if rng.random() < 0.25 or not isinstance(node[key], (dict, list)) or not node[key]:
            break
        node = node[key]
    if not path:
        return doc
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = rng.choice([-1, 0, 10**12, 3.5, "x", None, True, [], {}, [[-5]], {"ref": 10**9}])
    return doc


@FUZZ
@given(member=st.sampled_from(["graph.json", "schedule.json", "memory.json", "manifest.json", "weights.safetensors"]),
       seed=st.integers(0, 2**32))
def test_hostile_members_end_in_one_clear_error(blob, compiled, tmp_path, member, seed):
    """Mutate one member, re-seal it, then read, preflight and run on the CPU: every outcome is a
    result or a NimbleError; never another exception, a hang or runaway memory."""
    import resource
    import time

    from nimble.errors import NimbleError
    from nimble.runtime.executable import Executable

    rng = random.Random(seed)
    if member == "manifest.json":
        data = rebuild(blob, {}, manifest_edit=lambda m: mutate(m, rng))
    elif member.endswith(".json"):
        data = edit_json(blob, member, lambda d: mutate(d, rng))
    else:
        raw = bytearray(members_of(blob)[member])
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(min(len(raw), 400))  # mostly the header
            raw[i] = rng.randrange(256)
        data = rebuild(blob, {member: bytes(raw)})
    start = time.monotonic()
    try:
        art = read_bytes(tmp_path, data)
        art.graph.lint()  # whatever passed is still a consistent artifact
        Executable(art, "cpu")(*art.sample_inputs)
    except NimbleError:
        pass
    assert time.monotonic() - start < 60, "a forged artifact kept nimble busy for a minute"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20, "peak RSS above 4 GiB"


def test_cli_reports_artifact_errors_in_one_line(blob, tmp_path):
    path = tmp_path / "bad.nimble"
    path.write_bytes(blob[:1000])
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "error:" in result.stderr
    missing = CliRunner().invoke(app, ["inspect", str(tmp_path / "none.nimble")])
    assert missing.exit_code == 1 and "no such file" in missing.stderr


def test_weights_are_standard_safetensors_readable_by_the_safetensors_library():
    import safetensors.torch

    from nimble.formats import tensors

    sample = {"b": torch.randn(3, 4), "a": torch.arange(6, dtype=torch.int64).reshape(2, 3),
              "h": torch.randn(5).to(torch.bfloat16), "m": torch.tensor([True, False]),
              "s": torch.tensor(2.5), "e": torch.zeros(0, 3), "t": torch.randn(4, 3).t()}
    blob = tensors.save(sample)
    theirs = safetensors.torch.load(blob)
    ours = tensors.load(bytearray(blob), "x", {k: (tensors.DTYPES[tensors._CODES[t.dtype]][0], tuple(t.shape))
                                             for k, t in sample.items()})
    for k, t in sample.items():
        assert torch.equal(theirs[k], t) and torch.equal(ours[k], t) and ours[k].dtype == t.dtype
    contiguous = {k: t.contiguous() for k, t in sample.items()}
    assert safetensors.torch.load(safetensors.torch.save(contiguous)).keys() == ours.keys()
