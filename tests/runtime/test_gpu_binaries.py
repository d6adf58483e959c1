"""Generated kernels launched from a recorded binary (`runtime/kernels/binaries.py`): a second process
runs them without importing Triton and gets Triton's results; a changed binary or a new
alignment goes back to Triton; a warm load of a sample model imports no Triton. Each process is
fresh, with its own nimble and Triton cache folders. Run with `pytest -m gpu`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

LAUNCH = """
import json, sys
import torch
from nimble.runtime.kernels import fused as kernels, generated
from nimble.runtime.kernels import binaries
x = torch.linspace(-3, 3, 4099, device="cuda")
y = torch.linspace(1, 2, 4099, device="cuda")
out = torch.full_like(x, float("nan"))
offset = int(sys.argv[1])
xs, ys, outs = x[offset:], y[offset:], out[offset:]
kernel = generated.define(sys.argv[2])
kernel[(-(-xs.numel() // 1024),)](outs, xs, ys, N=xs.numel(), BLOCK=1024)
torch.cuda.synchronize()
ok = bool(torch.equal(outs, torch.maximum(xs * ys, torch.zeros_like(xs))))
print(json.dumps({"ok": ok, "triton": "triton" in sys.modules, "recalled": binaries.STATS.recalled,
                  "remembered": binaries.STATS.remembered}))
"""

SOURCE = """import triton
import triton.language as tl


@triton.jit
def kernel(out_ptr, x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    v = tl.load(x_ptr + i, mask=mask) * tl.load(y_ptr + i, mask=mask)
    tl.store(out_ptr + i, tl.maximum(v, 0.0), mask=mask)
"""


def env(tmp_path: Path) -> dict:
    root = Path(__file__).resolve().parents[2]
    return dict(os.environ, NIMBLE_CACHE_DIR=str(tmp_path / "nimble"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
                PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")])))


def launch(tmp_path: Path, offset: int = 0) -> dict:
    done = subprocess.run([sys.executable, "-c", LAUNCH, str(offset), SOURCE], env=env(tmp_path),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_runs_the_binary_without_triton(tmp_path):
    first = launch(tmp_path)
    assert first == {"ok": True, "triton": True, "recalled": 0, "remembered": 1}
    assert len(list((tmp_path / "nimble" / "binaries").glob("*.json"))) == 1
    assert launch(tmp_path) == {"ok": True, "triton": False, "recalled": 1, "remembered": 0}
    # one element off: the pointers lose their 16-byte alignment, a signature Triton builds anew
    assert launch(tmp_path, offset=1) == {"ok": True, "triton": True, "recalled": 0, "remembered": 1}
    assert launch(tmp_path, offset=1) == {"ok": True, "triton": False, "recalled": 1, "remembered": 0}


def test_a_binary_of_another_digest_or_gone_is_not_launched(tmp_path):
    launch(tmp_path)
    (record_path,) = (tmp_path / "nimble" / "binaries").glob("*.json")
    record = json.loads(record_path.read_text())
    binary = Path(record["binary"])
    assert binary.is_relative_to((tmp_path / "triton").resolve())
    record_path.write_text(json.dumps({**record, "sha256": "0" * 64}))  # the file is not the one recorded
    again = launch(tmp_path)
    assert again["ok"] and again["triton"] and again["recalled"] == 0
    shutil.rmtree(binary.parent)  # Triton's cache emptied: Triton builds it again
    gone = launch(tmp_path)
    assert gone["ok"] and gone["triton"] and gone["recalled"] == 0 and gone["remembered"] == 1
    assert launch(tmp_path)["recalled"] == 1


LOAD = """
import json, sys
import torch
import nimble
from nimble.runtime.kernels import binaries
from nimble.runtime.base.compare import compare
exe = nimble.load(sys.argv[1], device="cuda")
art = exe.artifact
result = compare(exe.run(*art.sample_inputs), art.sample_outputs, rtol=1e-2, atol=1e-3)
print(json.dumps({"ok": result.passed, "triton": "triton" in sys.modules, "recalled": binaries.STATS.recalled,
                  "load_recalled": exe.stats.kernel_binaries_recalled, "generated": exe.stats.kernels_generated,
                  "fallbacks": exe.stats.kernel_fallbacks,
                  "prebuilt": None if exe.stats.prebuilt is None else exe.stats.prebuilt.built}))
"""


@pytest.mark.parametrize("name", ["inception", "mobilenet"])  # max pooling; generated epilogues
def test_a_warm_load_imports_no_triton(sample_artifacts, tmp_path, name):
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", LOAD, str(sample_artifacts[name])], env=env(tmp_path),
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["ok"] and warm["ok"] and cold["fallbacks"] == warm["fallbacks"] == []
    # as the load reports it. A cold load recalls too: a kernel that several ops launch with one
    # signature is built by Triton once, then loaded from its record for the other ops
    assert cold["load_recalled"] == cold["recalled"] and warm["load_recalled"] == warm["recalled"]
    # a cold load builds what its walk finds before the first op (`prebuild.py`), then runs it from
    # the records; a warm one finds its tuning cached, walks nothing and imports no Triton
    assert warm["prebuilt"] is None and not warm["triton"], (cold, warm)
    # (the cold load also times every tuning candidate, so it recalls more kernels than the warm
    # one, which launches only the chosen). Its builds run in Triton, in this process or, for 48
    # kernels and more on 8 cores and more, in processes of their own (`aot.build_described`)
    if cold["generated"]:
        assert cold["prebuilt"] > 0 and cold["recalled"] > 0 and warm["recalled"] > 0, (cold, warm)
    else:
        assert warm["recalled"] == 0
