"""tools/model_libraries.py: timm, torchvision and transformers beside the installed torch. Here
without installing anything (--dry-run): the pairing, the constraint that holds torch, and the
fast, plain refusal where PyTorch's CPU index cannot be reached."""

import importlib.util
import os
import subprocess
import sys

import torch

from .conftest import ROOT

SCRIPT = ROOT / "tools" / "model_libraries.py"


def _module():
    spec = importlib.util.spec_from_file_location("model_libraries", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchvision_pairs_with_torch():
    m = _module()
    assert m.torchvision_for("2.13.0+cpu") == "0.28.0" and m.torchvision_for("2.11.0+cu130") == "0.26.0"
    assert m.torchvision_for("2.14.1") == "0.29.1"


def test_an_unreachable_cpu_index_costs_seconds_and_says_what_to_do():
    env = dict(os.environ, NIMBLE_CPU_INDEX="http://127.0.0.1:9")  # nothing listens on port 9
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert f"torch {torch.__version__}" in done.stdout and "is kept" in done.stdout
    assert "-c " in done.stdout and "transformers" in done.stdout  # installed under the constraint
    if torch.version.cuda is None:  # a CPU torch: torchvision's CPU build, from an index that is not there
        assert done.returncode == 1 and "unreachable" in done.stderr and "--find-links" in done.stderr
        assert "timm: not installed: timm imports torchvision" in done.stderr
        # one short look at the index, then no pip run against it (pip would retry for minutes)
        assert "torchvision==" not in done.stdout and "--extra-index-url" not in done.stdout
