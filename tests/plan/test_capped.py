"""The capped stream candidates compile stores beside the planned schedule (`plan/capped.py`):
each is the fold onto at most `cap` CUDA streams, stored only where the planned streams need
more, and the one memory plan is proved safe under it at compile and whenever it is read. A
crafted candidate is refused before anything runs."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimble.errors import ArtifactError
from nimble.formats import read_artifact
from nimble.formats.spec import BATCH_MEMBER
from nimble.plan.capped import CAPS, as_schedule, check, fold, streams_under, with_candidates
from nimble.plan.document import plan_document
from nimble.plan.memory import plan
from nimble.plan.schedule import assign_streams, schedule_dag
from nimble.plan.verify import check_plan

from ..forge import edit_json
from .test_memory import random_graph
from .test_schedule import dags


def folds_onto(schedule) -> int:
    return len(set(fold(schedule.order, schedule.stream, schedule.waits)))


@settings(max_examples=150, deadline=None)
@given(dags)
def test_a_candidate_is_stored_for_each_cap_below_the_folded_streams_and_is_that_fold(preds):
    schedule = with_candidates(schedule_dag(preds))
    want = [cap for cap in CAPS if cap < folds_onto(schedule)]
    assert [cap for cap, _ in schedule.capped] == want
    for cap, cuda in schedule.capped:
        assert list(cuda) == fold(schedule.order, schedule.stream, schedule.waits, cap)
        assert len(set(cuda)) <= cap
    check(schedule)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.integers(0, 2**32))
def test_the_plan_of_the_planned_streams_is_proved_safe_under_every_stored_candidate(n, seed):
    graph = random_graph(random.Random(seed), n)
    schedule = with_candidates(assign_streams(graph))
    memory = plan(graph, schedule)
    check_plan(graph, schedule, memory)  # checks the candidates too
    for _, cuda in schedule.capped:
        check_plan(graph, as_schedule(schedule, cuda), memory)


def test_a_stored_candidate_is_what_load_issues_even_where_a_fold_would_differ():
    schedule = with_candidates(schedule_dag([(), (0,), (0,), (0,), (1, 2, 3)]))  # three planned streams
    assert schedule.num_streams == 3 and [cap for cap, _ in schedule.capped] == [2]
    cap, cuda = schedule.capped[0]
    last = schedule.stream[4]  # the planned stream of the join, which the other fold puts alone
    other = tuple(int(schedule.stream[op] == last) for op in range(5))
    if other == cuda:
        other = tuple(1 - s for s in other)
    mine = dataclasses.replace(schedule, capped=((2, other),))
    check(mine)
    assert streams_under(mine, 2) == list(other)
    assert streams_under(dataclasses.replace(schedule, capped=()), 2) == list(cuda)  # an old artifact: folded
    assert streams_under(schedule, None) == fold(schedule.order, schedule.stream, schedule.waits)


@pytest.mark.parametrize("capped_, why", [
    (((3, (0, 0, 1, 2, 0)),), "not one this nimble stores"),
    (((2, (0, 0, 1, 1, 0)), (2, (0, 0, 1, 1, 0))), "not one this nimble stores"),
    (((2, (0, 0, 1)),), "does not put each"),
    (((2, (0, 0, 1, 2, 0)),), "does not put each"),
])
def test_a_candidate_that_is_no_fold_is_refused(capped_, why):
    schedule = schedule_dag([(), (0,), (0,), (0,), (1, 2, 3)])
    with pytest.raises(ValueError, match=why):
        check(dataclasses.replace(schedule, capped=capped_))


def test_a_candidate_that_splits_a_planned_stream_is_refused():
    schedule = schedule_dag([(), (0,), (1,), (0,)])  # 0 -> 1 -> 2 on one stream, 3 beside it
    chain = schedule.stream[0]
    assert schedule.stream[1] == schedule.stream[2] == chain != schedule.stream[3]
    split = tuple(1 if op == 2 else 0 for op in range(4))
    with pytest.raises(ValueError, match=f"splits planned stream {chain}"):
        check(dataclasses.replace(schedule, capped=((2, split),)))


def test_the_nasnet_sample_stores_a_candidate_on_two_cuda_streams_and_reads_it_back(sample_artifacts):
    art = read_artifact(sample_artifacts["nasnet"])
    assert folds_onto(art.schedule) > 2
    assert [cap for cap, _ in art.schedule.capped] == [2]
    assert list(art.schedule.capped[0][1]) == fold(art.schedule.order, art.schedule.stream, art.schedule.waits, 2)
    doc = plan_document(art.graph, model="nasnet", schedule=art.schedule, memory=art.memory)
    [entry] = doc["schedule"]["capped"]
    assert entry["cap"] == 2 and entry["streams"] == 2 and entry["stream"] == list(art.schedule.capped[0][1])
    assert entry["syncs"] < art.schedule.num_waits  # waits between ops that now share a stream are dropped


def test_a_chain_stores_no_candidate(sample_artifacts):
    art = read_artifact(sample_artifacts["resnet"])
    assert folds_onto(art.schedule) <= 2 and art.schedule.capped == ()


def _forged(sample_artifacts, tmp_path, edit):
    path = tmp_path / "forged.nimble"
    path.write_bytes(edit_json(sample_artifacts["nasnet"].read_bytes(), "schedule.json", edit))
    return path


def _split(doc):
    """Move the last op of a planned stream of several ops to the other CUDA stream."""
    stream, cuda = doc["stream"], doc["capped"][0]["stream"]
    first = next(op for op in doc["order"] if stream.count(stream[op]) > 1)
    later = max(op for op in range(len(stream)) if stream[op] == stream[first])
    cuda[later] = 1 - cuda[first]


def test_an_artifact_whose_candidate_splits_a_planned_stream_is_refused(sample_artifacts, tmp_path):
    with pytest.raises(ArtifactError, match="unsafe plan: the candidate capped at 2 streams splits planned stream"):
        read_artifact(_forged(sample_artifacts, tmp_path, _split))


@pytest.mark.parametrize("edit, why", [
    (lambda doc: doc.update(capped={"cap": 2}), "must be a list"),
    (lambda doc: doc.update(capped=[{"cap": 2, "stream": []}] * 2), "at most 1 candidate"),
    (lambda doc: doc["capped"][0].update(cap=True), r"capped\[0\].cap has the wrong type"),
    (lambda doc: doc["capped"][0].update(cap=4), "cap is 4; this nimble stores candidates capped at 2"),
    (lambda doc: doc["capped"][0].update(stream=[0]), "does not cover the graph's"),
    (lambda doc: doc["capped"][0].pop("stream"), "missing field 'stream'"),
    (lambda doc: doc["capped"][0]["stream"].__setitem__(0, -1), r"holds -1, outside \[0, 2\)"),
])
def test_a_malformed_candidate_is_one_clear_error(sample_artifacts, tmp_path, edit, why):
    with pytest.raises(ArtifactError, match=why):
        read_artifact(_forged(sample_artifacts, tmp_path, edit))


def test_the_planned_schedule_alone_is_still_read(sample_artifacts, tmp_path):
    """An artifact from before candidates were stored has no `capped`: load folds the same one."""
    art = read_artifact(_forged(sample_artifacts, tmp_path, lambda doc: doc.pop("capped")))
    assert art.schedule.capped == ()
    stored = read_artifact(sample_artifacts["nasnet"]).schedule
    assert streams_under(art.schedule, 2) == list(stored.capped[0][1])



def test_a_load_capped_at_two_streams_issues_the_stored_candidate(sample_artifacts, tmp_path):
    """The executable takes the artifact's candidate, not a fold of its own (here a forged one
    that is another valid fold), and still computes the sample outputs."""
    import torch

    import nimble
    from nimble.runtime.tune import choices as tuning

    def regroup(doc):
        stream, cuda = doc["stream"], doc["capped"][0]["stream"]
        doc["capped"][0]["stream"] = [int(stream[op] == stream[-1]) for op in range(len(stream))]
        assert doc["capped"][0]["stream"] != cuda
    path = _forged(sample_artifacts, tmp_path, regroup)
    exe = nimble.load(path, device="cpu")
    exe._set_order(tuning.Choice(streams=f"at most {tuning.CAP}"))
    assert exe._stream_of == list(read_artifact(path).schedule.capped[0][1])
    art = read_artifact(path)
    got = exe(*art.sample_inputs)
    torch.testing.assert_close(list(got) if isinstance(got, (list, tuple)) else [got], art.sample_outputs,
                               rtol=1e-4, atol=1e-5)


def test_every_batch_size_of_an_artifact_stores_its_candidate_and_a_forged_one_is_refused(tmp_path):
    from ..cli.test_cli import invoke
    from ..conftest import SAMPLES

    path = tmp_path / "nasnet.nimble"
    result = invoke("compile", SAMPLES / "nasnet.pt", "-s", "1x3x64x64", "--batch-sizes", "1,4", "--device", "cpu",
                    "-o", path)
    assert result.exit_code == 0, result.stderr
    art = read_artifact(path)
    for schedule in (art.schedule, art.batches[4][1]):
        assert [cap for cap, _ in schedule.capped] == [2]
        assert list(schedule.capped[0][1]) == fold(schedule.order, schedule.stream, schedule.waits, 2)

    forged = tmp_path / "forged.nimble"
    forged.write_bytes(edit_json(path.read_bytes(), BATCH_MEMBER.format(4, "schedule.json"), _split))
    with pytest.raises(ArtifactError, match="batch 4: unsafe plan: the candidate capped at 2 streams splits"):
        read_artifact(forged)
