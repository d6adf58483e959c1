"""The record of a load's cuDNN convolutions (`kernels/conv_plans.py`): what it notes, what it
keeps, and that a crafted record is a miss before anything is allocated; on a GPU, that a second
load builds the recorded plans ahead and runs as the first did."""

import json
import os

import pytest
import torch

from nimble.runtime.kernels import conv_plans
from nimble.runtime.kernels.conv_plans import MAX_BYTES, MAX_CONVOLUTIONS

GOOD = [[1, 32, 112, 112], [401408, 1, 3584, 32], [32, 1, 3, 3], [9, 1, 3, 1], [1, 32, 112, 112],
        [401408, 1, 3584, 32], "float32", [1, 1], [1, 1], [1, 1], 32, False, True]


def note(x, w, out, benchmark=False):
    conv_plans.note(x, w, out, [1, 1], [1, 1], [1, 1], 1, benchmark, False, True)


def test_only_heuristic_convolutions_are_noted_and_only_while_recording():
    x, w, out = torch.zeros(1, 3, 8, 8), torch.zeros(4, 3, 3, 3), torch.zeros(1, 4, 8, 8)
    note(x, w, out)  # no recording on: nothing to note into
    with conv_plans.recording() as seen:
        note(x, w, out)
        note(x, w, out)  # the same convolution once
        note(x, w, out, benchmark=True)  # cuDNN times these as it builds them: never built ahead
        note(x.double(), w.double(), out.double())  # no cuDNN kernel kind nimble builds ahead
        with conv_plans.recording() as inner:
            note(x.contiguous(memory_format=torch.channels_last), w, out)
    assert len(seen) == 1 and len(inner) == 1 and seen != inner
    (entry,) = seen
    assert conv_plans._checked(json.loads(json.dumps(list(entry)))) == entry  # what is stored reads back


def test_a_record_is_kept_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    entry = conv_plans._checked(GOOD)
    assert entry is not None
    assert conv_plans.recorded("k") is None
    conv_plans.store("k", {entry})
    assert conv_plans.recorded("k") == [entry]
    stamp = os.stat(conv_plans.path()).st_mtime_ns
    conv_plans.store("k", {entry})  # the same record: not written again
    assert os.stat(conv_plans.path()).st_mtime_ns == stamp
    assert conv_plans.prewarm([], torch.device("cpu")) == 0  # nothing recorded: nothing runs


@pytest.mark.parametrize("change", [
    lambda e: e[:12],  # too short
    lambda e: [*e[:6], "float64", *e[7:]],  # a dtype cuDNN is not asked for here
    lambda e: [*e[:10], 0, *e[11:]],  # no groups
    lambda e: [*e[:10], True, *e[11:]],  # a bool is not a count
    lambda e: [*e[:11], 1, e[12]],  # a flag that is not a bool
    lambda e: [[1, 32, 112], *e[1:]],  # three dimensions
    lambda e: [[1, 32, 112, -1], *e[1:]],  # a negative size
    lambda e: [[1, 32, 112, 2**31], *e[1:]],  # too large
    lambda e: [[1, 32, 112, 112.0], *e[1:]],  # not a whole number
    lambda e: [*e[:8], [0, 1], *e[9:]],  # stride 0
    lambda e: [*e[:7], [1, 2**17], *e[8:]],  # padding out of range
    lambda e: [[2**20, 32, 112, 112], [2**16, 1, 2**10, 32], *e[2:]],  # far past MAX_BYTES of scratch
    lambda e: "not a list",
])
def test_a_crafted_record_is_a_miss(tmp_path, monkeypatch, change):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    conv_plans.store("k", {conv_plans._checked(GOOD)})
    table = json.loads(conv_plans.path().read_text())
    table["k"].append(change(list(GOOD)))
    conv_plans.path().write_text(json.dumps(table))
    assert conv_plans.recorded("k") is None  # one bad entry: the record as a whole


def test_too_many_entries_or_a_file_too_large_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    conv_plans.store("k", {conv_plans._checked(GOOD)})
    conv_plans.path().write_text(json.dumps({"k": [GOOD] * (MAX_CONVOLUTIONS + 1)}))
    assert conv_plans.recorded("k") is None
    conv_plans.path().write_text(json.dumps({"k": [GOOD], "pad": "x" * conv_plans.MAX_RECORD_BYTES}))
    assert conv_plans.recorded("k") is None
    assert MAX_BYTES < 2**31


@pytest.mark.gpu
def test_a_second_load_builds_the_recorded_plans_ahead_and_agrees(tmp_path, monkeypatch, sample_artifacts):
    """The first load records the convolutions its warm-up ran on cuDNN; a second, with that
    tuning choice, runs each of them ahead on scratch tensors and gives the same outputs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import nimble

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    first = nimble.load(sample_artifacts["mobilenet"], device="cuda", tune="off")
    assert first.stats.convolution_plans_ahead == 0  # nothing recorded yet
    table = json.loads(conv_plans.path().read_text())
    (key, entries), = table.items()
    assert key.endswith(first.stats.choice) and entries
    x = [t.cuda() for t in first.artifact.sample_inputs]
    expected = [t.clone() for t in first.run(*x)]
    first.close()
    again = nimble.load(sample_artifacts["mobilenet"], device="cuda", tune="off")
    assert again.stats.convolution_plans_ahead == len(entries)
    for a, b in zip(again.run(*x), expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
