"""The CUDA runtime: parity, races, placement and real parallelism. Run with `pytest -m gpu`."""

import gc
import re

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

import nimble
from nimble.ops import fusion
from nimble.runtime.placed import reference
from nimble.runtime.base import regions
from nimble.cli.main import app
from nimble.runtime.base.compare import compare
from nimble.formats import read_artifact, write_artifact
from nimble.pipeline import compile_model
from nimble.runtime.executable import Executable
from nimble.specs import input_specs

from ..conftest import MODELS, SAMPLES, save_script

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def artifacts(sample_artifacts):
    return sample_artifacts


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parity_and_placement_on_cuda(artifacts, name):
    exe = nimble.load(artifacts[name], device="cuda")
    outs = exe.run(*exe.artifact.sample_inputs)
    result = compare(outs, exe.artifact.sample_outputs, rtol=1e-2, atol=1e-3)
    assert result.passed, result.describe()
    base, env = exe.arena.data_ptr(), exe.tensors()
    planned = [v.id for v in exe.graph.values if exe.memory.offset[v.id] is not None]
    assert planned
    fused = {op.outputs[0]: op for op in exe.graph.ops if op.target == fusion.FUSED}
    elsewhere = exe.outside_arena()  # only cuDNN's fused convolutions allocate their own result
    assert all(fusion.convolution_pattern(fusion.body_of(fused[vid])) for vid in elsewhere)
    for vid in set(planned) - set(elsewhere):
        assert env[vid].is_cuda and env[vid].data_ptr() - base == exe.memory.offset[vid], vid


@pytest.mark.parametrize("name", ["inception", "nasnet", "transformer", "two_io"])
def test_100_replays_with_fresh_inputs_agree_with_serial_execution(artifacts, name):
    exe = nimble.load(artifacts[name], device="cuda")
    weights = {k: t.cuda() for k, t in exe.artifact.weights.items()}
    torch.manual_seed(0)
    for _ in range(100):
        xs = [torch.randn_like(t).cuda() for t in exe.artifact.sample_inputs]
        got = exe.run(*xs, copy=False)
        want = reference.run(exe.graph, weights, xs, "cuda")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_run_check_passes(artifacts, name):
    result = CliRunner().invoke(app, ["run", str(artifacts[name]), "--check", "--device", "cuda"])
    assert result.exit_code == 0, result.stderr


def _graph_shape(dot_text: str) -> tuple[int, int, int]:
    """(nodes without predecessors, most successors, most predecessors) of the nodes on edges of
    a CUDA graph's DOT dump. A chain gives (1, 1, 1); parallel branches start at several roots or
    at a fork, and end at a join."""
    edges = re.findall(r'"?(\w+)"?\s*->\s*"?(\w+)"?', dot_text)
    succ, pred = {}, {}
    for a, b in edges:
        succ[a] = succ.get(a, 0) + 1
        pred[b] = pred.get(b, 0) + 1
    roots = {n for e in edges for n in e} - set(pred)
    return len(roots), max(succ.values(), default=0), max(pred.values(), default=0)


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
        self.b = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_the_captured_graph_really_forks_into_parallel_branches(tmp_path):
    path = save_script(tmp_path, TwoBranches().eval(), "two_branches")
    shapes = {}
    for streams in ("auto", "1"):
        c = compile_model(path, input_specs(["64x1024"]), device="cpu", streams=streams)
        art_path = tmp_path / f"tb_{streams}.nimble"
        write_artifact(art_path, c.artifact())
        dump = tmp_path / f"graph_{streams}.dot"
        exe = Executable(read_artifact(art_path), "cuda", graph_dump=str(dump))
        shapes[streams] = _graph_shape(dump.read_text())
        x = torch.randn(64, 1024, device="cuda")
        torch.testing.assert_close(exe(x), reference.run(exe.graph, {k: t.cuda() for k, t in c.weights.items()},
                                                             [x], "cuda")[0], rtol=1e-3, atol=1e-3)
    roots, forks, joins = shapes["auto"]
    assert (roots >= 2 or forks >= 2) and joins >= 2, shapes  # branches that start apart and join
    assert shapes["1"] == (1, 1, 1), shapes  # one stream: a plain chain of nodes


def test_load_never_schedules_or_plans_on_cuda(artifacts, monkeypatch):
    import nimble.plan.memory
    import nimble.plan.schedule

    def forbidden(*args, **kwargs):
        raise AssertionError("loading must not schedule or plan")

    monkeypatch.setattr(nimble.plan.schedule, "assign_streams", forbidden)
    monkeypatch.setattr(nimble.plan.schedule, "schedule_dag", forbidden)
    monkeypatch.setattr(nimble.plan.memory, "plan", forbidden)
    exe = nimble.load(artifacts["inception"], device="cuda")
    exe(*exe.artifact.sample_inputs)


