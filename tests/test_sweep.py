"""benchmarks/sweep.py's bookkeeping, which runs without a GPU: shards, the rows a model that
fails or hangs still leaves, going on where a call stopped, and the report's ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_turns  # noqa: E402  (benchmarks/: scripts, not a package)
import sweep  # noqa: E402
import sweep_report  # noqa: E402


def row(model, batch, nimble, compiled, graph=None, precision="fp32"):
    ms = {"nimble": nimble, "torch_compile": compiled, **({"inductor_graph": graph} if graph else {})}
    return {"model": model, "batch": batch, "precision": precision, "gpu_bound_ms": ms,
            "latency_ms": {"nimble": 1.0, "torch_compile": 2.0}}


def test_shards_cover_every_model_once_and_a_bad_shard_is_one_line():
    names = [f"m{k}" for k in range(7)]
    parts = [sweep.shard(names, f"{i}/3") for i in range(3)]
    assert sorted(sum(parts, [])) == sorted(names) and all(parts)
    for bad in ("3/3", "a/2", "1"):
        with pytest.raises(SystemExit, match="--shard"):
            sweep.shard(names, bad)


def test_a_model_that_hangs_leaves_a_row_per_batch_it_did_not_finish(tmp_path, monkeypatch):
    script = tmp_path / "fake.py"
    script.write_text("import json, time\nprint('ROW ' + json.dumps({'model': 'm', 'batch': 1}), flush=True)\n"
                      "time.sleep(30)\n")
    monkeypatch.setattr(sweep, "__file__", str(script))
    with (tmp_path / "log").open("w") as log:
        rows = sweep.run_model("m", [1, 8], "fp32", 3, log)
    assert rows[0] == {"model": "m", "batch": 1}
    assert rows[1]["batch"] == 8 and rows[1]["error"].startswith("timeout")


def test_the_report_gives_ratios_geometric_means_and_the_worst(tmp_path):
    sink = tmp_path / "sweep_fp32_a.jsonl"
    meta = {"gpu": "H200", "torch": "2.11", "date": "2026-11-30", "command": "c"}
    rows = [row("a", 8, 1.0, 2.0, 1.25), row("b", 8, 3.0, 2.0, 2.0), {"model": "c", "batch": 8, "error": "timeout 3 s"}]
    sink.write_text("\n".join(json.dumps(r) for r in [{"meta": meta}, *rows]) + "\n")
    later = tmp_path / "sweep_fp32_b.jsonl"
    later.write_text(json.dumps({"meta": meta}) + "\n" + json.dumps(row("a", 8, 1.0, 4.0, 1.0)) + "\n")
    got = sweep_report.read_rows([sink, later])
    assert {r["model"]: r for r in got}["a"]["gpu_bound_ms"]["torch_compile"] == 4.0  # the later file wins
    text = sweep_report.summary(got, meta)
    assert "nimble / torch_compile: geometric mean 0.612 over 2 models; over 0.8: 1 (b)" in text  # sqrt(0.25 * 1.5)
    assert "nimble / inductor_graph: geometric mean 1.225 over 2 models; over 0.9: 2 (a, b)" in text
    assert "worst ten by nimble / torch_compile: b 1.500, a 0.250" in text
    assert "no figures: c (timeout 3 s)" in text


def test_max_autotune_rows_make_a_table_of_their_own_and_skip_done_keeps_the_modes_apart(tmp_path):
    meta = {"gpu": "H200", "torch": "2.11", "date": "2026-11-30", "command": "c"}
    tuned = {"model": "a", "batch": 8, "precision": "fp32", "peer": "max-autotune", "max_autotune_s": 241.0,
             "gpu_bound_ms": {"nimble": 0.9, "max_autotune": 1.0}, "latency_ms": {"nimble": 1.0, "max_autotune": 1.0}}
    rows = sweep_report.read_rows([_jsonl(tmp_path / "x.jsonl", meta, row("a", 8, 1.0, 2.0), tuned)])
    assert len(rows) == 2  # the same model and batch under two modes: two rows
    text = sweep_report.summary(rows, meta)
    assert '## fp32, batch 8, torch.compile(mode="max-autotune")' in text
    assert "nimble / max_autotune: geometric mean 0.900 over 1 models; over 0.9: 0 (none)" in text
    assert "compile (its first three calls): a 241 s" in text


def _jsonl(path, meta, *rows):
    path.write_text("\n".join(json.dumps(r) for r in [{"meta": meta}, *rows]) + "\n")
    return path


@pytest.mark.parametrize("text", ["not json\n", '{"meta": {}}\n[1, 2]\n', '{"meta": {}}\n{"batch": 8}\n', "\xff\xfe"])
def test_a_file_that_is_not_sweep_rows_is_one_line(tmp_path, text):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(text.encode("latin-1"))
    with pytest.raises(SystemExit, match="bad.jsonl: (line|cannot)"):
        sweep_report.read_rows([bad])


def test_report_refuses_a_file_without_its_run_description(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps(row("a", 8, 1.0, 2.0)) + "\n")
    with pytest.raises(SystemExit, match="first line is not the run description"):
        sweep_report.first_meta(bad)


def test_jobs_run_side_by_side_and_no_model_starts_past_the_budget():
    import threading
    import time

    now, most, lock = [0], [0], threading.Lock()

    def one(name):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.2)
        with lock:
            now[0] -= 1
        return name, 0.0, [{"model": name}]
    started = []

    def may_start():
        started.append(len(started))
        return len(started) <= 5
    got = [r[0] for r in sweep.scheduled([f"m{k}" for k in range(8)], 3, one, may_start)]
    assert sorted(got) == [f"m{k}" for k in range(5)]  # the sixth found the budget spent
    assert most[0] == 3


TURNS = """
import json, os, sys, time
sys.path.insert(0, {benchmarks!r})
import gpu_turns
gpu_turns.join()
if sys.argv[1] == "busy":  # a neighbour compiling: a stamp every 10 ms until the parent ends it
    while True:
        with open(sys.argv[2], "a") as f:
            f.write(f"{{time.monotonic()}}\\n")
        time.sleep(0.01)
