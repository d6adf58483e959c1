"""`nimble.Group`: artifacts of different models on one arena, one set of streams and workspaces,
run one call at a time (`runtime/group.py`). On the CPU here; `test_gpu_group.py` on CUDA."""

import threading

import pytest

import nimble
from nimble.errors import UsageError
from nimble.formats import read_artifact, write_artifact
from nimble.pipeline import compile_model
from nimble.runtime.base.compare import compare
from nimble.specs import input_specs

from ..conftest import SAMPLES


def placed_in(exe, arena):
    """Whether every planned value of `exe`'s last call sat at its offset in `arena`."""
    base, env = arena.data_ptr(), exe.tensors()
    return all(env[v.id].data_ptr() - base == exe.memory.offset[v.id]
               for v in exe.graph.values if exe.memory.offset[v.id] is not None and v.id in env)


def check(exe):
    art = exe.artifact
    result = compare(exe.run(*art.sample_inputs), art.sample_outputs, rtol=1e-4, atol=1e-5)
    assert result.passed, f"{exe.artifact.model}: {result.describe()}"


def test_members_share_one_arena_sized_for_the_largest_and_keep_their_results(sample_artifacts):
    paths = [sample_artifacts[n] for n in ("resnet", "mobilenet", "transformer")]
    sizes = [read_artifact(p).memory.arena_bytes for p in paths]
    with nimble.Group("cpu") as group:
        members = group.load(*paths)
        assert [m.artifact.memory.arena_bytes for m in members] == sizes
        assert group.arena.numel() == max(sizes)
        assert all(m.arena is group.arena for m in members)
        for _ in range(2):  # in turn: each call finds the arena as the other members left it
            for m in members:
                check(m)
                assert placed_in(m, group.arena)
        assert "3 member(s)" in repr(group)
    assert group.members == [] and group.arena is None
    assert all(m._closed for m in members)
    with pytest.raises(UsageError, match="was closed"):
        members[0].run(*members[0].artifact.sample_inputs)
    with pytest.raises(UsageError, match="group was closed"):
        group.load(paths[0])


def test_a_larger_member_grows_the_arena_and_moves_the_members_before_it(sample_artifacts):
    small, large = sorted([sample_artifacts["mobilenet"], sample_artifacts["resnet"]],
                          key=lambda p: read_artifact(p).memory.arena_bytes)
    group = nimble.Group("cpu")
    first = group.load(small)
    check(first)
    old = group.arena
    second = group.load(large)
    assert group.arena is not old and group.arena.numel() == second.artifact.memory.arena_bytes
    assert first.arena is group.arena and second.arena is group.arena
    check(first)
    assert placed_in(first, group.arena)
    check(second)
    first.close()  # one member gone: the arena stays for the other
    assert group.members == [second] and group.arena is not None
    check(second)
    second.close()
    assert group.arena is None


def test_calls_from_threads_wait_their_turn(sample_artifacts):
    """Two threads calling two members at once: each call has the arena to itself."""
    group = nimble.Group("cpu")
    a, b = group.load(sample_artifacts["resnet"], sample_artifacts["mobilenet"])
    errors = []

    def hammer(exe):
        try:
            for _ in range(5):
                check(exe)
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(m,)) for m in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    group.close()


def test_an_artifact_of_several_batch_sizes_is_refused_in_one_line(tmp_path, sample_artifacts):
    path = tmp_path / "multi.nimble"
    write_artifact(path, compile_model(SAMPLES / "two_io.pt", input_specs(["1x3x64x64", "1x8"]), device="cpu",
                                       batch_sizes=[1, 2]).artifact())
    group = nimble.Group("cpu")
    with pytest.raises(UsageError, match="several batch sizes.*nimble.load"):
        group.load(sample_artifacts["resnet"], path)
    assert group.members == [] and group.arena is None  # refused before anything loaded


def test_a_member_s_budget_counts_only_the_arena_the_group_must_grow(sample_artifacts):
    """`max_memory` per member: the arena the group already holds is not the member's to pay."""
    large, small = sorted([sample_artifacts["mobilenet"], sample_artifacts["resnet"]],
                          key=lambda p: -read_artifact(p).memory.arena_bytes)
    group = nimble.Group("cpu")
    big = group.load(large)
    art = read_artifact(small)
    need = sum(t.numel() * t.element_size() for t in art.weights.values()) + sum(
        x.numel() * x.element_size() for x in art.sample_inputs)
    assert 0 < art.memory.arena_bytes <= group.arena.numel()
    member = group.load(small, max_memory=need)  # alone, its arena would not fit
    check(member)
    with pytest.raises(nimble.ExecutionError, match="memory budget"):
        nimble.load(small, device="cpu", max_memory=need)
    group.close()
    assert big._closed


def test_a_load_that_fails_takes_none_of_its_artifacts_and_no_path_is_refused(tmp_path, sample_artifacts):
    """A member that fails to load (here: its budget) closes the members the same call loaded."""
    def need(path):  # what a member of an arena already large enough asks of its budget
        art = read_artifact(path)
        return sum(t.numel() * t.element_size() for t in [*art.weights.values(), *art.sample_inputs])

    group = nimble.Group("cpu")
    kept = group.load(sample_artifacts["resnet"])
    fits, fails = sorted([sample_artifacts["mobilenet"], sample_artifacts["transformer"]], key=need)
    assert need(fits) < need(fails)
    with pytest.raises(nimble.ExecutionError, match="memory budget"):
        group.load(fits, fails, max_memory=need(fits))  # the first loads, the second is refused
    assert group.members == [kept]
    check(kept)
    with pytest.raises(UsageError, match="at least one artifact"):
        group.load()
    broken = tmp_path / "broken.nimble"
    broken.write_bytes(b"not a zip")
    with pytest.raises(nimble.ArtifactError):
        group.load(sample_artifacts["mobilenet"], broken)  # read before anything loads
    assert group.members == [kept]
    group.close()
