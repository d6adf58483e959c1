"""Artifacts of several batch sizes (`compile --batch-sizes`): compiled, written, read back, refused
when crafted, and run at every batch from 1 to the largest, on the CPU and (marked gpu) on CUDA."""

import json

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

import nimble
from nimble.cli.main import app
from nimble.errors import ArtifactError, MismatchError, ShapeError, UsageError
from nimble.formats import read_artifact, write_artifact
from nimble.formats.artifact import encode
from nimble.pipeline import compile_model
from nimble.specs import input_specs, parse_batch_sizes

from ..conftest import SAMPLES, save_script
from ..forge import edit_json, members_of, rebuild

SIZES = [1, 2, 4]


@pytest.fixture(scope="module")
def compiled():
    return compile_model(SAMPLES / "two_io.pt", input_specs(["1x3x64x64", "1x8"]), device="cpu", batch_sizes=SIZES)


@pytest.fixture(scope="module")
def blob(compiled):
    return encode(compiled.artifact())


@pytest.fixture
def path(blob, tmp_path):
    p = tmp_path / "two_io.nimble"
    p.write_bytes(blob)
    return p


def inputs(batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 64, 64, generator=gen), torch.randn(batch, 8, generator=gen)


def test_one_artifact_holds_a_plan_per_batch_size_and_one_copy_of_the_weights(compiled, path):
    art = read_artifact(path)
    assert art.batch_sizes == SIZES and art.manifest["batch_sizes"] == SIZES and art.manifest["format_version"] == 3
    for b in SIZES:
        one = art.for_batch(b)
        assert [one.graph.values[i].spec.shape[0] for i in one.graph.inputs] == [b, b]
        assert [x.shape[0] for x in one.sample_inputs] == [b, b]
        assert one.weights is art.weights
    single = compile_model(SAMPLES / "two_io.pt", input_specs(["1x3x64x64", "1x8"]), device="cpu")
    assert len(encode(single.artifact())) < len(encode(compiled.artifact())) < 1.5 * len(encode(single.artifact()))
    assert encode(compiled.artifact()) == encode(compile_model(SAMPLES / "two_io.pt", input_specs(
        ["1x3x64x64", "1x8"]), device="cpu", batch_sizes=SIZES).artifact())  # reproducible bytes


def test_every_batch_up_to_the_largest_runs_as_the_module_does(path):
    module = torch.jit.load(str(SAMPLES / "two_io.pt")).eval()
    with nimble.load(path, device="cpu") as exe:
        assert exe.batch_sizes == SIZES
        for b in (1, 2, 3, 4):
            xs = inputs(b, seed=b)
            got, want = exe(*xs), module(*xs)
            assert [g.shape[0] for g in got] == [b, b]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        assert exe.executable_for(3) is exe.executable(4)
        exe.verify()
        with pytest.raises(ShapeError, match="runs batches of 1 to 4 rows"):
            exe(*inputs(5))
        with pytest.raises(ShapeError, match="different batch sizes"):
            exe(inputs(2)[0], inputs(3)[1])
        with pytest.raises(ShapeError, match=r"\[B, 3, 64, 64\]"):
            exe(torch.randn(2, 3, 32, 32), inputs(2)[1])
        with pytest.raises(UsageError, match="no graph for batch 3"):
            exe.executable(3)
    with pytest.raises(UsageError, match="closed"):
        exe(*inputs(1))


def test_the_batch_sizes_share_the_weights(path):
    with nimble.load(path, device="cpu") as exe:
        small, large = exe.executable(1), exe.executable(4)
        assert small.arena is large.arena
        shared = {t.data_ptr() for t in large._stored_weights.values()}
        assert {t.data_ptr() for t in small._stored_weights.values()} == shared


