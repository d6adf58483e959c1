"""bench reports as trtexec does: how many inferences it timed, percentiles computed one way (the
median among them), throughput from the timed run itself and, labelled, back to back; and it warns
when a percentile rests on too few inferences to differ from the max."""

from pathlib import Path

from nimble.runtime.base.timing import Timing, percentile, samples_behind

from ..conftest import SAMPLES
from .test_cli import invoke


def test_the_median_is_the_50th_percentile_of_the_same_sorted_values():
    t = Timing(latency_ms=[4.0, 1.0, 3.0, 2.0], enqueue_ms=[0.1] * 4)
    s = t.summary((50, 75))
    assert s["median_ms"] == s["p50_ms"] == percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert samples_behind(99, 7) == 0 and samples_behind(99, 1000) == 10 and samples_behind(90, 100) == 10


def test_the_report_counts_inferences_and_warns_on_thin_percentiles(tmp_path):
    out = tmp_path / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    result = invoke("bench", out, "--device", "cpu", "-n", "7", "--duration", "0", "--no-baselines")
    text = " ".join(result.stderr.replace("│", " ").split())
    assert result.exit_code == 0 and "over 7 timed inferences" in text and "inferences timed 7" in text
    assert "p90, p95, p99 rest on 7 timed inferences" in text and "raise --duration or --iterations" in text
    assert "speedup" not in text and "nimble: nimble" not in text
    assert "throughput /s (timed run)" in text and "back to back /s (no sync)" in text


def test_bench_times_the_users_inputs_checked_as_run_checks_them(tmp_path):
    import numpy as np

    out = tmp_path / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    good, bad = tmp_path / "x.npy", tmp_path / "bad.npy"
    np.save(good, np.random.randn(1, 3, 32, 32).astype("float32"))
    np.save(bad, np.random.randn(1, 3, 16, 16).astype("float32"))
    result = invoke("bench", out, "--device", "cpu", "-n", "5", "--duration", "0", "-i", good, "--json")
    import json

    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["inputs"] == "given" and set(doc["results"]) == {"nimble", "eager"}
    result = invoke("bench", out, "--device", "cpu", "-n", "5", "--duration", "0", "-i", bad)
    assert result.exit_code == 1 and "must be float32[1, 3, 32, 32], got float32[1, 3, 16, 16]" in result.stderr


def test_progress_shows_in_a_log(tmp_path):
    """Where stderr is not a terminal (a CI log, here CliRunner), each stage is one '... ' line."""
    result = invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", tmp_path / "r.nimble")
    stages = [line for line in result.stderr.splitlines() if line.startswith("... ")]
    assert result.exit_code == 0 and "... resnet.pt: lowering" in stages and "... resnet.pt: writing r.nimble" in stages
    assert not any("pass " in line for line in stages)  # one line per stage, not per pass


def test_iterations_and_duration_are_minimums_as_in_trtexec(tmp_path):
    import json

    out = tmp_path / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    # a call takes milliseconds (tens on a machine busy with other tests): 1.5 s rules over 3 iterations
    doc = json.loads(invoke("bench", out, "--device", "cpu", "-n", "3", "--duration", "1.5", "--warmup", "0",
                            "--no-baselines", "--json").stdout)
    row = doc["results"]["nimble"]
    assert row["iterations"] > 3 and row["iterations"] * row["mean_ms"] >= 1.5 * 1000 * 0.9  # the duration ruled
    assert doc["settings"] == {"warmup_ms": 0.0, "duration_s": 1.5, "iterations": 3, "percentiles": [90.0, 95.0, 99.0]}


