"""The one instrument (`stages.Stages`): each second is counted once, under the innermost stage
running, and a pass that breaks the graph is named."""

import dataclasses
import time

import pytest

from nimble.errors import GraphError
from nimble.pipeline import PASSES, compile_model
from nimble.specs import input_specs
from nimble.stages import Stages

from ..conftest import SAMPLES

PASS_NAMES = [p.__name__ for p in PASSES]


def test_a_nested_stage_is_counted_once():
    stages, seen = Stages(), []
    stages._progress = seen.append
    t = time.perf_counter()
    with stages.stage("tuning"):
        time.sleep(0.02)
        with stages.stage("warmup", "warming up"):
            time.sleep(0.03)
        with stages.stage("warmup"):
            time.sleep(0.01)
    wall = time.perf_counter() - t
    assert seen == ["tuning", "warming up", "warmup"]
    assert stages.seconds["warmup"] >= 0.04 and 0.02 <= stages.seconds["tuning"] < 0.04
    assert sum(stages.seconds.values()) == pytest.approx(wall, abs=0.005)
    stages.move("warmup", "kernels", 0.01)
    assert stages.seconds["kernels"] == pytest.approx(0.01) and sum(stages.seconds.values()) == pytest.approx(wall, abs=0.005)


def test_a_pass_that_breaks_the_graph_is_named():
    c = compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu", fuse=False)

    def drop_the_producer(graph):
        return dataclasses.replace(graph, ops=graph.ops[1:])

    with pytest.raises(GraphError, match="pass drop_the_producer broke the graph"):
        Stages().run_passes(c.graph, c.weights, [drop_the_producer])


def test_compile_times_every_stage_and_pass_once_and_logs_op_counts():
    c = compile_model(SAMPLES / "inception.pt", input_specs(["1x3x64x64"]), device="cpu")
    assert list(c.seconds) == ["load", "lower", *PASS_NAMES, "check", "schedule", "memory"]
    names = [name for name, _ in c.passes]
    assert names == ["lowered", *PASS_NAMES] and c.passes[-1][1] == len(c.graph.ops)
    assert c.lowered_ops == c.passes[0][1] > len(c.graph.ops)


def test_compile_json_inspect_and_the_manifest_name_the_passes(tmp_path):
    import json

    from nimble.errors import ArtifactError
    from nimble.formats import read_artifact

    from ..forge import rebuild
    from ..cli.test_cli import invoke

    out = tmp_path / "inception.nimble"
    result = invoke("compile", SAMPLES / "inception.pt", "-s", "1x3x64x64", "--device", "cpu", "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    printed = json.loads(result.stdout)["passes"]
    assert [p["pass"] for p in printed] == ["lowered", *PASS_NAMES]
    assert json.loads(invoke("inspect", out, "--json").stdout)["passes"] == printed
    shown = " ".join(invoke("inspect", out, "--no-ops").stdout.split())  # the passes that changed the op count
    unchanged = len(PASS_NAMES) - 1
    assert f"lowered 71 ops, fuse_conv 71 -> 42; {unchanged} more passes changed no op count" in shown
    assert read_artifact(out).passes == [(p["pass"], p["ops"]) for p in printed]
    bad = tmp_path / "bad.nimble"
    bad.write_bytes(rebuild(out.read_bytes(), {}, manifest_edit=lambda m: m.__setitem__("passes", [["x", -1]])))
    with pytest.raises(ArtifactError, match="'passes' is malformed"):
        read_artifact(bad)
