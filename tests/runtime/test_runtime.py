"""The runtime on the CPU: placed execution, parity, and loading without re-planning."""

import json
from dataclasses import astuple, replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import nimble
from nimble.runtime.placed import reference
from nimble.cli.main import app
from nimble.errors import ShapeError
from nimble.formats import read_artifact

from ..conftest import MODELS
from ..models import FeedForward

runner = CliRunner()


@pytest.fixture(scope="module")
def artifacts(sample_artifacts):
    """name -> (path, the artifact as read back), for every sample model."""
    return {name: (path, read_artifact(path)) for name, path in sample_artifacts.items()}


def placement_errors(exe):
    base = exe.arena.data_ptr()
    env = exe.tensors()
    return [v.id for v in exe.graph.values
            if exe.memory.offset[v.id] is not None and env[v.id].data_ptr() - base != exe.memory.offset[v.id]]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cpu_executable_matches_and_uses_planned_offsets(artifacts, name):
    path, c = artifacts[name]
    exe = nimble.load(path, device="cpu")
    outs = exe.run(*c.sample_inputs)
    for o, r in zip(outs, c.sample_outputs):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    assert placement_errors(exe) == []
    x = [torch.randn_like(t) for t in c.sample_inputs]
    for o, r in zip(exe.run(*x), reference.run(exe.graph, exe.artifact.weights, x)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def test_loading_never_schedules_or_plans(artifacts, monkeypatch):
    import nimble.plan.memory
    import nimble.plan.schedule

    def forbidden(*args, **kwargs):
        raise AssertionError("loading must not schedule or plan")

    for module, names in ((nimble.plan.schedule, ("assign_streams", "schedule_dag", "_merge_chains")),
                          (nimble.plan.memory, ("plan", "_exact_bound", "_sweep", "_place"))):
        for n in names:
            monkeypatch.setattr(module, n, forbidden)
    path, c = artifacts["nasnet"]
    exe = nimble.load(path, device="cpu")
    exe(*c.sample_inputs)


def test_wrong_inputs_are_clear_errors(artifacts):
    path, c = artifacts["two_io"]
    exe = nimble.load(path, device="cpu")
    with pytest.raises(ShapeError, match=r"takes 2 input\(s\) \(image, features\), got 1"):
        exe(c.sample_inputs[0])
    with pytest.raises(ShapeError, match=r"input 'features' must be float32\[1, 8\], got float32\[2, 8\]"):
        exe(c.sample_inputs[0], torch.zeros(2, 8))
    with pytest.raises(ShapeError, match="must be float32"):
        exe(c.sample_inputs[0], torch.zeros(1, 8, dtype=torch.float64))


def test_run_check_passes_and_reports(artifacts):
    path, _ = artifacts["inception"]
    result = runner.invoke(app, ["run", str(path), "--check", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema_version"] == 2 and report["check"]["passed"]
    assert report["outputs"][0]["shape"] == [1, 10]
    assert "would pass" in result.stderr


def test_run_check_exits_3_on_a_mismatch(artifacts):
    path, _ = artifacts["inception"]
    result = runner.invoke(app, ["run", str(path), "--check", "--device", "cpu", "--rtol", "0", "--atol", "0"])
    assert result.exit_code in (0, 3)  # bit-exact runs are possible on the CPU
    if result.exit_code == 3:
        assert "would accept" in result.stderr and "Traceback" not in result.stderr


def test_run_inputs_from_files_and_outputs_to_safetensors(artifacts, tmp_path):
    import safetensors.torch

    path, c = artifacts["two_io"]
    np.save(tmp_path / "image.npy", c.sample_inputs[0].numpy())
    safetensors.torch.save_file({"features": c.sample_inputs[1]}, str(tmp_path / "f.safetensors"))
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["run", str(path), "--device", "cpu", "-i", f"image={tmp_path / 'image.npy'}",
                                 "-i", f"features={tmp_path / 'f.safetensors'}", "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    got = safetensors.torch.load_file(str(out))
    names = [c.graph.values[o].name for o in c.graph.outputs]
    for name, ref in zip(names, c.sample_outputs):
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("args,code,match", [
    (["-i", "nope=x.npy"], 2, "has no input 'nope'"),
    (["-i", "image=missing.npy", "-i", "features=missing.npy"], 1, "no such file"),
    (["-i", "image=x.txt"], 2, "no --input for features|.npy or .safetensors"),
    (["--random", "--check"], 2, "leave out --input and --random"),
])
def test_run_bad_inputs(artifacts, args, code, match, tmp_path):
    path, _ = artifacts["two_io"]
    (tmp_path / "x.txt").write_text("x")
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result = runner.invoke(app, ["run", str(path), "--device", "cpu", *args])
    finally:
        os.chdir(cwd)
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    import re

    assert re.search(match, result.stderr), result.stderr


def test_run_rejects_an_input_of_the_wrong_shape(artifacts, tmp_path):
    path, _ = artifacts["inception"]
    np.save(tmp_path / "x.npy", np.zeros((1, 3, 10, 10), dtype=np.float32))
    result = runner.invoke(app, ["run", str(path), "--device", "cpu", "-i", str(tmp_path / "x.npy")])
    assert result.exit_code == 1 and "must be float32[1, 3, 224, 224]" in result.stderr


def test_run_on_a_corrupt_artifact(tmp_path):
    bad = tmp_path / "bad.nimble"
    bad.write_bytes(b"PK\x03\x04 nope")
    result = runner.invoke(app, ["run", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.stderr and "error:" in result.stderr


def test_bench_json_report(artifacts, tmp_path):
    path, _ = artifacts["transformer"]
    times = tmp_path / "times.json"
    result = runner.invoke(app, ["bench", str(path), "--device", "cpu", "--iterations", "5", "--duration", "0", "--warmup-ms", "0",
                                 "--json", "--export-times", str(times)])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema_version"] == 2 and set(report["results"]) == {"nimble", "eager"}
    assert report["kernels"]["per_inference"] is None and report["tuning"]["choice"] is None  # the CPU: no tuning
    nimble_row = report["results"]["nimble"]
    assert nimble_row["iterations"] == 5 and nimble_row["min_ms"] <= nimble_row["median_ms"] <= nimble_row["max_ms"]
    assert {"p90_ms", "p95_ms", "p99_ms", "cv_percent", "throughput_per_s"} <= set(nimble_row)
    assert len(json.loads(times.read_text())) == 5


@pytest.mark.parametrize("args", [["--percentiles", "abc"], ["--iterations", "0"], ["--duration-s", "-1"],
                                  ["--warmup", "-5"]])
def test_bench_usage_errors(artifacts, args):
    path, _ = artifacts["transformer"]
    result = runner.invoke(app, ["bench", str(path), "--device", "cpu", *args])
    assert result.exit_code == 2 and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [
    ["compile", "{model}", "-s", "1x3x64x64", "-s", "1x8", "-o", "{tmp}", "--dot", "{missing}"],
    ["inspect", "{artifact}", "--dot", "{missing}"],
    ["run", "{artifact}", "--device", "cpu", "-o", "{missing}"],
    ["bench", "{artifact}", "--device", "cpu", "--export-times", "{missing}"],
])
def test_outputs_in_missing_folders_fail_before_any_work(artifacts, tmp_path, command):
    from ..conftest import SAMPLES

    values = {"model": str(SAMPLES / "two_io.pt"), "tmp": str(tmp_path), "artifact": str(artifacts["two_io"][0]),
              "missing": str(tmp_path / "nope" / "out.file")}
    result = runner.invoke(app, [part.format(**values) for part in command])
    assert result.exit_code == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "two_io.nimble").exists()


def test_file_system_errors_are_one_line(artifacts, tmp_path, monkeypatch):
    import nimble.fileio

    def denied(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(nimble.fileio, "write_atomic", denied)
    result = runner.invoke(app, ["run", str(artifacts["two_io"][0]), "--device", "cpu", "-o", str(tmp_path / "o.safetensors")])
    assert result.exit_code == 1 and "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert "Permission denied" in result.stderr and "o.safetensors" in result.stderr


def test_the_preflight_leaves_no_dynamo_stand_in_behind():
    """Python meta kernels marked `_disable_dynamo` find a stand-in torch._dynamo during the
    preflight; afterwards it is gone, and torch.compile in the same process works."""
    import subprocess
    import sys

    def python(body: str) -> str:
        """Run `body` in a fresh interpreter (where torch._dynamo is not imported yet); its stdout."""
        code = "import sys, torch\nfrom nimble.ops.shapes import without_dynamo_import\n" + body
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return out.stdout + out.stderr

    out = python("x = torch.empty(4, 8, device='meta')\n"
            "with without_dynamo_import():\n"
            "    torch.ops.aten.native_layer_norm.default(x, [8], None, None, 1e-5)\n"
            "    used = 'torch._dynamo' in sys.modules\n"
            "print('used', used, 'gone', 'torch._dynamo' not in sys.modules and '_dynamo' not in vars(torch))\n"
            "f = torch.compile(lambda t: t * 2 + 1, backend='eager')\n"
            "print('compiled', f(torch.ones(3)).tolist(), 'real', hasattr(sys.modules['torch._dynamo'], 'optimize'))\n")
    assert "used True gone True" in out, out
    assert "compiled [3.0, 3.0, 3.0] real True" in out, out
    out = python("with without_dynamo_import():\n"
                 "    import torch._dynamo\n"
                 "    config = torch._dynamo.config  # an attribute the stand-in lacks: the real module\n"
                 "print('real', hasattr(sys.modules['torch._dynamo'], 'optimize'))\n")
    assert "real True" in out, out


class _MaskedWindows(torch.nn.Module):
    """The ops of Hugging Face's attention masks (comparisons, &, where), GPT-2's GELU (pow),
    torch.mm, and swin_t's windows (roll, a cat of every other row and column, a pool of a
    permuted map)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x, mask):
        keep = (mask > 0) & (mask < 5)
        bias = torch.where(keep, 0.0, -1e4)
        y = torch.roll(x, shifts=(1, 1), dims=(1, 2))
        y = torch.cat([y[:, 0::2, 0::2], y[:, 1::2, 0::2], y[:, 0::2, 1::2], y[:, 1::2, 1::2]], -1)
        z = torch.mm(y.reshape(16, 16), self.w).pow(3)
        return z, torch.nn.functional.adaptive_avg_pool2d(y.permute(0, 3, 1, 2), 1), bias


def test_the_preflight_of_masks_and_windows_imports_no_sympy(tmp_path):
    """Every op of `_MaskedWindows` has a shape rule, so the preflight of its artifact in a fresh
    process imports neither sympy nor torch's symbolic shapes (1.8 s of BERT's, GPT-2's and
    swin_t's loads on the GPU machine, 2026-11-29)."""
    import subprocess
    import sys

    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    x, mask = torch.randn(1, 8, 8, 4), torch.randint(0, 8, (1, 8))
    torch.jit.trace(_MaskedWindows().eval(), (x, mask)).save(str(tmp_path / "m.pt"))
    compiled = compile_model(tmp_path / "m.pt", input_specs(["1x8x8x4", "1x8"], ["float32", "int64"]), device="cpu")
    targets = {op.target for op in compiled.graph.ops}
    assert {"aten::roll.default", "aten::cat.default", "aten::mm.default", "aten::adaptive_avg_pool2d.default"} <= targets
    write_artifact(tmp_path / "m.nimble", compiled.artifact())
    code = ("import sys; from nimble.formats import read_artifact; from nimble.runtime.placed.preflight import preflight; "
            f"art = read_artifact({str(tmp_path / 'm.nimble')!r}); preflight(art.graph, art.memory); "
            "print(sorted(m for m in ('sympy', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1:] == ["[]"], done.stdout + done.stderr


def test_channels_last_re_strides_every_plain_four_d_buffer(artifacts):
    """The frontends record contiguous strides explicitly; channels_last must still take those
    buffers (it once took none, so a channels_last choice changed only the weights)."""
    from nimble.ir import ACTIVATION
    from nimble.runtime.placed import placement
    from nimble.runtime.tune import choices as tuning

    _, art = artifacts["resnet"]
    g = art.graph
    shared = {v.alias_of for v in g.values if v.alias_of is not None}
    plain = {v.id for v in g.values if v.kind == ACTIVATION and v.alias_of is None and v.id not in shared
             and len(v.spec.shape) == 4}
    chosen = tuning.channels_last_values(g)
    assert plain and chosen == plain
    views = placement.arena_views(g, art.memory, torch.empty(art.memory.arena_bytes, dtype=torch.uint8), chosen)
    assert all(views[v].is_contiguous(memory_format=torch.channels_last) for v in chosen)
    assert all(v.spec.strides for v in g.values if v.id in chosen)  # declared, and contiguous


def test_pooling_whose_out_kernel_ignores_the_buffer_s_strides_never_writes_through_it(artifacts):
    """CUDA's average pooling out= kernel writes in its input's memory format whatever the buffer's
    (`placement.STRIDES_IGNORED`): where nimble's pooling kernel does not write the buffer, the
    pooling is computed and copied in, never issued through that overload; other ops keep theirs."""
    from nimble.runtime.placed import placement

    for name in ("inception", "nasnet"):
        placed = placement.prepare(artifacts[name][1].graph)
        pools = [p for p in placed if p.op.target in placement.STRIDES_IGNORED and len(p.op.outputs) == 1]
        assert pools and all(p.out_fn is None for p in pools)
        assert any(p.out_fn is not None for p in placed)


def test_a_separate_gemm_bias_is_a_candidate_only_where_a_float32_gemm_has_a_bias(artifacts):
    """Tuning times the GEMM bias apart from cuBLASLt's epilogue only where some float32 addmm or
    linear has a bias (the transformer's projections), after the other settings; on the CPU the
    substitute declines, and the op runs its own out= overload."""
    from nimble.runtime.placed import placement
    from nimble.runtime.tune import choices as tuning

    with_bias = artifacts["transformer"][1].graph
    gemms = [op for op in with_bias.ops if placement.BiasedGemm.applies(with_bias, op)]
    assert gemms
    options = tuning.candidates(with_bias, 1)
    assert {c.gemm_bias for c in options} == {"epilogue", "separate"}
    stages = list(tuning.stages(options))
    assert all(c.gemm_bias == "epilogue" for c in stages[0])
    best = stages[0][0]
    assert stages[-2](best) == [tuning.Choice(gemm_bias="separate")]
    assert stages[-1](best) == []  # no depthwise prologues: none found, and contiguous
    assert tuning.Choice(gemm_bias="separate").describe().endswith(", separate GEMM bias")
    assert "GEMM" not in tuning.Choice().describe()
    gemm = placement.BiasedGemm(gemms[0].target == "aten::linear.default")
    gemm.separate = True
    assert gemm([torch.zeros(8), torch.zeros(2, 4), torch.zeros(4, 8)], torch.empty(2, 8)) is None  # CPU
    exe = nimble.load(artifacts["transformer"][0], device="cpu")
    torch.testing.assert_close(exe.run(*artifacts["transformer"][1].sample_inputs)[0],
                               artifacts["transformer"][1].sample_outputs[0], rtol=1e-4, atol=1e-5)


def test_split_convolutions_are_timed_only_without_cudnn_graphs():
    """The split stage times the best fused candidate split; where cuDNN graphs run, each conv-led
    body was already timed against the split way, and the stage is empty."""
    from nimble.runtime.tune import choices as tuning

    options = tuning.every_choice()
    best = tuning.Choice(layout="channels_last", algorithms="benchmark")
    assert list(tuning.stages(options))[2](best) == [replace(best, convolutions="split")]
    assert list(tuning.stages(options, graphs=True))[2](best) == []
    assert list(tuning.stages(options, graphs=True))[0] == list(tuning.stages(options))[0]


@pytest.mark.parametrize("contiguous_ms, searched", [(1.2, True), (1.4, False)])
def test_contiguous_is_searched_only_where_its_provisional_build_comes_close(monkeypatch, contiguous_ms, searched):
    """Where cuDNN graphs run, channels_last is built first; contiguous is then built without
    cuDNN's plan search (`cudnn_graph.provisional`), and with it only where that took at most
    `provisional_layout` (1.3) times channels_last's time. A provisional build is never the
    choice, nor stored in the tuning cache."""
    import contextlib

    from nimble.runtime.base import footprint, timing
    from nimble.runtime.base.settings import Settings
    from nimble.runtime.kernels import cudnn_graph
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.tune import search as searching

    built, stored = [], {}
    ms = {("channels_last", False): 1.0, ("contiguous", True): contiguous_ms, ("contiguous", False): 0.9}

    def build(c):
        built.append((c, cudnn_graph._provisional.get()))
        return (c.layout, cudnn_graph._provisional.get(), c.streams)

    monkeypatch.setattr(cudnn_graph, "frontend", lambda: object())
    monkeypatch.setattr(timing, "gpu_ms", lambda replay, device: ms.get(replay[:2], 2.0))
    monkeypatch.setattr(footprint, "pool_segments", lambda device, pools: (0, 0))
    monkeypatch.setattr(tuning, "cache_key", lambda *a: "key")
    monkeypatch.setattr(tuning, "store", lambda key, choice, timings: stored.update(timings))
    options = [tuning.Choice(layout, s) for layout in tuning.LAYOUTS for s in ("planned", "serial")]
    found = searching.search(None, None, options, "full", None, Settings(), build, lambda: [], contextlib.nullcontext())
    layouts = [(c.layout, provisional) for c, provisional in built if c.streams == "planned"]
    assert layouts[:3] == [("channels_last", False), ("contiguous", True)] + [("contiguous", False)] * searched
    assert found.choice.layout == ("contiguous" if searched else "channels_last")
    assert "contiguous, planned streams, heuristic algorithms, cudnn-fused (provisional)" in found.timed
    assert not any(k.endswith("(provisional)") for k in stored) and len(stored) == len(found.timed) - 1
    assert found.built == (built[-1][0] == found.choice and not built[-1][1])
    built.clear()  # without cuDNN graphs, both layouts are built as they are, contiguous first
    monkeypatch.setattr(cudnn_graph, "frontend", lambda: None)
    searching.search(None, None, options, "full", None, Settings(), build, lambda: [], contextlib.nullcontext())
    assert [(c.layout, p) for c, p in built[:2]] == [("contiguous", False), ("channels_last", False)]


def test_a_choice_is_named_by_its_fields_in_order_and_nothing_else_names_one():
    from nimble.runtime.tune import choices as tuning

    assert tuning.choice_of("channels_last,serial") == tuning.Choice(layout="channels_last", streams="serial")
    assert tuning.choice_of("contiguous,planned,heuristic,cudnn-fused,epilogue,in depthwise") == \
        tuning.Choice(prologues="in depthwise")
    assert all(tuning.choice_of(",".join(astuple(c))) == c for c in tuning.every_choice())
    for text in ("nchw", "contiguous,planned,heuristic,cudnn-fused,epilogue,apart,extra", ""):
        assert tuning.choice_of(text) is None, text


def test_stream_candidates_cap_only_below_the_cuda_streams_the_plan_folds_onto(artifacts):
    """One CUDA stream: only the plan; two: the plan or serial; more: also at most `CAP`. The
    stream settings are timed together, after the best of the planned streams."""
    from nimble.runtime.tune import choices as tuning

    g = artifacts["transformer"][1].graph
    assert [{c.streams for c in tuning.candidates(g, n)} for n in (1, 2, 3)] == \
        [{"planned"}, {"planned", "serial"}, {"planned", f"at most {tuning.CAP}", "serial"}]
    assert [tuning.stream_cap(s) for s in tuning.STREAMS] == [None, tuning.CAP, 1]
    options = tuning.candidates(g, 3)
    best = tuning.Choice()
    assert [c.streams for c in list(tuning.stages(options))[3](best)] == [f"at most {tuning.CAP}", "serial"]
    assert tuning.Choice(streams=f"at most {tuning.CAP}").describe().startswith(f"contiguous, at most {tuning.CAP} streams")


def test_depthwise_prologues_are_a_channels_last_candidate_timed_last_and_kept_in_the_cache(artifacts, tmp_path,
                                                                                           monkeypatch):
    """Where prologue pairs exist, each channels_last candidate also comes with depthwise
    prologues; the first stage times none, the last times the best so far with them (nothing
    for a contiguous best), and the choice survives the tuning cache."""
    from nimble.runtime import pairs
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.executable import Executable

    g = artifacts["mobilenet"][1].graph
    exe = Executable(artifacts["mobilenet"][1], "cpu")  # the planned order, as a load finds its candidates under
    # its expansions feed depthwise convolutions, which no other pair takes
    assert pairs.find(g, exe._placed, exe._order, exe._stream_of, exe._waits, prologues=True).prologues
    without, paired = tuning.candidates(g, 2), tuning.candidates(g, 2, prologues=True)
    extra = [c for c in paired if c not in without]
    assert extra and all(c.layout == "channels_last" and c.prologues == tuning.PROLOGUES[1] for c in extra)
    assert len(extra) == len([c for c in without if c.layout == "channels_last"])
    stages = list(tuning.stages(paired))
    assert all(c.prologues == tuning.PROLOGUES[0] for c in stages[0])
    best = tuning.Choice(layout="channels_last")
    assert stages[-1](best) == [replace(best, prologues=tuning.PROLOGUES[1])]
    assert stages[-1](tuning.Choice()) == []  # contiguous: the depthwise kernel takes channels_last alone
    assert replace(best, prologues=tuning.PROLOGUES[1]).describe().endswith(", depthwise prologues")
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    tuning.store("k", replace(best, prologues=tuning.PROLOGUES[1]), {})
    assert tuning.cached("k") == replace(best, prologues=tuning.PROLOGUES[1])


def test_a_copying_reshape_or_contiguous_writes_its_buffer_in_one_copy():
    """A reshape the plan gave a buffer (its input allows no view) copies the input's elements
    once, in row-major order, into the buffer seen in the input's shape; contiguous copies in."""
    from nimble.runtime.placed import placement

    x = torch.randn(2, 3, 4, 5).permute(0, 2, 1, 3)  # (2, 4, 3, 5), no view to (8, 15)
    out = torch.empty(8, 15)
    assert placement.SUBSTITUTES["aten::reshape.default"]([x, (8, 15)], out) is out
    torch.testing.assert_close(out, x.reshape(8, 15), rtol=0, atol=0)
    flat = torch.empty(2, 60)
    assert placement.SUBSTITUTES["aten::flatten.using_ints"]([x, 1, -1], flat) is flat
    torch.testing.assert_close(flat, x.flatten(1), rtol=0, atol=0)
    strided = torch.empty(2, 5, 4, 3).permute(0, 3, 2, 1)  # a channels_last buffer: declined
    assert placement.SUBSTITUTES["aten::reshape.default"]([x.permute(0, 2, 1, 3), (2, 3, 4, 5)], strided) is None
    dense = torch.empty(2, 4, 3, 5)
    assert placement.SUBSTITUTES["aten::contiguous.default"]([x], dense) is dense
    torch.testing.assert_close(dense, x.contiguous(), rtol=0, atol=0)


def test_a_layer_norm_pairs_with_the_fused_op_before_it_only_where_it_is_issued_next(artifacts):
    """`norm_pairs`: a layer norm reading an elementwise fused op's result pairs with that op where
    it is the next op on the same stream and waits for nothing; the pair says whether anything
    else reads the fused result."""
    from nimble.ops import fusion
    from nimble.runtime import pairs as pairing
    from nimble.runtime.placed import placement

    g = artifacts["transformer"][1].graph
    placed = placement.prepare(g)
    n = len(g.ops)
    order = list(artifacts["transformer"][1].schedule.order)
    pairs = pairing.norm_pairs(g, placed, order, [0] * n, [()] * n)
    assert pairs
    for fused, (norm, store, kernel) in pairs.items():
        assert g.ops[fused].target in fusion.POINTWISE or kernel is placed[fused].substitute
        assert norm.op.target == "aten::layer_norm.default"
        assert norm.op.args[0].id == g.ops[fused].outputs[0] and order.index(norm.op.id) == order.index(fused) + 1
        others = {op.id for op in g.ops if g.ops[fused].outputs[0] in op.refs()} - {norm.op.id}
        assert store == bool(others or g.ops[fused].outputs[0] in g.outputs)
    norm = next(iter(pairs.values()))[0].op.id
    assert norm not in {p.op.id for p, *_ in pairing.norm_pairs(g, placed, [], [0] * n, [()] * n).values()}
    waits = [()] * n
    waits[norm] = (0,)  # a norm that waits for another stream stays on its own
    assert norm not in {p.op.id for p, *_ in pairing.norm_pairs(g, placed, order, [0] * n, waits).values()}
    apart = [k % 2 for k in range(n)]  # the fused op and its norm on different streams: no pair
    assert all(apart[f] == apart[p.op.id] for f, (p, *_) in pairing.norm_pairs(g, placed, order, apart,
                                                                                  [()] * n).items())


def test_a_product_pairs_with_the_elementwise_op_after_it_unless_that_op_takes_a_layer_norm(artifacts):
    """`product_pairs`: a float32 product whose one reader is an elementwise op of its shape,
    issued next on its stream and waiting for nothing, pairs with it, except where that op
    already pairs with the layer norm after it."""
    from nimble.runtime.kernels import gemm
    from nimble.runtime import pairs as pairing
    from nimble.runtime.placed import placement

    g = artifacts["transformer"][1].graph
    placed = placement.prepare(g)
    n = len(g.ops)
    order = list(artifacts["transformer"][1].schedule.order)
    heads = set(pairing.norm_pairs(g, placed, order, [0] * n, [()] * n))
    pairs = pairing.product_pairs(g, placed, order, [0] * n, [()] * n, heads)
    assert pairs
    for product, (second, _, through) in pairs.items():
        assert through is None  # the sample's linears write their result in the op's shape
        assert isinstance(placed[product].substitute, gemm.Gemm) and second.op.id not in heads
        assert order.index(second.op.id) == order.index(product) + 1
        value = g.ops[product].outputs[0]
        assert {op.id for op in g.ops if value in op.refs()} == {second.op.id} and value not in g.outputs
        assert g.values[second.op.outputs[0]].spec.shape == g.values[value].spec.shape
    assert len(pairing.product_pairs(g, placed, order, [0] * n, [()] * n)) > len(pairs) or not heads
    second = next(iter(pairs.values()))[0].op.id
    waits = [()] * n
    waits[second] = (0,)  # an op that waits for another stream stays on its own
    assert second not in {p.op.id for p, *_ in pairing.product_pairs(g, placed, order, [0] * n, waits, heads).values()}


def test_a_product_pairs_with_the_op_after_the_reshape_of_its_rows(tmp_path):
    """`product_pairs` through a reshape (GPT-2's `Conv1D`: addmm on rows, then a view as [B, T,
    N]): the op after the view pairs with the product, which binds the view itself; a second view
    of the product's result, or a reshape that waits for another stream, leaves them apart."""
    from nimble.ir import Ref
    from nimble.pipeline import compile_model
    from nimble.runtime import pairs as pairing
    from nimble.runtime.placed import placement
    from nimble.specs import input_specs

    path = tmp_path / "ff.pt"
    torch.jit.save(torch.jit.trace(FeedForward().eval(), torch.randn(2, 33, 96)), str(path))
    g = compile_model(path, input_specs(["2x33x96"]), device="cpu", check=False).graph
    placed, n = placement.prepare(g), len(g.ops)
    order = list(range(n))
    pairs = pairing.product_pairs(g, placed, order, [0] * n, [()] * n)
    assert len(pairs) == 2, [op.target for op in g.ops]  # GELU after the first, the residual add after the second
    for product, (second, _, (seen, shape)) in pairs.items():
        view = g.ops[product + 1]
        assert view.target == "aten::view.default" and view.outputs == (seen,) and second.op.id == product + 2
        assert shape == g.values[seen].spec.shape == g.values[second.op.outputs[0]].spec.shape
        assert Ref(seen) in second.op.args[0][0][1]  # the fused body reads the view
    product = min(pairs)
    waits = [()] * n
    waits[product + 1] = (0,)
    assert product not in pairing.product_pairs(g, placed, order, [0] * n, waits)
    # a second reader of the reshaped rows (here: the graph's output) leaves the pair apart
    g = replace(g, outputs=(*g.outputs, g.ops[product + 1].outputs[0]))
    assert product not in pairing.product_pairs(g, placed, order, [0] * n, [()] * n)


def test_a_product_read_through_views_by_a_copy_pairs_with_the_copy(tmp_path):
    """`scatter_pairs`: Swin's window merge (projection rows viewed as windows, permuted, then
    copied by a reshape) pairs the product with the copy; a wait before the copy, or a second
    reader of a view, leaves them apart."""
    from nimble.pipeline import compile_model
    from nimble.runtime import pairs as pairing
    from nimble.runtime.placed import placement
    from nimble.specs import input_specs

    from ..models import WindowMerge

    path = tmp_path / "windows.pt"
    torch.jit.save(torch.jit.trace(WindowMerge().eval(), torch.randn(2, 6, 9, 96)), str(path))
    g = compile_model(path, input_specs(["2x6x9x96"]), device="cpu", check=False).graph
    placed, n = placement.prepare(g), len(g.ops)
    order = list(range(n))
    pairs = pairing.scatter_pairs(g, placed, order, [0] * n, [()] * n)
    assert len(pairs) == 1, [op.target for op in g.ops]
    (product, (chain, copy)), = pairs.items()
    assert g.ops[product].target == "aten::linear.default"
    assert [v.op.target for v in chain] == ["aten::view.default", "aten::permute.default"]
    assert copy.op.target == "aten::reshape.default" and copy.op.id == product + 3
    waits = [()] * n
    waits[copy.op.id] = (0,)
    assert not pairing.scatter_pairs(g, placed, order, [0] * n, waits)
    g = replace(g, outputs=(*g.outputs, chain[1].op.outputs[0]))
    assert not pairing.scatter_pairs(g, placed, order, [0] * n, [()] * n)


@pytest.mark.parametrize("shape, views", [
    ((12, 9, 5), [("aten::view.default", ((2, 2, 3, 3, 3, 5),)), ("aten::permute.default", ((0, 1, 3, 2, 4, 5),))]),
    ((4, 9, 15), [("aten::transpose.int", (1, 2)), ("aten::reshape.default", ((4, 9, 15),))]),
    ((12, 15), [("aten::view.default", ((4, 3, 15),)), ("aten::permute.default", ((2, 0, 1),)),
                ("aten::view.default", ((-1,),))]),
])
def test_a_copy_s_buffer_seen_back_through_the_views_takes_the_product_in_row_major_order(shape, views):
    """What the product's kernel stores at element i of the tensor `_seen_back` gives, in
    row-major order, is what the copy of the product's views holds: the copy made by storing."""
    from nimble.ir import Op
    from nimble.runtime.pairs.scatter import seen_back as _seen_back, viewed as _viewed

    out = torch.randn(shape)
    chain = [Op(k, target, (None, *args), (), (k,), (), (), "") for k, (target, args) in enumerate(views)]
    seen = out
    for view in chain:
        seen = _viewed(view, seen)
    want = seen.reshape(-1)  # the copy: its buffer dense, in the last view's row-major order
    target = torch.empty(want.shape)
    into = _seen_back(chain, target, out)
    assert into is not None and into.numel() == out.numel()
    into.copy_(out.reshape(into.shape))  # element i of `out` to element i of `into`, both row-major
    torch.testing.assert_close(target, want, rtol=0, atol=0)


def test_a_head_merge_copies_the_attention_result_once_only_where_it_is_issued_next(artifacts):
    """`copy_pairs`: an op with no out= kernel (attention) whose one reader is a view (the head
    transpose) whose one reader copies it (contiguous or reshape) pairs with both, where the view
    and the copy are the next ops on its stream and wait for nothing."""
    from nimble.runtime import pairs as pairing
    from nimble.runtime.placed import placement

    art = artifacts["vit"][1]
    g = art.graph
    placed = placement.prepare(g)
    n, order = len(g.ops), list(art.schedule.order)
    pairs = pairing.copy_pairs(g, placed, order, [0] * n, [()] * n)
    assert pairs
    for op, (view, copy) in pairs.items():
        assert g.ops[op].target == "aten::scaled_dot_product_attention.default"
        assert g.values[view.op.outputs[0]].alias_of == g.ops[op].outputs[0]
        assert copy.op.target in pairing.copies.COPYING_READERS and copy.op.args[0].id == view.op.outputs[0]
        assert order.index(copy.op.id) == order.index(view.op.id) + 1 == order.index(op) + 2
    first, (view, copy) = next(iter(pairs.items()))
    waits = [()] * n
    waits[copy.op.id] = (0,)
    assert first not in pairing.copy_pairs(g, placed, order, [0] * n, waits)
    moved = [k % 2 for k in range(n)]
    moved[first], moved[view.op.id], moved[copy.op.id] = 0, 0, 1
    assert first not in pairing.copy_pairs(g, placed, order, moved, [()] * n)


def test_benchmarked_algorithms_are_timed_after_the_layouts_and_must_win_by_their_margin():
    """The first stage times layouts with cuDNN's heuristic algorithms; the next, the best of them
    with benchmarked ones, which win only where they take at most `benchmark_slower` times the
    best other candidate, since each process that loads pays their search again."""
    from nimble.runtime.base.settings import DEFAULT, Settings
    from nimble.runtime.tune import choices as tuning

    options = tuning.every_choice()
    stages = list(tuning.stages(options))
    assert {c.algorithms for c in stages[0]} == {"heuristic"}
    assert {c.layout for c in stages[0]} == set(tuning.LAYOUTS)
    best = tuning.Choice(layout="channels_last")
    benchmarked = replace(best, algorithms="benchmark")
    assert stages[1](best) == [benchmarked]
    assert stages[1](benchmarked) == [benchmarked]  # replace is idempotent; the search never gets here twice
    slower = DEFAULT.benchmark_slower
    ms = {best.describe(): 1.0, benchmarked.describe(): slower + 0.005}
    assert tuning.pick([best, benchmarked], ms, {}) == best  # faster, but not by enough
    ms[benchmarked.describe()] = slower - 0.005
    assert tuning.pick([best, benchmarked], ms, {}) == benchmarked
    assert tuning.pick([best, benchmarked], ms, {}, Settings(benchmark_slower=0.0)) == best  # never
    assert tuning.pick([best, benchmarked], {k: 1.0 for k in ms}, {}, Settings(benchmark_slower=1.0)) == best
    assert tuning.pick([benchmarked], ms, {}) == benchmarked  # the only one timed


def test_tuning_picks_a_leaner_candidate_only_within_its_slack():
    from nimble.runtime.base.settings import DEFAULT
    from nimble.runtime.tune.choices import Choice, pick

    MEMORY_SLACK, MEMORY_WORTH = DEFAULT.memory_slack, DEFAULT.memory_worth

    fast, lean, leaner = Choice(), Choice(streams="serial"), Choice(layout="channels_last")
    options = [fast, lean, leaner]
    ms = {fast.describe(): 1.0, lean.describe(): 1.0 + MEMORY_SLACK / 2, leaner.describe(): 1.0 + 2 * MEMORY_SLACK}
    pool = {fast.describe(): 60 * 2**20, lean.describe(): 60 * 2**20 - MEMORY_WORTH, leaner.describe(): 0}
    assert pick(options, ms, pool) == lean  # the leaner one is too slow
    assert pick(options, ms, {**pool, lean.describe(): 60 * 2**20 - MEMORY_WORTH + 1}) == fast  # saves too little
    assert pick(options, {**ms, leaner.describe(): 1.0 + MEMORY_SLACK}, pool) == leaner  # the least memory wins
    assert pick(options, {k: 1.0 for k in ms}, {}) == fast  # nothing known of memory: the first fastest
    assert pick(options, ms, {fast.describe(): 60 * 2**20}) == lean  # a candidate whose pool is unknown holds none


def test_a_convolution_into_a_buffer_that_is_not_dense_is_computed_and_copied(monkeypatch):
    """`kernels.conv_into` hands cuDNN's out= overload a dense buffer only: into a channel slice
    of a larger buffer it writes wrong values (H100, torch 2.11), so such a slice gets the
    result copied in. The backend is faked as cuDNN; the out= overload must not be reached."""
    import torch.nn.functional as F

    from nimble.runtime.kernels import fused as kernels

    calls = []
    monkeypatch.setattr(torch._C, "_select_conv_backend", lambda *a: torch._C._ConvBackend.Cudnn)
    monkeypatch.setattr(torch.ops.aten, "cudnn_convolution", type("Fake", (), {
        "out": staticmethod(lambda *a, out: calls.append(out.shape))}))
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 4, 6, 6, generator=g), torch.randn(8, 4, 3, 3, generator=g), torch.randn(8, generator=g)
    p = {"input": x, "weight": w, "bias": b, "stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    for layout in (torch.contiguous_format, torch.channels_last):
        whole = torch.zeros(2, 16, 6, 6).contiguous(memory_format=layout)
        kernels.conv_into(p, whole.narrow(1, 8, 8), with_bias=True)
        torch.testing.assert_close(whole[:, 8:], F.conv2d(x, w, b, padding=1))
        assert whole[:, :8].eq(0).all() and calls == []
    kernels.conv_into(p, torch.empty(2, 8, 6, 6))  # a dense buffer still takes the out= overload
    assert calls == [(2, 8, 6, 6)]


def test_a_forced_choice_that_is_no_load_time_choice_is_refused_in_one_line(artifacts):
    from nimble.errors import UsageError
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.executable import Executable

    art = artifacts["resnet"][1]
    with pytest.raises(UsageError, match="no load-time choice.*PROLOGUES"):
        Executable(art, "cpu", choice=tuning.Choice(layout="channel_last"))
    Executable(art, "cpu", choice=tuning.Choice(layout="channels_last", prologues=tuning.PROLOGUES[1]))


def test_close_drops_the_calls_that_bare_and_deferred_kernels_keep(artifacts):
    """A bare or deferred fused op keeps its last call's body and buffer (views of the arena) for
    its reader; close drops them, so a closed executable that is still referenced holds no arena."""
    import weakref

    from nimble.runtime.kernels import fused as kernels
    exe = nimble.load(artifacts["mobilenet"][0], device="cpu")
    fused = [p.substitute for p in exe._placed if isinstance(p.substitute, kernels.FusedKernel)]
    assert fused
    arena = exe.arena
    gone = weakref.ref(arena)
    view = arena[:8]
    fused[0].wrote_bare, fused[0].bare_out, fused[-1].deferred_call = [("body", (view,), ())], view, ([], view)
    del arena, view
    exe.close()
    assert all(k.wrote_bare is None and k.bare_out is None and k.deferred_call is None for k in fused)
    assert gone() is None


def test_a_body_signature_leaves_no_reference_cycle_holding_its_operands():
    """A kernel's call signature names its operands; working it out must not leave a reference
    cycle that holds them (views of the arena) until the garbage collector runs: the capture
    turns the collector off, and a closed executable would keep its arena reserved."""
    import gc
    import weakref

    from nimble.runtime.kernels.codegen import body_signature
    x = torch.ones(4)
    gone = weakref.ref(x)
    gc.disable()
    try:
        signature = body_signature([("aten.mul.Tensor", (x, [x, 2.0]), (("alpha", x),))], [x])
        del x
        assert gone() is None
    finally:
        gc.enable()
    assert signature == (("aten.mul.Tensor", (("operand", 0), (("operand", 0), 2.0)), (("alpha", ("operand", 0)),)),)