spans = []
for _ in range(3):
    with gpu_turns.turn():
        with gpu_turns.turn():  # a turn within a turn is the same turn
            a = time.monotonic()
            time.sleep(0.15)
            spans.append((a, time.monotonic()))
    time.sleep(0.05)
print(json.dumps(spans))
"""


def test_a_turn_holds_the_gpu_alone_and_stops_the_neighbours(tmp_path):
    import os
    import subprocess
    import time

    script = tmp_path / "turns.py"
    script.write_text(TURNS.format(benchmarks=str(Path(sweep.__file__).parent)))
    lock = str(tmp_path / "gpu.lock")
    env = {**os.environ, gpu_turns.LOCK_ENV: lock}
    stamps = tmp_path / "stamps"
    busy = subprocess.Popen([sys.executable, str(script), "busy", str(stamps)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not stamps.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs = [subprocess.Popen([sys.executable, str(script), "turns"], stdout=subprocess.PIPE, text=True,
                                  env=env, start_new_session=True) for _ in range(3)]
        spans = sorted(sum((json.loads(p.communicate(timeout=60)[0]) for p in procs), []))
    finally:
        gpu_turns.leave(lock, busy.pid)
        busy.wait(timeout=30)
        gpu_turns.forget(lock)
    assert len(spans) == 9
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans  # each turn ends before the next begins
    ticks = [float(t) for t in stamps.read_text().split()]
    inside = [t for t in ticks for a, b in spans if a < t < b]
    assert not inside, inside  # the neighbour stood still through every turn
    assert any(t > spans[-1][1] for t in ticks) or any(spans[0][0] > t for t in ticks)  # and ran outside them
    assert not (tmp_path / "gpu.lock.members").exists()
