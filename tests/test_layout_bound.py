"""tools/layout_bound.py's arithmetic: the per-op choice of layout takes each op's faster
layout, the kernels of no known op count as in the better whole-model layout, and the bound is
the fraction of the better whole-model kernel time that choice saves. And the loop over models
and batches it shares with kernel_diff.py (`report.each_row`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import layout_bound  # noqa: E402  (tools/layout_bound.py)


def test_each_op_takes_its_faster_layout_and_the_bound_is_against_the_better_model():
    per_layout = {"contiguous": {0: 1.0, 1: 3.0, 2: 1.0}, "channels_last": {0: 2.0, 1: 1.5, 3: 0.5}}
    got = layout_bound.bound(per_layout, {"contiguous": 0.25, "channels_last": 0.5})
    assert got["kernel_ms"] == {"contiguous": 5.25, "channels_last": 4.5}
    assert got["best_layout"] == "channels_last"
    # op 0 from NCHW, op 1 from NHWC, op 2 absent in NHWC (0), op 3 absent in NCHW (0); unknown as NHWC
    assert got["per_op_best_ms"] == pytest.approx(1.0 + 1.5 + 0.5)
    assert got["bound"] == pytest.approx(1 - 3.0 / 4.5)


def test_one_layout_faster_everywhere_bounds_the_gain_at_nothing():
    per_layout = {"contiguous": {0: 2.0, 1: 2.0}, "channels_last": {0: 1.0, 1: 1.0}}
    got = layout_bound.bound(per_layout, {"contiguous": 0.0, "channels_last": 0.0})
    assert got["bound"] == 0.0 and got["per_op_best_ms"] == 2.0


def test_kernels_count_per_inference_and_unknown_launches_apart():
    reps = layout_bound.REPS
    ours = [{"dur": 1000.0}] * (2 * reps) + [{"dur": 500.0}] * reps
    owner = [4] * (2 * reps) + [None] * reps
    ms, unknown = layout_bound.per_op_ms(ours, owner)
    assert ms == {4: pytest.approx(2.0)} and unknown == pytest.approx(0.5)


def test_every_model_and_batch_makes_a_row_and_a_failing_one_is_reported_and_left_out(capsys):
    report = pytest.importorskip("report")
    folders = set()

    def one(name, batch, folder):
        folders.add(folder)
        assert folder.is_dir()
        if (name, batch) == ("b", 8):
            raise RuntimeError("out of memory")
        return {"model": name, "batch": batch}

    rows = report.each_row(["a", "b"], [1, 8], one)
    assert rows == [{"model": "a", "batch": 1}, {"model": "a", "batch": 8}, {"model": "b", "batch": 1}]
    assert len(folders) == 1 and not next(iter(folders)).exists()  # one folder, shared, then removed
    err = capsys.readouterr().err
    assert "b batch 8: FAILED RuntimeError: out of memory" in err and err.count(" s\n") == 4
