"""What a serving replica measures about each call: rows, host time and, on a GPU, the device time
from CUDA events (the `nimble_device_busy_ms` metric that says how busy the replicas keep a GPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from nimble.serve.protocol import decode

from .test_protocol import request


def _replica(tmp_path, device: str, timeline=None):
    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.serve.replica import Replica
    from nimble.specs import input_specs

    from ..conftest import SAMPLES

    path = tmp_path / "r.nimble"
    write_artifact(path, compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device=device,
                                       batch_sizes=[1, 2, 4]).artifact())
    seen = []
    replica = Replica(path, "r", device, observe=lambda *call: seen.append(call), timeline=timeline)
    return replica, seen


def _requests(replica, rows: list[int]):
    out = []
    for k, n in enumerate(rows):
        x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(k))
        out.append(decode(request([{"name": "x", "datatype": "FP32", "shape": [n, 3, 32, 32],
                                    "data": x.flatten().tolist()}]), None, replica.info))
    return out


def test_each_call_is_observed_once_with_its_rows_and_no_device_time_on_the_cpu(tmp_path):
    replica, seen = _replica(tmp_path, "cpu")
    replica.infer(_requests(replica, [1, 2, 1]))  # one call of 4 rows
    replica.infer(_requests(replica, [2, 1]))  # one of 3 rows, padded to 4
    assert [(rows, device) for rows, _, _, device in seen] == [(4, None), (3, None)]
    assert all(compute > 0 and queue >= 0 for _, queue, compute, _ in seen)
    assert replica.stats.device_ns == 0 and replica.stats.calls == 2 and replica.stats.rows == 7


@pytest.mark.gpu
def test_a_gpu_calls_device_time_comes_from_its_events_and_fits_inside_the_call(tmp_path):
    from nimble.serve import timeline

    (tmp_path / "t").mkdir()
    replica, seen = _replica(tmp_path, "cuda", timeline=tmp_path / "t")
    reqs = _requests(replica, [1, 2, 1])
    answers = replica.infer(reqs)
    [(gpu, calls)] = timeline.read(tmp_path / "t").items()
    assert gpu.startswith("GPU-") and [c["rows"] for c in calls] == [4]
    host, on_gpu = calls[0]["host"], calls[0]["gpu"]
    # the events, mapped to the host's clock, fall inside the call (within the mapping's error)
    assert host[0] - 1e-3 <= on_gpu[0] < on_gpu[1] <= host[1] + 1e-3
    assert [rows for rows, *_ in seen] == [4]
    _, _, compute, device = seen[0]
    assert 0 < device <= compute  # the events lie inside the host's timing of the call
    assert replica.stats.device_ns == int(device * 1e9)
    assert all(not a[0].is_cuda for a in answers)  # answers were copied out before the events' end


def test_the_busy_part_counts_overlapping_calls_once_and_only_inside_the_window():
    from nimble.serve.timeline import union_seconds

    assert union_seconds([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)], 0.0, 10.0) == 2.5  # two overlap, one apart
    assert union_seconds([(0.0, 1.0), (0.2, 0.4)], 0.0, 10.0) == 1.0  # one inside another
    assert union_seconds([(-5.0, 1.0), (9.0, 20.0)], 0.0, 10.0) == 2.0  # clipped to the window
    assert union_seconds([(11.0, 12.0)], 0.0, 10.0) == 0.0


def test_a_timeline_file_written_by_anyone_else_is_read_without_a_crash(tmp_path):
    """The files are read by the benchmark after a run: junk lines, a line cut short, huge lines,
    intervals that run backwards and wrong types are skipped, never raised on."""
    from nimble.serve import timeline

    good = {"received": 0.5, "host": [1.0, 2.0], "gpu": [1.1, 1.9], "rows": 4}
    (tmp_path / "replica-1.jsonl").write_text("\n".join([
        json.dumps({"device": "GPU-a"}), json.dumps(good), "not json", json.dumps([1, 2]),
        json.dumps({"gpu": [3.0, 2.0]}), json.dumps({"gpu": ["a", "b"], "host": None}),
        json.dumps({"host": [0, 1e9]}) + " " * 5000, '{"host": [2.0, 2.5], "rows"']))
    (tmp_path / "replica-2.jsonl").write_text(json.dumps({"device": "GPU-a"}) + "\n" + json.dumps(
        {"host": [1.5, 3.0], "gpu": [1.5, 2.5], "rows": 1}) + "\n")
    (tmp_path / "replica-3.jsonl").write_bytes(b"\xff\xfe\n")
    (tmp_path / "other.jsonl").write_text(json.dumps({"device": "GPU-b"}) + "\n" + json.dumps(good) + "\n")
    calls = timeline.read(tmp_path)
    assert list(calls) == ["GPU-a"] and len(calls["GPU-a"]) == 2
    assert timeline.busy(tmp_path, 1.0, 3.0) == {"GPU-a": pytest.approx((2.5 - 1.1) / 2.0)}
    with pytest.raises(ValueError, match="empty"):
        timeline.busy(tmp_path, 3.0, 3.0)


def test_a_link_planted_where_a_replica_writes_its_timeline_is_refused(tmp_path):
    from nimble.serve import timeline

    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / f"replica-{os.getpid()}.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        timeline.Writer(tmp_path, "cpu")
    assert target.read_text() == "keep"


def test_a_requests_stages_are_the_medians_of_well_formed_lines_inside_the_window(tmp_path):
    from nimble.serve import timeline

    lines = [{"device": "cpu"},
             {"request": [1.0, 1.001, 1.002, 1.006, 1.007]},  # 1 ms to decode, 1 to wait, 4 of call, 1 back
             {"request": [2.0, 2.003, 2.004, 2.008, 2.009]},
             {"request": [2.5, 2.503, 2.504, 2.508, 2.509]},
             {"request": [0.5, 0.6, 0.7, 0.8, 0.9]},  # taken before the window
             {"request": [3.0, 2.0, 3.1, 3.2, 3.3]},  # runs backwards
             {"request": [3.0, 3.1, "x", 3.2, 3.3]}, {"request": [3.0]}, {"host": [1.0, 1.5], "rows": 1}]
    (tmp_path / "replica-1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = timeline.stages(tmp_path, 1.0, 3.0)
    assert got["requests"] == 3
    assert got["taken to decoded"] == pytest.approx(3.0) and got["call"] == pytest.approx(4.0)
    assert got["decoded to call"] == pytest.approx(1.0) and got["call to encoded"] == pytest.approx(1.0)
    assert got["in the replica"] == pytest.approx(9.0)
    assert timeline.stages(tmp_path, 5.0, 6.0) is None
