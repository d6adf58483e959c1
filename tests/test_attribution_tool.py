"""`tools/attribution.py`: kernel diff rows grouped by op class across models, the sweep's losers
picked out, and one line for a file that is not a result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "attribution.py"


def _row(model: str, batch: int, **classes) -> dict:
    return {"model": model, "batch": batch, "precision": "fp32",
            "classes": {cls: {"nimble_ms": ours, "torch_compile_ms": theirs} for cls, (ours, theirs) in classes.items()}}


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_losses_sum_per_class_over_the_sweep_s_losers_only(tmp_path):
    diffs = tmp_path / "kernel_diff_a.json"
    diffs.write_text(json.dumps({"rows": [
        _row("net_a", 1, convolution=(0.30, 0.10), GEMM=(0.10, 0.20)),
        _row("net_b", 1, convolution=(0.15, 0.10), epilogue=(0.20, 0.05)),
        _row("net_c", 8, convolution=(0.90, 0.10)),  # wins in the sweep: left out
    ]}))
    later = tmp_path / "kernel_diff_b.json"  # a later file's row replaces the earlier one
    later.write_text(json.dumps({"rows": [_row("net_b", 1, convolution=(0.12, 0.10), epilogue=(0.20, 0.05))]}))
    sweep = tmp_path / "sweep.jsonl"
    sweep.write_text("\n".join(json.dumps({"model": m, "batch": b, "precision": "fp32",
                                           "gpu_bound_ms": {"nimble": n, "torch_compile": 1.0}})
                               for m, b, n in [("net_a", 1, 0.9), ("net_b", 1, 1.1), ("net_c", 8, 0.5),
                                               ("net_d", 1, 0.95)]))
    done = _run(diffs, later, "--sweep", sweep, "--out", tmp_path, "--tag", "t")
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "attribution_t.json").read_text())
    conv = doc["classes"]["convolution"]
    assert round(conv["lost_ms"], 6) == round(0.20 + 0.02, 6) and len(conv["losing"]) == 2
    assert conv["losing"][0]["model"] == "net_a"  # the worst first
    assert round(doc["classes"]["GEMM"]["gained_ms"], 6) == 0.1 and doc["classes"]["GEMM"]["winning"] == 1
    assert list(doc["classes"])[0] == "convolution"  # ordered by what is lost
    assert "no kernel diff yet: net_d b1 fp32" in done.stdout
    listed = _run("--list", "--sweep", sweep)
    assert listed.stdout.split("\n")[:3] == ["net_a 1 fp32", "net_b 1 fp32", "net_d 1 fp32"]


def test_a_file_that_is_no_kernel_diff_gets_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"batch": 1}]}))
    done = _run(bad)
    assert done.returncode == 2 and "not a kernel diff result" in done.stderr
    assert "Traceback" not in done.stderr
    assert _run(tmp_path / "missing.json").returncode == 2
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "not a kernel diff result" in _run(tmp_path / "list.json").stderr
    (tmp_path / "s.jsonl").write_text("{nope")
    assert "not a sweep result" in _run(bad, "--sweep", tmp_path / "s.jsonl").stderr
    assert "give --sweep" in _run("--list").stderr
