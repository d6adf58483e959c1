"""benchmarks/pack_size.py on the CPU builder: a bundled sample compiled with its pack for one
architecture, no GPU visible, and the table it writes from the sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pack_size  # noqa: E402  (benchmarks/pack_size.py: a script, not a package)


def test_a_sample_s_pack_is_counted_and_measured_against_its_artifact(tmp_path):
    assert pack_size.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--models", "resnet"]) == 0
    doc = json.loads((tmp_path / "out" / "pack_size.json").read_text())
    (row,) = doc["rows"]
    artifact, pack = tmp_path / "work" / "resnet.nimble", tmp_path / "work" / "resnet.nimble.kernels"
    assert row["artifact_bytes"] == artifact.stat().st_size and row["pack_bytes"] == pack.stat().st_size
    assert row["kernels"] and row["kernels"] > 0  # the pack reads as a load that names it reads it
    assert row["share"] == row["pack_bytes"] / row["artifact_bytes"]
    text = (tmp_path / "out" / "pack_size.md").read_text()
    assert "| resnet |" in text and "Largest share: resnet" in text and "sm_90" in text


def test_a_pack_the_load_would_not_use_counts_no_kernels(tmp_path):
    bad = tmp_path / "bad.kernels"
    bad.write_bytes(b"not a pack")
    assert pack_size.kernels_in(bad, "sm_90") is None
