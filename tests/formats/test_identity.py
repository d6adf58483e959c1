"""The op graphs, schedules and memory plans nimble writes for every bundled sample, through both
frontends, are those recorded in `golden_artifacts.json` for this torch version: a change meant
to keep behaviour (a refactor) must keep them. Absolute paths in source lines are normalised.
The full byte comparison against a git ref, weights and samples included, is
`python tools/identity.py --base REF` (same machine, both sides).

Regenerate after an intended change: NIMBLE_WRITE_GOLDEN=1 pytest tests/formats/test_identity.py"""

import hashlib
import json
import os
import re
import zipfile

import pytest
import torch

from tools.identity import emit, programs

from ..conftest import ROOT

GOLDEN = ROOT / "tests" / "golden_artifacts.json"
STRUCTURE = ("graph.json", "schedule.json", "memory.json")
VERSION = torch.__version__.split("+")[0]
# Source lines name files by absolute path: the checkout's (an exported sample), the machine that
# built a TorchScript sample, or torch's install.
_PATH = re.compile(rb'"[^"]*?/(sample_models|site-packages)/')


def normalised(data: bytes) -> bytes:
    return _PATH.sub(rb'"<path>/\1/', data)


def structure(folder) -> dict[str, dict[str, str]]:
    out = {}
    for path in sorted(folder.glob("*.nimble")):
        with zipfile.ZipFile(path) as z:
            out[path.stem] = {m: hashlib.sha256(normalised(z.read(m))).hexdigest() for m in STRUCTURE}
    return out


def test_samples_compile_to_the_recorded_graphs_schedules_and_plans(tmp_path):
    table = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    programs(tmp_path / "programs")
    emit(tmp_path / "programs", tmp_path / "out")
    now = structure(tmp_path / "out")
    assert len(now) == 16
    if os.environ.get("NIMBLE_WRITE_GOLDEN") == "1":
        table[VERSION] = now
        GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    if VERSION not in table:
        pytest.skip(f"no recorded artifacts for torch {VERSION} (CI's torch 2.13.0 has them)")
    differ = {name: [m for m in STRUCTURE if now[name][m] != want.get(m)]
              for name, want in table[VERSION].items() if now.get(name) != want}
    assert not differ, f"these artifacts changed: {differ}"
