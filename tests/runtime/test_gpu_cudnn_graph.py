"""cuDNN graphs for convolutions with their epilogue (`runtime/kernels/cudnn_graph.py`): each plan writes
the buffer it is given, agrees with eager PyTorch, and a plan that disagrees is never used."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from nimble.formats import read_artifact
from nimble.runtime.kernels import cudnn_graph
from nimble.runtime.kernels import fused as kernels
from nimble.runtime.tune import choices as tuning
from nimble.runtime.base.compare import compare
from nimble.runtime.executable import Executable

pytestmark = pytest.mark.gpu
RELU, ADD_RELU = (("relu", ()),), (("add", ()), ("relu", ()))

needs_frontend = pytest.mark.skipif(cudnn_graph.frontend() is None,
                                    reason="nvidia-cudnn-frontend is not installed (the cudnn extra)")


@pytest.fixture(autouse=True)
def fresh_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cudnn_graph, "_chosen", {})


def _call(n, c, k, hw, r, stride, pad, dtype, layout, residual):
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(n, c, *hw, device="cuda", dtype=dtype).to(memory_format=fmt)
    w = (torch.randn(k, c, r, r, device="cuda", dtype=dtype) / (c * r * r) ** 0.5).to(memory_format=fmt)
    b = torch.randn(k, device="cuda", dtype=dtype)
    p = {"stride": (stride, stride), "padding": (pad, pad), "dilation": (1, 1), "groups": 1}
    ref = F.conv2d(x.float(), w.float(), b.float(), stride, pad)
    z = torch.randn_like(ref, dtype=dtype).to(memory_format=fmt) if residual else None
    ref = (ref + z.float() if residual else ref).relu()
    out = torch.empty_like(ref, dtype=dtype).to(memory_format=fmt)

    def fused():
        if z is None:
            return torch.ops.aten.cudnn_convolution_relu(x, w, b, [stride] * 2, [pad] * 2, [1, 1], 1)
        return torch.ops.aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, [stride] * 2, [pad] * 2, [1, 1], 1)
    return p, (x, w, b, z), out, ref, fused


@needs_frontend
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 5, 7, (9, 11), 3, 2, 1), (1, 16, 32, (14, 14), 1, 1, 0)])
def test_a_chosen_plan_writes_the_given_buffer_and_matches_eager(monkeypatch, dtype, shape, use_settings):
    use_settings(cudnn_slower=float("inf"))  # any correct plan, however slow
    for layout in tuning.LAYOUTS:
        for residual in (False, True):
            p, operands, out, ref, fused = _call(*shape, dtype, layout, residual)
            steps = (("add", ()), ("relu", ())) if residual else (("relu", ()),)
            graph = cudnn_graph.choose(p, steps, tuple(t for t in operands if t is not None), out, fused,
                                       cudnn_graph.Workspaces())
            if graph is None:  # cuDNN has no plan for conv -> add -> relu on NCHW
                assert residual and layout == "contiguous", (layout, cudnn_graph.STATS)
                continue
            out.zero_()
            operands = tuple(t for t in operands if t is not None)
            assert graph(operands, out) is out
            torch.cuda.synchronize()
            tol = 2e-2 if dtype == torch.float16 else 1e-2
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
            # captured into a CUDA graph, it runs on the capture's stream into the same buffer
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                graph(operands, out)
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@needs_frontend
def test_a_plan_that_disagrees_with_pytorch_is_never_used(monkeypatch, use_settings):
    use_settings(cudnn_slower=float("inf"))
    use_settings(cudnn_tolerance=-1.0)  # every plan's result counts as wrong
    before = cudnn_graph.STATS["rejected"]
    p, (x, w, b, _), out, _, fused = _call(1, 16, 32, (14, 14), 3, 1, 1, torch.float32, "channels_last", False)
    assert cudnn_graph.choose(p, RELU, (x, w, b), out, fused, cudnn_graph.Workspaces()) is None
    assert cudnn_graph.STATS["rejected"] > before


@needs_frontend
def test_a_plan_may_be_slower_where_the_reference_leaves_its_result_outside_the_arena(monkeypatch, use_settings):
    use_settings(cudnn_slower=0.0)  # no plan is as fast as nothing
    use_settings(cudnn_slower_outside=float("inf"))
    p, (x, w, b, _), out, _, fused = _call(2, 16, 32, (14, 14), 3, 1, 1, torch.float32, "channels_last", False)
    timed = cudnn_graph.STATS["timed"]
    assert cudnn_graph.choose(p, RELU, (x, w, b), out, fused, cudnn_graph.Workspaces()) is None
    graph = cudnn_graph.choose(p, RELU, (x, w, b), out, fused, cudnn_graph.Workspaces(), outside=True)
    assert graph is not None and cudnn_graph.STATS["timed"] == timed + 2  # two limits: two decisions
    out.zero_()
    graph((x, w, b), out)
    torch.testing.assert_close(out, fused(), rtol=1e-2, atol=1e-2)


@needs_frontend
def test_a_choice_is_kept_in_the_cache_folder_and_checked_when_read(monkeypatch, use_settings):
    import json

    use_settings(cudnn_slower=float("inf"))
    p, (x, w, b, _), out, _, fused = _call(2, 16, 32, (14, 14), 3, 1, 1, torch.float32, "channels_last", False)

    def choose():
        monkeypatch.setattr(cudnn_graph, "_chosen", {})  # a new process: only the cache folder remembers
        before = dict(cudnn_graph.STATS)
        graph = cudnn_graph.choose(p, RELU, (x, w, b), out, fused, cudnn_graph.Workspaces())
        return graph, {k: cudnn_graph.STATS[k] - before[k] for k in ("timed", "recalled", "rejected")}

    first, counts = choose()
    assert first is not None and counts["timed"] == 1
    again, counts = choose()  # read back: that plan alone is built, and checked, not timed
    assert again.plan.name == first.plan.name and counts == {"timed": 0, "recalled": 1, "rejected": 0}
    path = cudnn_graph._table_path()
    table = json.loads(path.read_text())
    (key,) = table
    path.write_text(json.dumps({key: {"plan": "eng0_no_such_plan"}}))  # crafted: a plan cuDNN does not rank
    graph, counts = choose()
    assert graph is not None and counts["timed"] == 1 and counts["recalled"] == 0
    use_settings(cudnn_tolerance=-1.0)  # the stored plan's result now counts as wrong
    graph, counts = choose()
    assert graph is None and counts["recalled"] == 0 and counts["rejected"] >= 1 and counts["timed"] == 1
    for crafted in ("[1, 2]", '{"%s": {"plan": 7}}' % key, "not json"):  # unreadable entries: timed again
        path.write_text(crafted)
        _, counts = choose()
        assert counts["timed"] == 1, crafted


@needs_frontend
def test_without_tf32_every_plan_computes_in_full_float32(monkeypatch, use_settings):
    """With TF32 off, as PyTorch is told, no plan that rounds to TF32 is chosen: every plan
    cuDNN offers (any speed) agrees with a float64 convolution to float32's precision. The same
    call with TF32 on is a choice of its own."""
    use_settings(cudnn_slower=float("inf"))
    use_settings(cudnn_plans=50)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    p, (x, w, b, _), out, _, fused = _call(2, 64, 64, (14, 14), 3, 1, 1, torch.float32, "channels_last", False)
    want = F.conv2d(x.double(), w.double(), b.double(), 1, 1).relu()
    plans = cudnn_graph.cudnn_plans.ranked(p, RELU, (x, w, b), out)
    assert plans
    for plan in plans:
        out.zero_()
        plan.run((x, w, b), out, cudnn_graph._workspace(plan, out.device))
        torch.cuda.synchronize()
        assert float((out.double() - want).abs().max()) < 1e-4 * float(want.abs().max()), plan.name
    graph = cudnn_graph.choose(p, RELU, (x, w, b), out, fused, cudnn_graph.Workspaces())
    assert graph is not None and len(cudnn_graph._chosen) == 1
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    cudnn_graph.choose(p, RELU, (x, w, b), out, fused, cudnn_graph.Workspaces())
    assert len(cudnn_graph._chosen) == 2


@needs_frontend
def test_an_output_that_overlaps_an_input_is_left_to_pytorch(monkeypatch, use_settings):
    use_settings(cudnn_slower=float("inf"))
    p, (x, w, b, z), out, _, fused = _call(1, 8, 8, (6, 6), 1, 1, 0, torch.float32, "contiguous", True)
    z = out  # the output's own buffer
    assert cudnn_graph.choose(p, ADD_RELU, (x, w, b, z), out, fused, cudnn_graph.Workspaces()) is None


@needs_frontend
@pytest.mark.parametrize("name", ["resnet", "inception"])
def test_fused_convolutions_write_the_arena(sample_artifacts, monkeypatch, name, use_settings):
    """With a cuDNN graph for every fused convolution, nothing lies outside the arena."""
    use_settings(cudnn_slower=float("inf"))
    art = read_artifact(sample_artifacts[name])
    exe = Executable(art, "cuda", choice=tuning.Choice("channels_last"))
    result = compare(exe.run(*art.sample_inputs), art.sample_outputs, rtol=1e-2, atol=1e-3)
    assert result.passed, result.describe()
    assert exe.outside_arena() == [], cudnn_graph.STATS
    # one workspace per CUDA stream, shared by the graphs on it, and given back on close: nothing
    # (a fused kernel included) holds them after it
    workspaces = exe._cudnn_workspaces
    assert 0 < workspaces.nbytes() <= exe.settings.cudnn_max_workspace * len(set(exe._stream_of))
    held = weakref.ref(workspaces)
    del workspaces
    exe.close()
    gc.collect()
    assert held() is None and exe._cudnn_workspaces.nbytes() == 0


@needs_frontend
def test_generated_epilogues_as_graphs_match_the_interpreted_body(monkeypatch, use_settings):
    """Every conv-led body of a sample with SiLU, sigmoid, hardswish and scalar chains is offered
    to cuDNN (it has precompiled engines for some layouts and chains, not others); whatever runs
    as a graph, the whole agrees with the interpreter."""
    import nimble
    from nimble.runtime.placed import reference

    from .test_gpu_kernels import Pointwise

    use_settings(cudnn_slower=float("inf"))
    torch.manual_seed(0)
    module = Pointwise().eval()
    x = torch.randn(2, 8, 12, 12)
    artifact = nimble.Nimble(module).prepare(x)._runner.artifact
    interpreted = reference.run(artifact.graph, artifact.weights, [x], "cpu")[0]
    timed = cudnn_graph.STATS["timed"]
    for layout in tuning.LAYOUTS:
        exe = Executable(artifact, "cuda", choice=tuning.Choice(layout))
        torch.testing.assert_close(exe(x.cuda()).cpu(), interpreted, rtol=1e-2, atol=1e-3)
    assert cudnn_graph.STATS["timed"] > timed, cudnn_graph.STATS


def _prepared(make, shape: tuple):
    """An input of `shape`, the eager result of the module `make()` builds, and its artifact."""
    import nimble

    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(*shape)
    with torch.no_grad():
        want = module(x)
    return x, want, nimble.Nimble(module).prepare(x)._runner.artifact


class Projections(torch.nn.Module):
    """Convolutions nothing fuses with: a depthwise one and a 1x1 projection, each with a bias
    (`fuse_lone_convolutions` makes each a fused op of one node), odd sizes."""

    def __init__(self):
        super().__init__()
        self.depthwise = torch.nn.Conv2d(12, 12, 3, padding=1, groups=12)
        self.project = torch.nn.Conv2d(12, 20, 1)

    def forward(self, x):
        return self.project(self.depthwise(x))


@pytest.mark.parametrize("layout", tuning.LAYOUTS)
def test_a_lone_convolution_and_its_bias_run_as_one_kernel(monkeypatch, tmp_path, layout, use_settings):
    """With a plan (any, however slow) the projection and its bias are one kernel, not the
    convolution then an add; without the package it runs as eager PyTorch does. Both agree with
    eager in either layout."""
    from nimble.ops import fusion
    from nimble.runtime.base.streams import count_kernels

    use_settings(cudnn_slower=float("inf"))
    x, want, artifact = _prepared(Projections, (3, 12, 9, 11))
    lone = [fusion.body_of(op) for op in artifact.graph.ops if op.target == fusion.FUSED]
    assert [[node[0] for node in body] for body in lone] == [["aten::convolution.default"]] * 2
    counts = {}
    for package in ("installed", "missing"):
        if package == "missing":
            monkeypatch.setattr(cudnn_graph.cudnn_plans, "_module", None)
        elif cudnn_graph.frontend() is None:
            continue
        dump = tmp_path / f"{package}.dot"
        exe = Executable(artifact, "cuda", choice=tuning.Choice(layout), graph_dump=str(dump))
        torch.testing.assert_close(exe(x.cuda()).cpu(), want, rtol=1e-2, atol=1e-3)
        counts[package] = count_kernels(dump)
    if "installed" in counts:  # the projection's bias joins its kernel
        assert counts["installed"] < counts["missing"], counts


def test_without_the_package_pytorch_fused_kernel_runs(monkeypatch):
    monkeypatch.setattr(cudnn_graph.cudnn_plans, "_module", None)
    p, operands, out, ref, fused = _call(1, 8, 8, (6, 6), 3, 1, 1, torch.float32, "channels_last", True)
    assert cudnn_graph.choose(p, ADD_RELU, operands, out, fused, cudnn_graph.Workspaces()) is None


def test_settled_workspaces_share_one_allocation_of_their_own():
    """Grown during the warm-up, each stream's workspace sat in a 20 MiB segment; settled, they
    are views of one allocation, of their sizes, in a segment that holds nothing else."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    spaces, streams = cudnn_graph.Workspaces(), [torch.cuda.Stream() for _ in range(2)]
    for s, nbytes in zip(streams, (3 * 2**20, 2 * 2**20 + 5)):
        with torch.cuda.stream(s):
            spaces.get(2**20, torch.device("cuda"))
            spaces.get(nbytes, torch.device("cuda"))  # grown: a new tensor
    spaces.settle(torch.device("cuda"))
    held = list(spaces._by_stream.values())
    assert sorted(t.numel() for t in held) == [2 * 2**20 + 5, 3 * 2**20] == sorted(
        spaces._by_stream[s.cuda_stream].numel() for s in streams)
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    base = held[0].untyped_storage()
    segments = [seg for seg in torch.cuda.memory_snapshot()
                if seg["address"] <= base.data_ptr() < seg["address"] + seg["total_size"]]
    assert len(segments) == 1 and segments[0]["total_size"] == base.nbytes() == 10 * 2**20, segments
    for s in streams:  # the ops on each stream find theirs at full size, without a new allocation
        with torch.cuda.stream(s):
            assert spaces.get(2**20, torch.device("cuda")).untyped_storage().data_ptr() == base.data_ptr()
    spaces.settle(torch.device("cuda"))  # nothing grew: the same allocation
    assert all(t.untyped_storage().data_ptr() == base.data_ptr() for t in spaces._by_stream.values())
    with torch.cuda.stream(streams[0]):  # another executable of the artifact needs more
        spaces.get(4 * 2**20, torch.device("cuda"))
    spaces.settle(torch.device("cuda"))
    bases = {t.untyped_storage().data_ptr() for t in spaces._by_stream.values()}
    assert len(bases) == 1 and bases != {base.data_ptr()}
    assert spaces._by_stream[streams[0].cuda_stream].numel() == 4 * 2**20
    # the first allocation stays: graphs captured on it may still replay
    assert [r[streams[1].cuda_stream].untyped_storage().data_ptr() for r in spaces._regions][0] == base.data_ptr()