def test_cli_shows_and_times_every_batch_size(path):
    runner = CliRunner()
    doc = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert doc["batch_sizes"] == SIZES and [b["batch"] for b in doc["batches"]] == [2, 4]
    result = runner.invoke(app, ["bench", str(path), "--device", "cpu", "--duration", "0", "-n", "3",
                                 "--no-baselines", "--json", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["batch"] == 2 and [b["batch"] for b in doc["batch_sizes"]] == SIZES
    assert all(b["rows_per_s"] == pytest.approx(b["inferences_per_s"] * b["batch"]) for b in doc["batch_sizes"])
    result = runner.invoke(app, ["bench", str(path), "--device", "cpu", "--batch-size", "3"])
    assert result.exit_code == 2 and "no graph for batch 3" in result.output
    result = runner.invoke(app, ["run", str(path), "--device", "cpu", "--check"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("text,sizes", [("1,2,4", [1, 2, 4]), ("8, 1,1", [1, 8]), ("", None)])
def test_batch_sizes_parse(text, sizes):
    assert parse_batch_sizes(text) == sizes


@pytest.mark.parametrize("text", ["0,1", "a", "1;2", "-1", ",".join(map(str, range(1, 20))), "99999999"])
def test_bad_batch_sizes_get_one_line(text, tmp_path):
    result = CliRunner().invoke(app, ["compile", str(SAMPLES / "resnet.pt"), "-s", "1x3x64x64", "--batch-sizes",
                                      text, "-o", str(tmp_path / "r.nimble")])
    assert result.exit_code == 2 and "--batch-sizes" in result.output
    assert not (tmp_path / "r.nimble").exists()


class MixesRows(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_a_model_that_mixes_the_rows_of_a_batch_is_refused(tmp_path):
    model = save_script(tmp_path, MixesRows(), "mixes")
    with pytest.raises(MismatchError, match="mixes the rows of a batch"):
        compile_model(model, input_specs(["2x5"]), device="cpu", batch_sizes=[2, 4])
    compile_model(model, input_specs(["2x5"]), device="cpu")  # one batch size is fine


class BatchShapedMask(nn.Module):
    """A mask built in forward from shapes alone (Swin's way: new_zeros, then a slice fill), with
    one row per row of the batch: constant, and shaped by the batch."""

    def forward(self, x):
        mask = x.new_zeros((x.shape[0], 5))
        mask[:, 1:] = 1.0
        return x * mask


def test_a_multi_batch_artifact_folds_no_constants_that_the_batch_shapes(tmp_path):
    model = save_script(tmp_path, BatchShapedMask(), "mask")
    one = compile_model(model, input_specs(["2x5"]), device="cpu")
    assert any(v.name.endswith("_folded") for v in one.graph.values)  # alone, the mask folds
    several = compile_model(model, input_specs(["2x5"]), device="cpu", batch_sizes=[2, 4])
    assert not any(v.name.endswith("_folded") for c in (several, *several.others) for v in c.graph.values)


def test_a_pt2_with_a_dynamic_batch_compiles_for_each_size(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            return torch.relu(self.fc(x))

    net = Net().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(net, (torch.randn(2, 6),), dynamic_shapes=({0: batch},))
    pt2 = tmp_path / "net.pt2"
    torch.export.save(program, str(pt2))
    compiled = compile_model(pt2, None, device="cpu", batch_sizes=[1, 8])
    assert compiled.batch_sizes == [1, 8]
    out = tmp_path / "net.nimble"
    write_artifact(out, compiled.artifact())
    with nimble.load(out, device="cpu") as exe:
        x = torch.randn(5, 6)
        torch.testing.assert_close(exe(x), net(x), rtol=1e-4, atol=1e-5)


# --- crafted files: each refused in one line before anything runs -------------------------------------------
def read_bytes(tmp_path, data: bytes):
    p = tmp_path / "a.nimble"
    p.write_bytes(data)
    return read_artifact(p)


def test_crafted_batch_sizes_are_refused(blob, tmp_path):
    cases = [
        (lambda m: m.update(batch_sizes=[1, 4, 2]), "'batch_sizes' is malformed"),
        (lambda m: m.update(batch_sizes=[1]), "'batch_sizes' is malformed"),
        (lambda m: m.update(batch_sizes=[1, 2, 4, 8]), "no valid sha256 and size for batch/8/graph.json"),
        (lambda m: m.update(batch_sizes=[1, 2]), "unexpected"),
        (lambda m: m.update(batch_sizes=[1, True, 4]), "'batch_sizes' is malformed"),
        (lambda m: m.update(batch_sizes="1,2,4"), "'batch_sizes' is malformed"),
    ]
    for edit, match in cases:
        with pytest.raises(ArtifactError, match=match):
            read_bytes(tmp_path, rebuild(blob, {}, manifest_edit=edit))


def test_a_batch_graph_that_does_not_match_the_first_is_refused(blob, tmp_path):
    def grow_input(doc):
        doc["values"][doc["inputs"][0]]["shape"][1] = 4

    forged = edit_json(blob, "batch/2/graph.json", grow_input)
    with pytest.raises(ArtifactError, match="batch 2"):
        read_bytes(tmp_path, forged)
    # the top-level plans put under batch 2: its inputs are batch 1's, not batch 2's
    top = members_of(blob)
    swapped = rebuild(blob, {f"batch/2/{m}": top[m] for m in ("graph.json", "schedule.json", "memory.json")})
    with pytest.raises(ArtifactError, match="batch 2: its inputs are not those of batch 1 with a first dimension of 2"):
        read_bytes(tmp_path, swapped)


def test_the_first_batch_size_must_be_the_graphs(blob, tmp_path):
    dropped = {f"batch/2/{m}": None for m in ("graph.json", "schedule.json", "memory.json")}
    with pytest.raises(ArtifactError, match="the first batch size in the manifest, 2, is not the graph's"):
        read_bytes(tmp_path, rebuild(blob, dropped, manifest_edit=lambda m: (
            m.update(batch_sizes=[2, 4]), [m["members"].pop(k) for k in list(m["members"]) if k.startswith("batch/2/")])))


@pytest.mark.gpu
def test_on_cuda_each_batch_size_is_a_graph_on_one_arena_and_one_copy_of_the_weights(tmp_path):
    compiled = compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x64x64"]), device="cpu", batch_sizes=[1, 2, 8])
    out = tmp_path / "resnet.nimble"
    write_artifact(out, compiled.artifact())
    module = torch.jit.load(str(SAMPLES / "resnet.pt")).eval().cuda()
    weights = sum(t.numel() * t.element_size() for t in compiled.weights.values())
    with nimble.load(out, device="cuda", tune="off", verify=True) as exe:
        sizes = exe.batch_sizes
        assert sizes == [1, 2, 8]
        arenas = {exe.executable(b).arena.data_ptr() for b in sizes}
        assert len(arenas) == 1 and exe.executable(8).arena.numel() >= max(m for m in (
            exe.executable(b).memory.arena_bytes for b in sizes))
        assert all(exe.executable(b)._cuda_graph is not None for b in sizes)
        # one set of CUDA streams (each new one would get its own 32 MiB cuBLAS workspace) and
        # one set of cuDNN graph workspaces for every batch size
        assert len({id(exe.executable(b)._streams) for b in sizes}) == 1
        assert len({id(exe.executable(b)._cudnn_workspaces) for b in sizes}) == 1
        fp = exe.stats.footprint
        assert fp.weights == weights  # counted, and held, once
        for b in (1, 2, 3, 5, 8):
            x = torch.randn(b, 3, 64, 64, device="cuda")
            with torch.no_grad():
                want = module(x)
            got = exe(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)  # TF32 convolutions
    torch.cuda.synchronize()


def test_blocks_of_checked_rows_run_as_their_concatenation_would(path):
    """`run_rows`: a server's requests go straight into the input buffers at their rows (the rest
    zeroed, as padding is), and the outputs are those of the concatenated batch."""
    exe = nimble.load(path, device="cpu")
    a, b = inputs(1, seed=1), inputs(2, seed=2)
    got = [o.clone() for o in exe.run_rows([list(a), list(b)])]  # 3 rows: the batch size 4, one row of padding
    want = exe.run(*(torch.cat([x, y]) for x, y in zip(a, b)))
    assert [tuple(o.shape) for o in got] == [tuple(w.shape) for w in want] and got[0].shape[0] == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
