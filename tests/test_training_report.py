"""benchmarks/training.py's report (no GPU): rows merge by model, batch, size and precision, and a
file measured with allocated-memory peaks leaves torch.compile's peak out (its CUDA graph trees'
pool is not in `max_memory_allocated`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _row(precision: str, **more) -> dict:
    return {"model": "resnet50", "batch": 32, "size": 224, "precision": precision, "eager_ms": 20.0,
            "eager_again_loss_rel_diff": [0.0, 0.0, 0.0], "step_loss_rel_diff": [0.0, 1e-3, 2e-3],
            "step_ms": 15.0, "compile_ms": 10.0, "compile_peak_mb": 9.0, "step_peak_mb": 3000.0, **more}


def test_fp32_and_bf16_rows_of_one_model_stay_apart_and_allocated_peaks_of_compile_are_left_out(tmp_path):
    meta = {"gpu": "H200", "torch": "2.11", "date": "2026-11-30"}
    (tmp_path / "a.json").write_text(json.dumps({"meta": meta, "rows": [_row("fp32", nimble_ms=17.0)]}))
    (tmp_path / "b.json").write_text(json.dumps({"meta": {**meta, "peak": "reserved"},
                                                 "rows": [_row("bf16", compile_peak_mb=2500.0)]}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "training.py"), "--report",
                           str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "out" / "training.json").read_text())["rows"]
    assert sorted(r["precision"] for r in rows) == ["bf16", "fp32"]
    by = {r["precision"]: r for r in rows}
    assert by["fp32"]["compile_peak_mb"] is None and by["bf16"]["compile_peak_mb"] == 2500.0
    text = (tmp_path / "out" / "training.md").read_text()
    assert "| resnet50 | 224 | 32 | fp32 | 20.00 | 10.00 | 17.00 | 15.00 | 1.50 |" in text
    assert "| resnet50 | 224 | 32 | bf16 | 20.00 | 10.00 | n/a | 15.00 | 1.50 |" in text
    assert "n/a / 3000" in text and "2500 / 3000" in text


def test_a_channels_last_eager_row_is_reported_beside_eager(tmp_path):
    meta = {"gpu": "H200", "torch": "2.11", "date": "2026-11-30", "peak": "reserved"}
    (tmp_path / "a.json").write_text(json.dumps({"meta": meta, "rows": [
        _row("fp32", eager_channels_last_ms=14.5, eager_channels_last_peak_mb=3100.0)]}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "training.py"), "--report",
                           str(tmp_path / "a.json"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "out" / "training.md").read_text()
    assert "resnet50 b32 fp32 14.50 ms against 20.00, peak 3100 MiB" in text
