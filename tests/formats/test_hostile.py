"""A stranger's artifact cannot hurt the process (issue 17): each forgery below passes the hash
checks (forge.py re-seals them) and must end in one clear refusal, before any data moves.

Every check here is a pytest.raises or an explicit `fail`, never a bare assert, because the whole
file runs a second time under `python -O` (see the last test), which strips asserts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from nimble.cli.main import app
from nimble.errors import ArtifactError
from nimble.formats import read_artifact
from nimble.runtime.executable import Executable

from ..forge import ACTIVATION, Ref, edit_json, edit_text, forge, members_of, rebuild, spec, tiny

UNDER_O = os.environ.get("NIMBLE_HOSTILE_UNDER_O") == "1"


def expect(condition: bool, what: str) -> None:
    if not condition:
        pytest.fail(what)


def write(tmp_path, data: bytes, name: str = "forged.nimble"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def refused_on_read(tmp_path, data: bytes, match: str) -> None:
    with pytest.raises(ArtifactError, match=match):
        read_artifact(write(tmp_path, data))


def refused_on_load(tmp_path, data: bytes, match: str) -> None:
    """Read passes; loading for execution refuses before any op runs, and the CLI says so in one line."""
    path = write(tmp_path, data)
    art = read_artifact(path)
    with pytest.raises(ArtifactError, match=match):
        Executable(art, "cpu")
    result = CliRunner().invoke(app, ["run", str(path), "--device", "cpu", "--check"])
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("... ")]  # progress
    expect(result.exit_code == 1, f"exit {result.exit_code}: {result.stderr}")
    expect(len(lines) == 1 and lines[0].startswith("error:") and "internal error" not in result.stderr,
           result.stderr)


def relu_model(name: str = "y"):
    """x [1, 4] -> relu -> y: a valid artifact to edit."""
    values, ops = tiny(("aten::relu.default", (Ref(0),), [2], []),
                       extra_values=[(ACTIVATION, spec(1, 4), name, 0, None)])
    return forge(values, ops, outputs=[2])


# ------------------------------------------------------------------ 1. out-of-bounds views
def test_reshape_alias_cannot_view_past_its_buffer(tmp_path):
    values, ops = tiny(("aten::_reshape_alias.default", (Ref(0), (4096,), (1,)), [2], []),
                       ("aten::copy_.default", (Ref(2), Ref(1)), [3], [2]),
                       extra_values=[(ACTIVATION, spec(4096), "v", 0, 0), (ACTIVATION, spec(4096), "c", 1, 0)])
    refused_on_read(tmp_path, forge(values, ops, outputs=[3]), "not an allowlisted overload")


def test_a_view_declared_larger_than_its_root_is_refused_before_data_moves(tmp_path):
    values, ops = tiny(("aten::view.default", (Ref(0), (4096,)), [2], []),
                       ("aten::clone.default", (Ref(2),), [3], []),
                       extra_values=[(ACTIVATION, spec(4096), "v", 0, 0), (ACTIVATION, spec(4096), "c", 1, None)])
    refused_on_load(tmp_path, forge(values, ops, outputs=[3]), "spans 16384 bytes of a 16-byte buffer")


def test_a_view_of_a_weight_posing_as_a_view_of_the_input(tmp_path):
    values, ops = tiny(("aten::view.default", (Ref(1), (1, 4096)), [2], []),
                       ("aten::clone.default", (Ref(2),), [3], []),
                       extra_values=[(ACTIVATION, spec(1, 4096), "v", 0, 0), (ACTIVATION, spec(1, 4096), "c", 1, None)])
    refused_on_load(tmp_path, forge(values, ops, outputs=[3]), "spans|declared a view")


# ------------------------------------------------------------------ 2. lying specs
def test_expand_then_clone_cannot_allocate_past_its_spec(tmp_path):
    values, ops = tiny(("aten::expand.default", (Ref(0), (2**26, 4)), [2], []),
                       ("aten::clone.default", (Ref(2),), [3], []),
                       extra_values=[(ACTIVATION, spec(1, 4), "e", 0, 0), (ACTIVATION, spec(1, 4), "c", 1, None)])
    path = write(tmp_path, forge(values, ops, outputs=[3]))
    code = ("import resource, sys\nfrom nimble.errors import ArtifactError\nfrom nimble.formats import read_artifact\n"
            "from nimble.runtime.executable import Executable\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"try:\n    Executable(read_artifact({str(path)!r}), 'cpu')\nexcept ArtifactError as e:\n"
            "    print('refused', e)\n"
            "print('grew', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    expect("refused" in out.stdout and "computes float32[67108864, 4]" in out.stdout, out.stdout + out.stderr)
    grew_kib = int(out.stdout.split("grew")[1])
    expect(grew_kib < 256 * 1024, f"peak RSS grew by {grew_kib} KiB: the expand was materialized")


def test_a_result_of_another_dtype_than_declared(tmp_path):
    values, ops = tiny(("aten::relu.default", (Ref(0),), [2], []),
                       extra_values=[(ACTIVATION, spec(1, 4, dtype="float64"), "y", 0, None)])
    refused_on_load(tmp_path, forge(values, ops, outputs=[2]), "computes float32")


def test_a_view_declared_as_a_buffer_of_its_own(tmp_path):
    values, ops = tiny(("aten::view.default", (Ref(0), (4,)), [2], []),
                       extra_values=[(ACTIVATION, spec(4), "v", 0, None)])
    refused_on_load(tmp_path, forge(values, ops, outputs=[2]), "view of an input")


def test_a_fresh_result_declared_as_a_view(tmp_path):
    values, ops = tiny(("aten::relu.default", (Ref(0),), [2], []),
                       ("aten::clone.default", (Ref(2),), [3], []),
                       extra_values=[(ACTIVATION, spec(1, 4), "r", 0, 0), (ACTIVATION, spec(1, 4), "c", 1, None)])
    refused_on_load(tmp_path, forge(values, ops, outputs=[3]), "does not return one")


# ------------------------------------------------------------------ 3. the allowlist is exact
@pytest.mark.parametrize("target", ["aten::relu.__class__", "aten::relu.__init__", "aten::relu._op",
                                    "aten::relu.__setattr__", "aten::add.out", "aten::clamp_min.out",
                                    "aten::save.default", "aten::relu", "prim::Constant.default"])
def test_only_exact_allowlisted_overloads_pass(tmp_path, target):
    before = torch.ops.aten.relu._op
    data = edit_json(relu_model(), "graph.json", lambda g: g["ops"][0].update(target=target))
    refused_on_read(tmp_path, data, "not an allowlisted overload")
    expect(torch.ops.aten.relu._op is before, "torch.ops.aten.relu was modified")


# ------------------------------------------------------------------ 4. sizes and fields
@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(arena_bytes=2**60), "arena_bytes is"),
    (lambda m: m["buffers"][0].__setitem__(1, 2**60), "malformed, out of range"),
    (lambda m: m.update(alignment=1), "alignment is not 256"),
    (lambda m: m.update(lower_bound_bytes=-1), "inconsistent"),
    (lambda m: m["buffers"][0].__setitem__(2, 2**40), "malformed, out of range|buffers end"),
])
def test_memory_fields_are_bounded(tmp_path, edit, match):
    refused_on_read(tmp_path, edit_json(relu_model(), "memory.json", edit), match)


def test_a_huge_activation_is_refused_before_anything_is_allocated(tmp_path):
    data = edit_json(relu_model(), "graph.json", lambda g: g["values"][2].update(shape=[10**6, 10**6]))
    refused_on_read(tmp_path, data, "over the cap")


def test_too_many_dimensions(tmp_path):
    data = edit_json(relu_model(), "graph.json", lambda g: g["values"][2].update(shape=[1] * 40, strides=[]))
    refused_on_read(tmp_path, data, "more than 16 dimensions")


# ------------------------------------------------------------------ 5. parsing
def test_duplicate_keys_cannot_hide_a_target(tmp_path):
    data = edit_text(relu_model(), "graph.json",
                     lambda t: re.sub(r'"target":\s*"aten::relu.default"',
                                      '"target": "aten::save", "target": "aten::relu.default"', t, count=1))
    refused_on_read(tmp_path, data, "duplicate key 'target'")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_bare_non_finite_numbers_are_refused(tmp_path, constant):
    data = edit_text(relu_model(), "memory.json",
                     lambda t: re.sub(r'"lower_bound_bytes":', f'"x": {constant}, "lower_bound_bytes":', t, count=1))
    refused_on_read(tmp_path, data, f"bare {constant}")


def test_a_50_mib_manifest_string_is_refused_before_parsing(tmp_path):
    blob = relu_model()
    manifest = json.loads(members_of(blob)["manifest.json"])
    manifest["model"] = "m" * 50 * 2**20
    refused_on_read(tmp_path, rebuild(blob, {}, raw_manifest=json.dumps(manifest).encode()), "larger than")


def test_a_long_string_field_is_refused(tmp_path):
    data = edit_json(relu_model(), "graph.json", lambda g: g["values"][0].update(name="n" * 5000))
    refused_on_read(tmp_path, data, "longer than 4096")


# ------------------------------------------------------------------ 6. what lint guards, under -O too
def test_aliases_that_chain(tmp_path):
    values, ops = tiny(("aten::view.default", (Ref(0), (4,)), [2], []),
                       ("aten::view.default", (Ref(2), (2, 2)), [3], []),
                       extra_values=[(ACTIVATION, spec(4), "a", 0, 0), (ACTIVATION, spec(2, 2), "b", 1, 0)])
    data = edit_json(forge(values, ops, outputs=[3]), "graph.json", lambda g: g["values"][3].update(alias_of=2))
    refused_on_read(tmp_path, data, "not a root")


def test_an_activation_posing_as_an_input(tmp_path):
    data = edit_json(relu_model(), "graph.json", lambda g: g.update(inputs=[2]))
    refused_on_read(tmp_path, data, "inconsistent")


def test_a_value_that_lies_about_its_producer(tmp_path):
    values, ops = tiny(("aten::relu.default", (Ref(0),), [2], []), ("aten::relu.default", (Ref(2),), [3], []),
                       extra_values=[(ACTIVATION, spec(1, 4), "a", 0, None), (ACTIVATION, spec(1, 4), "b", 1, None)])

    def lie(g):
        g["values"][3]["producer"] = 0
    refused_on_read(tmp_path, edit_json(forge(values, ops, outputs=[3]), "graph.json", lie), "inconsistent")


# ------------------------------------------------------------------ 7. literal output
def test_names_print_literally(tmp_path):
    hostile = "y\x1b]0;pwned\x07\x1b[2J[link=https://evil.example]click[/link][bold]"
    path = write(tmp_path, relu_model(hostile))
    result = CliRunner().invoke(app, ["inspect", str(path)])
    expect(result.exit_code == 0, result.stderr)
    shown = result.stdout + result.stderr  # the table goes to stdout, messages to stderr
    expect("\x1b" not in shown and "\x07" not in shown, repr(shown))
    expect("[link=https://evil.example]click[/link]" in result.stdout, result.stdout)


# ------------------------------------------------------------------ 8. the same suite under python -O
def test_the_suite_holds_under_python_O():
    if UNDER_O:
        expect(sys.flags.optimize >= 1, "this run was meant to be under -O")
        return
    env = dict(os.environ, NIMBLE_HOSTILE_UNDER_O="1")
    out = subprocess.run([sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         capture_output=True, text=True, env=env, timeout=600)
    expect(out.returncode == 0 and " passed" in out.stdout and "failed" not in out.stdout,
           out.stdout[-3000:] + out.stderr[-2000:])
