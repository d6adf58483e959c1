"""`nimble.Group` on CUDA: one arena, one set of streams and workspaces for artifacts of different
models, calls ordered on the GPU whichever stream makes them, memory given back at close."""

import pytest
import torch

import nimble
from nimble.formats import read_artifact
from nimble.runtime.base.compare import compare

pytestmark = pytest.mark.gpu

NAMES = ["resnet", "mobilenet", "transformer", "inception"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))


def check(exe, outputs):
    result = compare(outputs, exe.artifact.sample_outputs, rtol=1e-2, atol=1e-3)
    assert result.passed, f"{exe.artifact.model}: {result.describe()}"


def placed(exe, arena):
    base, env, outside = arena.data_ptr(), exe.tensors(), set(exe.outside_arena())
    return [v.id for v in exe.graph.values if exe.memory.offset[v.id] is not None and v.id in env
            and v.id not in outside and env[v.id].data_ptr() - base != exe.memory.offset[v.id]]


def test_members_share_the_arena_streams_and_workspaces_and_run_in_turn(sample_artifacts):
    group = nimble.Group("cuda")
    members = group.load(*[sample_artifacts[n] for n in NAMES])
    assert group.arena.numel() == max(m.artifact.memory.arena_bytes for m in members)
    for m in members:
        assert m.arena is group.arena and m._streams is group._streams
        assert m._cudnn_workspaces is group._cudnn_workspaces and placed(m, group.arena) == []
        assert m.stats.kernel_fallbacks == []
    inputs = {m: [x.cuda() for x in m.artifact.sample_inputs] for m in members}
    for _ in range(3):  # back to back, no synchronisation between calls
        got = {m: m.run(*inputs[m]) for m in members}
        for m in members:
            check(m, got[m])
    streams = [torch.cuda.Stream() for _ in members]  # each call on a stream of its own
    got = {}
    for m, s in zip(members, streams):
        with torch.cuda.stream(s):
            got[m] = m.run(*inputs[m])
    torch.cuda.synchronize()
    for m in members:
        check(m, got[m])
    group.close()


def test_a_larger_member_captures_the_others_again_on_the_grown_arena(sample_artifacts):
    small, large = sorted([sample_artifacts["transformer"], sample_artifacts["inception"]],
                          key=lambda p: read_artifact(p).memory.arena_bytes)
    group = nimble.Group("cuda")
    first = group.load(small)
    x = [t.cuda() for t in first.artifact.sample_inputs]
    check(first, first.run(*x))
    second = group.load(large)
    assert first.arena is group.arena and group.arena.numel() == second.artifact.memory.arena_bytes
    assert placed(first, group.arena) == []
    check(first, first.run(*x))
    check(second, second.run(*[t.cuda() for t in second.artifact.sample_inputs]))
    group.close()


def test_closing_the_group_gives_back_what_a_second_group_would_take_again(sample_artifacts):
    """No load leaks: after one group of every member is closed, a second one, loaded and closed
    the same way, leaves the allocator where the first left it (cuBLAS keeps its workspace per
    stream for the process, so the first close is the baseline)."""
    paths = [sample_artifacts[n] for n in NAMES]
    reserved = []
    for _ in range(2):
        group = nimble.Group("cuda")
        members = group.load(*paths)
        for m in members:
            m.run(*[t.cuda() for t in m.artifact.sample_inputs])
        group.close()
        assert group.arena is None and all(m._closed for m in members)
        del members
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[1] <= reserved[0]