def test_trace_writes_a_perfetto_timeline_with_every_op_on_its_stream_track(tmp_path):
    import json

    out, trace = tmp_path / "i.nimble", tmp_path / "t.json"
    assert invoke("compile", SAMPLES / "inception.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    result = invoke("bench", out, "--device", "cpu", "-n", "3", "--duration", "0", "--no-baselines", "--trace", trace,
                    "--json")
    assert result.exit_code == 0, result.stderr
    doc, events = json.loads(result.stdout), json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e.get("cat") == "op"]
    from nimble.formats import read_artifact

    graph = read_artifact(out).graph
    assert sorted(e["args"]["op"] for e in ops) == list(range(len(graph.ops)))  # each op once
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 for e in ops)
    tracks = {e["tid"] for e in ops}
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 1}
    assert tracks == set(names) and all(names[t] == f"stream {t}" for t in tracks)
    assert any(e["name"].startswith("fused(") for e in ops) and all(e["args"]["source"] for e in ops)
    by_op = sorted(ops, key=lambda e: e["ts"])  # the CPU runs them serially, in the planned order
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(by_op, by_op[1:]))
    assert doc["trace"] == {"path": str(trace), "events": len(events), "streams": 1,
                            "op_list_ms": doc["trace"]["op_list_ms"], "replay_median_ms": None}
    assert "ui.perfetto.dev" in invoke("bench", out, "--device", "cpu", "-n", "1", "--duration", "0",
                                       "--no-baselines", "--trace", trace).stderr


def test_trace_refuses_a_path_it_cannot_write_before_loading(tmp_path):
    out = tmp_path / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    result = invoke("bench", out, "--device", "cpu", "--trace", tmp_path / "missing" / "t.json")
    assert result.exit_code == 2 and "--trace" in result.stderr and "does not exist" in result.stderr
    result = invoke("bench", out, "--device", "cpu", "--trace", out)
    assert result.exit_code == 2 and "the artifact itself" in result.stderr


def test_bench_needs_no_temporary_folder(tmp_path, monkeypatch):
    """The kernel count's graph file goes to a temporary folder; where none can be made the count is
    left out, not the bench (on the CPU there is no count and no folder)."""
    import tempfile

    from nimble_cli.bench import _graph_dump

    out = tmp_path / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    result = invoke("bench", out, "--device", "cpu", "-n", "3", "--duration", "0", "--no-baselines")
    assert result.exit_code == 0, result.stderr
    with _graph_dump(True) as dump:
        assert dump is None
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with _graph_dump(True) as dump:
        assert Path(dump).parent.is_dir() and Path(dump).parent.parent == tmp_path
    assert not Path(dump).parent.exists()
    with _graph_dump(False) as dump:
        assert dump is None


def test_a_run_keeps_to_its_time_on_a_slow_machine():
    """`until` ends a timed run (warm-up and back-to-back run included) once two inferences are
    timed, though --iterations asked for more: the bench ends within twice --duration."""
    import time

    from nimble.runtime.base.timing import measure
    from nimble.cli.bench import time_shares

    calls = []
    t = measure(lambda: (calls.append(1), time.sleep(0.05)), cuda=False, warmup_ms=1000, duration_s=0.1,
                iterations=50, until=time.perf_counter() + 0.2)
    assert 2 <= len(t.latency_ms) < 50 and len(calls) < 50
    shares = time_shares(4.0, ["nimble", "eager", "pytorch_graph"], 3)
    assert abs(shares["nimble"] + shares["eager"] + shares["pytorch_graph"] + 3 * shares["batch"] - 4.0) < 1e-9
    assert shares["nimble"] == 2 * (shares["eager"] + shares["pytorch_graph"]) / 2 and time_shares(1.0, ["nimble"], 0) == \
        {"nimble": 1.0, "batch": 0.0}


def test_no_speedup_is_printed_where_the_runs_were_unsteady(tmp_path, monkeypatch):
    import json

    import nimble.cli.bench

    out = tmp_path / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    monkeypatch.setattr(nimble.cli.bench, "CV_LIMIT", -1.0)  # every run over the limit
    result = invoke("bench", out, "--device", "cpu", "-n", "5", "--duration", "0", "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["speedup_vs"] == {} and set(doc["speedup_withheld"]) == {"eager"}
    text = " ".join(result.stderr.replace("│", " ").split())
    assert "nimble speedup - -" in text and "no speedup printed over eager: the coefficient of variation" in text
    monkeypatch.setattr(nimble.cli.bench, "CV_LIMIT", 1e9)
    doc = json.loads(invoke("bench", out, "--device", "cpu", "-n", "5", "--duration", "0", "--json").stdout)
    assert set(doc["speedup_vs"]) == {"eager"} and doc["speedup_withheld"] == {}