class Activated(torch.nn.Module):
    """Convolutions whose epilogue is generated: relu6 and SiLU after each, odd sizes."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(8, 24, 3, padding=1)
        self.b = torch.nn.Conv2d(24, 16, 1)

    def forward(self, x):
        return F.silu(self.b(F.relu6(self.a(x))))


@needs_frontend
@pytest.mark.parametrize("layout", tuning.LAYOUTS)
def test_the_convolution_before_a_generated_epilogue_runs_as_a_graph(monkeypatch, tmp_path, layout, use_settings):
    """Where the whole body has no plan, its convolution alone still runs as a cuDNN graph (where
    cuDNN has a plan for it) into the planned buffer (its workspace the stream's), and the generated kernel adds the bias and
    the rest: as many kernels as with PyTorch's convolution, the same results as eager."""
    from nimble.runtime.base.streams import count_kernels

    use_settings(cudnn_slower=float("inf"))
    monkeypatch.setattr(cudnn_graph, "epilogue", lambda body, out: None)  # no plan for any whole body
    use_settings(standalone_pointwise=False)  # nor the 1x1 one as a generated matrix product
    x, want, artifact = _prepared(Activated, (3, 8, 9, 11))
    counts = {}
    for package in ("installed", "missing"):
        if package == "missing":
            monkeypatch.setattr(cudnn_graph.cudnn_plans, "_module", None)
        chosen = cudnn_graph.STATS["chosen"]
        dump = tmp_path / f"{package}.dot"
        exe = Executable(artifact, "cuda", choice=tuning.Choice(layout), graph_dump=str(dump))
        torch.testing.assert_close(exe(x.cuda()).cpu(), want, rtol=1e-2, atol=1e-3)
        counts[package] = count_kernels(dump)
        if package == "installed":
            bare = [key for key, plan in cudnn_graph._chosen.items() if plan is not None and key[1] == ()]
            assert cudnn_graph.STATS["chosen"] - chosen == len(bare) >= 1, (cudnn_graph.STATS, list(cudnn_graph._chosen))
            assert all(key[0][4] is None for key in bare)  # the bias is the generated kernel's
    assert counts["installed"] == counts["missing"], counts