def test_bench_runs_with_baselines(artifacts):
    """`bench` with its baselines; the graph it dumps to count kernels prints no PyTorch debug
    warning (`streams.write_dot`)."""
    import json
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, ["bench", str(artifacts["inception"]), "--iterations", "20", "--duration",
                                          "0.2", "--json"])
    assert result.exit_code == 0, result.stderr
    assert [str(w.message) for w in caught if "cudaGraphDebugDotPrint" in str(w.message)] == []
    report = json.loads(result.stdout)
    assert set(report["results"]) == {"nimble", "eager", "pytorch_graph_1stream", "pytorch_graph_streams"}
    assert report["memory"]["arena_bytes"] > 0 and report["results"]["nimble"]["gpu_mean_ms"] > 0


def test_trace_has_a_track_per_planned_stream_and_the_replays(artifacts, tmp_path):
    import json

    from nimble.formats import read_artifact

    trace = tmp_path / "t.json"
    result = CliRunner().invoke(app, ["bench", str(artifacts["inception"]), "--iterations", "5", "--duration", "0",
                                      "--no-baselines", "--tune", "off", "--trace", str(trace), "--json"])
    assert result.exit_code == 0, result.stderr
    art = read_artifact(artifacts["inception"])
    events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e.get("cat") == "op"]
    assert sorted(e["args"]["op"] for e in ops) == list(range(len(art.graph.ops)))
    assert all(e["tid"] == art.schedule.stream[e["args"]["op"]] for e in ops)  # --tune off: the planned streams
    assert len({e["tid"] for e in ops}) == art.schedule.num_streams > 1
    start = {e["args"]["op"]: e["ts"] for e in ops}
    end = {e["args"]["op"]: e["ts"] + e["dur"] for e in ops}
    for e in ops:  # GPU times: an op starts after the ops it waits for end
        assert all(end[w] <= e["ts"] + 1e-3 for w in e["args"]["waits for ops"]), e
    assert min(start.values()) >= 0
    replays = [e for e in events if e.get("cat") == "replay"]
    assert len(replays) == 10 and all(e["dur"] > 0 for e in replays)
    assert json.loads(result.stdout)["trace"]["replay_median_ms"] > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_footprint_accounts_for_every_byte_and_close_returns_it(artifacts, name):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    slack = before - torch.cuda.memory_allocated()  # free room in segments reserved already, which a load may use
    gc.disable()  # what close returns must not wait for the collector: a reference cycle holding a view fails here
    try:
        exe = nimble.load(artifacts[name], device="cuda")
        _footprint_then_close(exe, before, slack)
    finally:
        gc.enable()
    with pytest.raises(nimble.UsageError, match="closed"):
        exe.replay()


def _footprint_then_close(exe, before: int, slack: int) -> None:
    f = exe.stats.footprint
    kinds = (f.weights, f.arena, f.inputs, f.outside_arena, f.pool_free, f.other_allocated, f.cached)
    assert sum(kinds) == f.growth == torch.cuda.memory_reserved() - before
    assert f.arena == exe.memory.arena_bytes and f.weights == exe.stats.weight_bytes
    workspaces = len(set(exe._stream_of)) * 34 * 2**20  # cuBLAS and cuBLASLt (32 + 1 MiB), per CUDA stream
    padding = regions.SEGMENT_OF_ITS_OWN  # at most: a region between 1 and 10 MiB asks for 10 (regions.py)
    assert -2**20 < f.other_allocated <= workspaces + padding + 2**20, f  # nothing else left by warm-ups or tuning
    # whole free segments went back to the device, and no kept tensor pins part of one
    assert -slack <= f.cached < 8 * 2**20 and f.pool_free >= 0, f
    # a segment per stream at most (none where every result is in the arena and cuDNN's graphs
    # take their workspaces from nimble)
    assert len(f.pool_segments_per_stream) <= len(set(exe._stream_of)) + 1, f
    assert f.outside_arena == 0 or exe.outside_arena(), f  # only results placed elsewhere count
    # the total against the plan: weights, arena and inputs; results that cuDNN's fused convolutions
    # place themselves; the workspaces (cuBLAS's per stream, the cuDNN graphs' one region, and in
    # the graph pool PyTorch's convolutions' at most one large segment per stream) and padding
    large_segment = 20 * 2**20  # what the allocator gives a request between 1 and 10 MiB
    pool = large_segment * max(1, len(f.pool_segments_per_stream))
    assert f.pool_free <= pool, f
    assert f.growth <= f.weights + f.arena + f.inputs + f.outside_arena + workspaces + padding + pool + 8 * 2**20, f
    assert exe.stats.scratch_bytes == f.outside_arena + f.pool_free  # bench's "scratch": the graph pool
    exe.close()
    # all but cuBLAS's workspaces, which PyTorch keeps per stream, and their segments' free room
    assert torch.cuda.memory_reserved() - before <= max(f.other_allocated, 0) + max(f.cached, 0) + 2**20


def test_inspect_reports_the_footprint_on_cuda(artifacts):
    import json

    result = CliRunner().invoke(app, ["inspect", str(artifacts["inception"]), "--device", "cuda", "--json"])
    assert result.exit_code == 0, result.stderr
    f = json.loads(result.stdout)["footprint"]
    assert f["growth"] == sum(f[k] for k in ("weights", "arena", "inputs", "outside_arena", "pool_free",
                                             "other_allocated", "cached")) and f["arena"] > 0
    text = CliRunner().invoke(app, ["inspect", str(artifacts["inception"]), "--device", "cuda", "--no-ops"]).stdout
    assert "GPU footprint:" in text and "graph-pool workspaces" in text


def test_a_memory_budget_is_enforced_before_and_after_allocating(artifacts):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with pytest.raises(nimble.ExecutionError, match="nothing was allocated"):
        nimble.load(artifacts["inception"], device="cuda", max_memory=1000)
    with nimble.load(artifacts["inception"], device="cuda") as exe:
        grown, planned = exe.stats.footprint.growth, sum(exe._planned_bytes().values())
    assert grown > planned  # the graph pool: workspaces at least
    with pytest.raises(nimble.ExecutionError, match="above the memory budget"):  # room for the plan alone
        nimble.load(artifacts["inception"], device="cuda", max_memory=planned + 1)
    assert torch.cuda.memory_reserved() - before <= 8 * 32 * 2**20  # cuBLAS workspaces at most


class _TopScores(nn.Module):
    """Ops the detection models brought in: topk, sort, and boolean & and | of two conditions."""

    def forward(self, x):
        scores = x.mean(1).flatten(1)
        top, index = scores.topk(8, dim=1)
        ordered, _ = scores.sort(dim=1, descending=True)
        keep = ((scores > 0) & (scores < 1)) | (scores < -1)
        return top * 2, index, ordered[:, :4], keep


def test_topk_sort_and_boolean_ops_capture_and_match(tmp_path):
    module, x = _TopScores().eval(), torch.randn(2, 3, 8, 8)
    path = save_script(tmp_path, module, "top")
    compiled = compile_model(path, input_specs(["2x3x8x8"]), device="cuda")
    assert compiled.check.passed, compiled.check.describe()
    out = tmp_path / "top.nimble"
    write_artifact(out, compiled.artifact())
    exe = nimble.load(out, device="cuda")
    got = exe.run(x.cuda())
    for g, w in zip(got, module(x)):
        torch.testing.assert_close(g.cpu(), w)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", [*sorted(MODELS), "bert"])
def test_reduced_precision_artifacts_run_under_every_choice_on_cuda(tmp_path, name, precision):
    """An fp16 or bf16 artifact (compiled on the CPU) loads on CUDA with its weights in that dtype,
    and every layout, algorithm and stream choice (fused cuDNN convolutions, generated kernels)
    meets its tolerance against the float32 model: relative L2 per output."""
    from nimble.runtime.tune import choices as tuning

    from sample_models.build import TOKEN_MODELS

    shapes, dtypes = (MODELS[name][1], None) if name in MODELS else TOKEN_MODELS[name][1:3]
    path = tmp_path / f"{name}_{precision}.nimble"
    compiled = compile_model(SAMPLES / f"{name}.pt", input_specs(["x".join(map(str, s)) for s in shapes], dtypes),
                             device="cpu", precision=precision, io_dtype="reduced")
    write_artifact(path, compiled.artifact())
    art = read_artifact(path)
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    exe = Executable(art, "cuda", tune="full")
    assert exe.verify().l2 == art.precision["tolerance"]
    held = {t.dtype for t in exe._weights.values() if t.is_floating_point()}
    assert low in held and held <= {low, torch.float32, torch.float64}  # float64 constants stay as they were
    for choice in tuning.candidates(art.graph, art.schedule.num_streams):
        forced = Executable(art, "cuda", choice=choice)
        result = forced.verify()
        assert result.passed and result.l2 is not None, (choice.describe(), result.describe())
        forced.close()
    exe.close()
